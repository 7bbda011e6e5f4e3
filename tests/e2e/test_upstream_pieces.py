"""An upstream that answers in tiny pieces (review 32): its 1-byte chunks are merged per read and
parsed at most about a millisecond per step of the loop, the rest at a wakeup and behind the
connection's read-ahead gate (addons/http1.py, addons/read_ahead.py). Whatever the slicing, the
body arrives whole and in order, also when the upstream closes right after its last chunk (the
part left unparsed is read before the close is)."""

from __future__ import annotations

import socket

import pytest

from tests.e2e.helpers import ScriptedUpstream, connect_proxy, extra_static_hosts, get

CHUNKS = 200_000
BODY = bytes(i % 251 for i in range(CHUNKS))
ANSWER = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
          + b"".join(b"1\r\n%c\r\n" % byte for byte in BODY) + b"0\r\n\r\n")


class ClosingAtOnce(ScriptedUpstream):
    HOLD = 0.0  # closes as soon as its answer is written


@pytest.mark.parametrize("origin_class", [ScriptedUpstream, ClosingAtOnce], ids=["held open", "closed at once"])
def test_a_body_of_one_byte_chunks_arrives_whole(start_gateway, upstreams, origin_class):
    origin = origin_class(f"{upstreams.block}.60", ANSWER)
    try:
        gateway = start_gateway(f"""
            - id: tiny
              hosts: [tiny.test]
              schemes: [http]
              ports: [{origin.port}]
            """, extra=extra_static_hosts({"tiny.test": origin.host}))
        with connect_proxy(gateway) as conn:
            response = get(conn, f"http://tiny.test:{origin.port}/pieces", f"tiny.test:{origin.port}")
        assert response.status == 200
        assert len(response.body) == CHUNKS and response.body == BODY
    finally:
        origin.stop()


class TinyFramesH2Origin:
    """An HTTP/2 origin on 443 answering every request with CHUNKS one-byte DATA frames (BODY),
    then, if `close`, ending its side of the connection at once."""

    def __init__(self, host: str, cert, key, close: bool):
        import ssl

        from tests.support.tcp_origin import start_accepting

        self.close = close
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(cert), str(key))
        self._tls.set_alpn_protocols(["h2"])
        self._sock = socket.create_server((host, 443))
        start_accepting(self._sock, self._handle)

    def _handle(self, raw) -> None:
        from tests.support.h2_origin import serve_h2

        serve_h2(raw, self._tls, self._answer, 30)

    def _answer(self, sock, conn, event) -> None:
        conn.send_headers(event.stream_id, [(":status", "200")])
        for byte in BODY:
            conn.send_data(event.stream_id, bytes((byte,)))
        conn.end_stream(event.stream_id)
        if self.close:
            sock.sendall(conn.data_to_send())
            # A FIN right behind the last frame, on the TCP socket (SSLSocket.shutdown would also
            # drop the TLS state, so the loop after this would read ciphertext and end in a reset,
            # which throws away what the gateway has not read yet).
            socket.socket.shutdown(sock, socket.SHUT_WR)

    def stop(self) -> None:
        self._sock.close()


@pytest.mark.parametrize("close", [False, True], ids=["held open", "closed at once"])
def test_an_h2_body_of_one_byte_frames_arrives_whole(start_gateway, upstreams, pki, close):
    """The same from an HTTP/2 upstream: its frames are parsed a slice per step (review 33: a read of
    1-byte DATA frames was one step of 70-146 ms), the close waits for the rest."""
    from tests.e2e.helpers import H2Client, tls_tunnel

    host = f"{upstreams.block}.{62 if close else 61}"
    cert, key = pki.issue(["frames.test"], [host], stem=f"frames{int(close)}")
    origin = TinyFramesH2Origin(host, cert, key, close)
    try:
        gateway = start_gateway("""
            - id: frames
              hosts: [frames.test]
            """, extra=extra_static_hosts({"frames.test": host}))
        client = H2Client(tls_tunnel(gateway, "frames.test:443", alpn=["h2"]))
        sid = client.send("frames.test", "/frames")
        client.wait(sid, timeout=60)
        assert client.responses[sid]["status"] == 200
        assert len(client.responses[sid]["body"]) == CHUNKS and client.responses[sid]["body"] == BODY
    finally:
        origin.stop()
