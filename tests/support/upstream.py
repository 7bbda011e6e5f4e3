"""Upstream servers that record everything that reaches them.

Tests assert from the upstream side: a denied request must leave no trace here, not even a TCP
connection. Each server counts accepted connections separately from parsed requests.
"""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.fence import AcceptFence

STALL_SECONDS = 2.0  # a /chunked/ write blocked this long means its reader stopped reading


@dataclass
class Received:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    sni: str | None
    peer: tuple


@dataclass
class RecordingUpstream:
    """An HTTP/1.1 server (TLS when cert/key are given) on host:port that answers 200 and records."""

    name: str
    host: str
    port: int
    cert: Path | None = None
    key: Path | None = None
    requests: list[Received] = field(default_factory=list)
    connections: int = 0
    ended: int = 0  # connections whose peer closed them (the handler saw the end of its requests)
    written: int = 0  # body bytes /chunked/ wrote
    stalled: threading.Event = field(default_factory=threading.Event)  # a /chunked/ write blocked

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._fence = AcceptFence()
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                sni = getattr(self.connection, "egress_sni", None)
                with upstream._lock:
                    upstream.requests.append(
                        Received(self.command, self.path, list(self.headers.items()), body, sni, self.client_address)
                    )
                if self.path.startswith("/chunked/"):  # N bytes of unknown length, 64 KiB a chunk
                    remaining = int(self.path.split("/")[2])
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.connection.settimeout(STALL_SECONDS)
                    try:
                        while remaining > 0:
                            n = min(remaining, 65536)
                            self.wfile.write(b"%x\r\n%s\r\n" % (n, b"x" * n))
                            remaining -= n
                            upstream.written += n
                        self.wfile.write(b"0\r\n\r\n")
                    except TimeoutError:  # the reader stopped: back-pressure reached this socket
                        upstream.stalled.set()
                        self.close_connection = True
                    return
                if self.path.startswith("/bytes/"):
                    size = int(self.path.split("/")[2])
                    self.send_response(200)
                    self.send_header("Content-Length", str(size))
                    self.end_headers()
                    chunk = b"x" * 65536
                    remaining = size
                    while remaining > 0:
                        n = min(remaining, len(chunk))
                        self.wfile.write(chunk[:n])
                        remaining -= n
                    return
                payload = f"upstream {upstream.name}: {self.command} {self.path}\n".encode()
                if self.path.startswith("/close/"):  # answers, then closes (no header says so, as on an idle timeout)
                    self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("X-Upstream", upstream.name)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _handle

            def finish(self):
                super().finish()
                with upstream._lock:
                    upstream.ended += 1

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in upstream.host else socket.AF_INET

            def get_request(self):
                sock, addr = super().get_request()
                if upstream._fence.claims(sock, addr):  # settle()'s own connection: not counted
                    raise OSError("settle probe")  # socketserver drops the request
                with upstream._lock:
                    upstream.connections += 1
                if upstream._tls is not None:
                    sock.settimeout(5)
                    holder = {}

                    def remember_sni(ssl_sock, server_name, ctx):
                        holder["sni"] = server_name

                    upstream._tls.sni_callback = remember_sni
                    sock = upstream._tls.wrap_socket(sock, server_side=True)
                    sock.egress_sni = holder.get("sni")
                    sock.settimeout(None)
                return sock, addr

        self._tls = None
        if self.cert is not None:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(str(self.cert), str(self.key))
            self._tls.set_alpn_protocols(["http/1.1"])
        self._server = Server((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.connections = 0
            self.ended = 0
            self.written = 0
            self.stalled.clear()

    def settle(self, timeout: float = 5.0) -> None:
        """A fence (tests.support.fence): once this returns, every TCP connection that reached this
        server before the call has been accepted and counted. Call it from the server's namespace."""
        self._fence.settle((self.host, self.port), timeout)

    @property
    def touched(self) -> bool:
        """Did anything at all reach this server (a TCP connection counts)? Call settle() first to
        count a connection still waiting in the accept queue too."""
        return self.connections > 0 or bool(self.requests)
