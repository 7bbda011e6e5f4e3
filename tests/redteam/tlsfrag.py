"""A TLS client whose ClientHello arrives in pieces: split into many small TLS records (record
layer fragmentation, which servers must reassemble) and/or written in tiny TCP segments. Python's
ssl cannot do that itself, so the handshake runs over memory BIOs and the first flight is re-framed
by hand. The result quacks like a socket (sendall/recv/settimeout/getsockname/close), so
tests.e2e.helpers.Conn can speak HTTP/1.1 over it."""

from __future__ import annotations

import socket
import ssl
import struct
import time
from pathlib import Path


def refragment(data: bytes, record_size: int) -> bytes:
    """Split every handshake record in `data` into records of at most `record_size` payload bytes."""
    out = b""
    while data:
        kind, version, length = data[0], data[1:3], struct.unpack("!H", data[3:5])[0]
        payload, data = data[5:5 + length], data[5 + length:]
        if kind != 0x16:
            out += bytes([kind]) + version + struct.pack("!H", length) + payload
            continue
        for start in range(0, len(payload), record_size):
            piece = payload[start:start + record_size]
            out += bytes([kind]) + version + struct.pack("!H", len(piece)) + piece
    return out


class FragmentedTLS:
    def __init__(self, sock: socket.socket, ca: Path, server_name: str | None, record_size: int = 0,
                 segment_size: int = 0, alpn: list[str] | None = None):
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = ssl.create_default_context(cafile=str(ca))
        context.check_hostname = False
        context.set_alpn_protocols(alpn or ["http/1.1"])
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._in, self._out, server_hostname=server_name)
        self.record_size, self.segment_size = record_size, segment_size
        self._handshake()

    def _send_raw(self, data: bytes, first_flight: bool) -> None:
        if first_flight and self.record_size:
            data = refragment(data, self.record_size)
        if first_flight and self.segment_size:
            for start in range(0, len(data), self.segment_size):
                self.sock.sendall(data[start:start + self.segment_size])
                time.sleep(0.001)  # pacing, not synchronisation: each fragment its own TCP segment
        else:
            self.sock.sendall(data)

    def _pump(self) -> bool:
        chunk = self.sock.recv(65536)
        if not chunk:
            self._in.write_eof()
            return False
        self._in.write(chunk)
        return True

    def _handshake(self) -> None:
        first = True
        while True:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                data = self._out.read()
                if data:
                    self._send_raw(data, first)
                    first = False
                if not self._pump():
                    raise ConnectionError("closed during the TLS handshake")
                continue
            data = self._out.read()
            if data:
                self._send_raw(data, first)
            return

    # --- socket-like ----------------------------------------------------------------------------

    def sendall(self, data: bytes) -> None:
        self.tls.write(data)
        self.sock.sendall(self._out.read())

    def recv(self, size: int) -> bytes:
        while True:
            try:
                return self.tls.read(size)
            except ssl.SSLWantReadError:
                if not self._pump():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    def settimeout(self, value) -> None:
        self.sock.settimeout(value)

    def gettimeout(self):
        return self.sock.gettimeout()

    def getsockname(self):
        return self.sock.getsockname()

    def selected_alpn_protocol(self):
        return self.tls.selected_alpn_protocol()

    def close(self) -> None:
        self.sock.close()
