"""HTTP/1.1 messages read off a blocking socket, for the benchmarks' own loopback origins and
clients: they know what they talk to, so a head is read up to its blank line and a body by its
Content-Length, and nothing is checked beyond that."""

from __future__ import annotations

import socket


def read_head(sock: socket.socket, buf: bytes = b"", size: int = 65536) -> tuple[bytes, bytes]:
    """The next message head on `sock` (its blank line dropped) and the bytes read past it; `buf`
    holds what was read already. EOFError, holding the bytes read, when the peer closes first."""
    while b"\r\n\r\n" not in buf:
        piece = sock.recv(size)
        if not piece:
            raise EOFError(buf)
        buf += piece
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def read_request(sock: socket.socket, buf: bytes = b"") -> tuple[list[bytes], bytes] | None:
    """The next request's head lines and what was read past its Content-Length body (the start of
    the next one); None when the peer closes first."""
    try:
        head, buf = read_head(sock, buf)
    except EOFError:
        return None
    lines = head.split(b"\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(buf) < length:
        piece = sock.recv(65536)
        if not piece:
            return None
        buf += piece
    return lines, buf[length:]
