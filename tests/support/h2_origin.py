"""The server side of one HTTP/2 connection over TLS, for the test origins that speak h2 (answering
as a test needs, or misbehaving on purpose): the handshake, the connection preface, and a request
at a time handed to the origin."""

from __future__ import annotations

import socket
import ssl

import h2.config
import h2.connection
import h2.events
import h2.exceptions


def serve_h2(raw: socket.socket, tls: ssl.SSLContext, on_request, timeout: float) -> None:
    """Serve `raw` until the peer closes: `on_request(sock, conn, event)` for every
    RequestReceived, which answers on `conn` (what it queues there is sent after it returns) or
    on `sock` itself. A reset, a TLS failure or a protocol error ends the connection quietly."""
    try:
        raw.settimeout(timeout)
        sock = tls.wrap_socket(raw, server_side=True)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        while data := sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    on_request(sock, conn, event)
            sock.sendall(conn.data_to_send())
    except (OSError, ssl.SSLError, h2.exceptions.ProtocolError):
        pass
