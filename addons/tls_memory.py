"""TLS buffers are given back while a connection is idle.

OpenSSL keeps a read and a write buffer of about 17 KiB each per TLS connection for as long as the
connection lives; a gateway holding thousands of kept-alive tunnels and open event streams (two TLS
connections each: sandbox and upstream) spends much of its memory on buffers that hold nothing.
`SSL_MODE_RELEASE_BUFFERS` frees them whenever they are empty and takes them again for the next
record. Set once the handshake is done: the SSL object exists by then whatever the addon order
(mitmproxy's TlsConfig makes it in tls_start_*, which runs after `-s` scripts but before embedded
addons).
"""

from __future__ import annotations

from mitmproxy import tls
from OpenSSL import SSL


def _release_buffers(data: tls.TlsData) -> None:
    conn = data.ssl_conn
    if conn is not None and not data.is_dtls:
        SSL._lib.SSL_set_mode(conn._ssl, SSL._lib.SSL_MODE_RELEASE_BUFFERS)


class ReleaseTlsBuffers:
    def tls_established_client(self, data: tls.TlsData) -> None:
        _release_buffers(data)

    def tls_established_server(self, data: tls.TlsData) -> None:
        _release_buffers(data)
