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
from dataclasses import dataclass

from tests.support.recorder import WAIT
from tests.support.tcp_origin import TcpOrigin, server_tls

IGNORED_BODY_METHODS = {"GET", "HEAD", "OPTIONS", "DELETE"}


@dataclass
class Executed:
    connection: int
    method: str
    path: str
    host: str | None
    headers: dict[str, str]


class LenientOrigin(TcpOrigin):
    timeout = 10.0

    def __init__(self, address: str, port: int, cert=None, key=None):
        super().__init__(address, port, server_tls(cert, key) if cert is not None else None)

    @property
    def executed(self) -> list[Executed]:
        return self.recorder.entries

    @property
    def answered(self) -> int:  # responses sent, 400s to garbage included
        return self.recorder.get("answered")

    def wait_executed(self, count: int, timeout: float = WAIT) -> list[Executed]:
        """The executed requests, once there are at least `count` (or the timeout passed)."""
        self.recorder.wait_count(count, timeout=timeout)
        return self.executed

    def wait_answered(self, count: int, timeout: float = WAIT) -> int:
        self.recorder.wait_count(count, "answered", timeout)
        return self.answered

    def _answer(self, conn, data: bytes) -> None:
        conn.sendall(data)
        self.recorder.count("answered")

    def handle(self, conn: socket.socket, number: int) -> None:
        buf = b""
        eof = False
        ignored = False  # the last request's body was left unread, in `buf`
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
            self.recorder.add(Executed(number, method, path, fields.get("host"), fields))
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
