"""The one accept loop of the test origins: a listening socket on a loopback (or namespace)
address, a thread per connection running `handle(conn, number)`, and a `Recorder` that counts
connections opened and closed (`recorder.get("opened")`, `wait_closed`) and keeps whatever the
handler adds. TLS, when given a context, is wrapped in the connection's own thread, after the
connection has been counted: a test that asserts "no TCP connection at all" sees the connection
even when its handshake then fails. `stop()` closes the listener and every open connection."""

from __future__ import annotations

import contextlib
import errno
import socket
import ssl
import threading
import time

from tests.support.fence import AcceptFence
from tests.support.recorder import WAIT, Recorder


def accept_forever(sock: socket.socket, handle, stopped, on_accept=None) -> None:
    """Accept connections on `sock` until it is closed (or `stopped()`), each handed to
    `handle(conn, addr)` on a thread of its own; with `on_accept`, `handle(conn, *on_accept(conn,
    addr))`, on_accept running in this loop, in the order of the accept queue (counting, the
    fence), and None from it dropping the connection. An accept that fails for one connection (reset
    while it waited in the backlog: ECONNABORTED; EMFILE for a moment) skips it: a loop that ended
    there (the `websockets` server's own does) left the socket listening, the kernel completing
    handshakes nobody read, and every later test's upstream TLS handshake hung (a CI run: a
    WebSocket through the gateway never got its 101)."""
    while not stopped():
        try:
            conn, addr = sock.accept()
        except (ConnectionAbortedError, InterruptedError):
            continue
        except OSError as exc:
            if stopped() or sock.fileno() < 0 or exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                                                    errno.ENOMEM):
                return
            time.sleep(0.01)  # backoff, not synchronisation: out of descriptors or memory for a moment
            continue
        args = (addr,) if on_accept is None else on_accept(conn, addr)
        if args is not None:
            threading.Thread(target=handle, args=(conn, *args), daemon=True).start()


def start_accepting(sock: socket.socket, handle, stopped=lambda: False, on_accept=None, name: str | None = None) -> None:
    """The origins' one accept loop (accept_forever) on a daemon thread: `handle(conn)` for every
    connection, on a thread of its own. `on_accept(conn, addr)`, when given, runs in the loop
    itself, in the order of the accept queue (where a count must be taken, or a fence's probe
    claimed); False from it drops the connection."""
    def accepted(conn, addr):
        return None if on_accept is not None and on_accept(conn, addr) is False else ()

    threading.Thread(target=accept_forever, args=(sock, handle, stopped, accepted), daemon=True, name=name).start()


def server_tls(cert, key, alpn: list[str] | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


class TcpOrigin:
    """Subclasses define `handle(conn, number)`; `number` counts from 1 per origin."""

    backlog = 64
    timeout: float | None = 30.0  # per-connection socket timeout (None: blocking)

    def __init__(self, host: str, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.host, self.tls = host, tls
        self.recorder: Recorder = Recorder()
        self._fence = AcceptFence()
        self._open: set[socket.socket] = set()
        self._stopped = False
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(self.backlog)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=accept_forever, args=(self._sock, self._connection, lambda: self._stopped,
                                                      self._accepted), daemon=True).start()

    # what tests read
    @property
    def connections(self) -> int:
        return self.recorder.get("opened")

    @property
    def closed_count(self) -> int:
        return self.recorder.get("closed")

    @property
    def touched(self) -> bool:
        return self.connections > 0

    def wait_connections(self, n: int = 1, timeout: float = WAIT) -> bool:
        return self.recorder.wait_count(n, "opened", timeout)

    def wait_closed(self, n: int = 1, timeout: float = WAIT) -> bool:
        """True once `n` connections have ended at this origin (the peer closed, or the handler returned)."""
        return self.recorder.wait_count(n, "closed", timeout)

    def settle(self, timeout: float = 5.0) -> None:
        """A fence (tests.support.fence): every connection that reached this origin before the call
        has been counted once this returns. Call it from the origin's namespace."""
        self._fence.settle((self.host, self.port), timeout)

    def reset(self) -> None:
        self.recorder.clear()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self.recorder.cond:
            open_now = list(self._open)
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.close()

    # the accept side
    def _accepted(self, conn: socket.socket, addr) -> tuple[int] | None:
        """In the accept loop, in the queue's order: the fence's probe is dropped, the rest counted."""
        if self._fence.claims(conn, addr):
            return None
        number = self.recorder.count("opened")
        with self.recorder.cond:
            self._open.add(conn)
        return (number,)

    def _connection(self, conn: socket.socket, number: int) -> None:
        try:
            conn.settimeout(self.timeout)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self.handle(conn, number)
        except (OSError, ssl.SSLError, ValueError):
            pass
        finally:
            with self.recorder.cond:
                self._open.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()
            self.recorder.count("closed")

    def handle(self, conn: socket.socket, number: int) -> None:
        raise NotImplementedError


def read_head(conn: socket.socket, buffer: bytes = b"") -> tuple[bytes, bytes] | None:
    """(head, the bytes after it) of the next HTTP/1 message on `conn`; None when the peer closed first."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            return None
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    return head, rest
