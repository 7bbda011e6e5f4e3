"""An HTTP/1.1 origin that reads bodies the way careless servers do: the CL.0 desync target.

It keeps every connection alive and reads only request heads where it "knows" no body matters:
on GET, HEAD, OPTIONS and DELETE, and on any method under `/static/` (a static file or a
server-level redirect, the classic CL.0 endpoint). Whatever body such a request carried is read
as the next request on the connection. Elsewhere it honours Content-Length (no chunked support,
like many small servers). Every request it executes is recorded with its connection number and the
Host it named, and answered `200` with the body `<METHOD> <host> <path>`, so a test can tell which
request an answer belongs to. Leftover bytes are acted on only when more bytes arrive (or the peer
closes), so a proxy that reuses the connection deterministically gets the leftovers' answer for
its next request.

Scripted paths misbehave on purpose:
- `/interim/<n>`: n interim `103 Early Hints` responses, then the final one;
- `/continue-then-close`: `100 Continue`, then the connection closes;
- `/early`: answers `401` at once, before reading the request body, which it then reads as the
  next request (an origin that rejects an upload without draining it); `/early-close` answers the
  same and closes the connection.
"""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass

IGNORED_BODY_METHODS = {"GET", "HEAD", "OPTIONS", "DELETE"}


@dataclass
class Executed:
    connection: int
    method: str
    path: str
    host: str | None
    headers: dict[str, str]


class LenientOrigin:
    def __init__(self, address: str, port: int, cert=None, key=None):
        self.executed: list[Executed] = []
        self.answered = 0  # responses sent, 400s to garbage included
        self.connections = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._tls = None
        if cert is not None:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(str(cert), str(key))
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, port))
        self._sock.listen(32)
        threading.Thread(target=self._serve, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.executed.clear()
            self.connections = 0

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Executed]:
        """The executed requests, once there are at least `count` (or the timeout passed)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.executed) >= count, timeout)
            return list(self.executed)

    def wait_answered(self, count: int, timeout: float = 10.0) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self.answered >= count, timeout)
            return self.answered

    def _answer(self, conn, data: bytes) -> None:
        conn.sendall(data)
        with self._changed:
            self.answered += 1
            self._changed.notify_all()

    def stop(self) -> None:
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except (ConnectionAbortedError, InterruptedError):
                continue  # that one connection only (tests/support/watched.py accept_forever)
            except OSError:
                return
            with self._lock:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self._handle, args=(client, number), daemon=True).start()

    def _handle(self, raw: socket.socket, number: int) -> None:
        raw.settimeout(10)
        try:
            conn = self._tls.wrap_socket(raw, server_side=True) if self._tls else raw
        except (OSError, ssl.SSLError):
            raw.close()
            return
        buf = b""
        eof = False
        ignored = False  # the last request's body was left unread, in `buf`
        try:
            while True:
                if ignored and buf and not eof:
                    # Leftovers of the last request (a body it ignored) are acted on only once more
                    # bytes arrive or the peer closes: the timing a desync attack aims for, made
                    # deterministic. A proxy that reuses this connection gets the leftovers' answer.
                    chunk = conn.recv(65536)
                    eof = not chunk
                    buf += chunk
                ignored = False
                while b"\r\n\r\n" not in buf:
                    if eof:
                        return
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                if len(parts) != 3:
                    self._answer(conn, b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    continue
                method, path, _ = parts
                fields = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    fields[name.strip().lower()] = value.strip()
                with self._changed:
                    self.executed.append(Executed(number, method, path, fields.get("host"), fields))
                    self._changed.notify_all()
                if path == "/close":
                    return
                if path == "/continue-then-close":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    return
                if path == "/early-close":
                    self._answer(conn, b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 4\r\n\r\nnope")
                    return
                if path == "/early":
                    self._answer(conn, b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 4\r\n\r\nnope")
                    ignored = True
                    continue  # the body, unread, is "the next request"
                if method in IGNORED_BODY_METHODS or path.startswith("/static/"):
                    ignored = True
                else:
                    length = int(fields.get("content-length", "0") or 0)
                    while len(buf) < length:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    buf = buf[length:]
                if path.startswith("/interim/"):
                    for _ in range(int(path.rsplit("/", 1)[1])):
                        conn.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
                body = f"{method} {fields.get('host')} {path}".encode()
                self._answer(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body if method != "HEAD" else b""))
        except (OSError, ssl.SSLError, ValueError):
            pass
        finally:
            conn.close()
