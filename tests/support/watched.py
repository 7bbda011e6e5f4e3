"""Upstream servers that say when each connection opens and when it closes: what the revocation
tests read to prove, from the far end of the wire, that a revoked connection's upstream socket
really closed (not merely that the client lost its side).

- `WatchedServer`: TLS or plain TCP; `mode="echo"` sends every byte back (a passthrough tunnel or
  a raw TCP relay), `mode="http"` answers every HTTP/1.1 request head with a small 200 and keeps
  the connection alive (an inspected tunnel).
- `WebSocketOrigin`: the `websockets` library's server (TLS or not), echoing text messages as
  `echo: <text>` and recording each connection's path and its end.

Both keep the number of connections opened and closed under one condition variable; tests wait on
it (`wait_closed`), never sleep.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from pathlib import Path

from tests.support.tcp_origin import accept_forever  # noqa: F401  (imported from here too)

WAIT = 10.0


class _Watch:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.opened = 0
        self.closed = 0
        self.paths: list[str] = []
        self.received: list[bytes | str] = []  # WebSocket messages, echo bytes: what reached this origin

    def _open(self, path: str | None = None) -> None:
        with self.cond:
            self.opened += 1
            if path is not None:
                self.paths.append(path)
            self.cond.notify_all()

    def _close(self) -> None:
        with self.cond:
            self.closed += 1
            self.cond.notify_all()

    def wait_opened(self, n: int = 1, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.opened >= n, timeout)

    def wait_closed(self, n: int = 1, timeout: float = WAIT) -> bool:
        """True once `n` connections have closed at this server (the gateway's side went away)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.closed >= n, timeout)

    def wait_idle(self, timeout: float = WAIT) -> bool:
        """True once every connection opened here has closed."""
        with self.cond:
            return self.cond.wait_for(lambda: self.opened == self.closed, timeout)

    def _received(self, data) -> None:
        with self.cond:
            self.received.append(data)

    @property
    def open_now(self) -> int:
        with self.cond:
            return self.opened - self.closed

    def reset(self) -> None:
        with self.cond:
            self.opened = self.closed = 0
            self.paths.clear()
            self.received.clear()


class WatchedServer(_Watch):
    def __init__(self, host: str, port: int, cert: Path | None = None, key: Path | None = None, mode: str = "echo"):
        super().__init__()
        self.host, self.mode = host, mode
        self._tls = None
        if cert is not None:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(str(cert), str(key))
            self._tls.set_alpn_protocols(["http/1.1"])
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stopped = False
        threading.Thread(target=accept_forever, args=(self._sock, self._handle, lambda: self._stopped),
                         daemon=True).start()

    def _handle(self, conn: socket.socket, addr=None) -> None:
        self._open()
        try:
            conn.settimeout(60)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            if self.mode == "echo":
                self._echo(conn, self._received)
            else:
                self._http(conn)
        except (OSError, ssl.SSLError):
            pass
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            self._close()

    @staticmethod
    def _echo(conn: socket.socket, record) -> None:
        while data := conn.recv(65536):
            record(data)
            conn.sendall(data)

    @staticmethod
    def _http(conn: socket.socket) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            target = head.split(b"\r\n", 1)[0].split(b" ")[1] if b" " in head else b"?"
            body = b"watched: " + target + b"\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class WebSocketOrigin(_Watch):
    def __init__(self, host: str, port: int, cert: Path | None = None, key: Path | None = None):
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.server import serve

        super().__init__()
        context = None
        if cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(cert), str(key))

        def handler(ws) -> None:
            self._open(ws.request.path)
            try:
                for message in ws:
                    self._received(message)
                    ws.send(f"echo: {message}")
            except ConnectionClosed:
                pass
            finally:
                self._close()

        self._server = serve(handler, host, port, ssl=context, ping_interval=None)
        self.port = self._server.socket.getsockname()[1]
        self._stopped = False
        # The library's own handler per connection, from an accept loop that survives a failed
        # accept (`serve_forever` ends at the first one).
        threading.Thread(target=accept_forever, args=(self._server.socket, self._server.handler, lambda: self._stopped),
                         daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):  # (wakes the accept; the library's shutdown() would wait
            self._server.socket.shutdown(socket.SHUT_RDWR)  # for a serve_forever that never ran)
        self._server.socket.close()
