"""What an upstream's response head may cost the gateway (addons/h2_limits.py GatewayHttp2Client,
addons/http1.py GatewayHttp1Client): an HTTP/2 header block is bounded as it arrives, before h2
joins it and HPACK decodes it, and a response head or trailer section of more than
egress_max_header_fields fails its stream before any hook reads it; each is 502
response_too_large, and the gateway goes on serving. One real gateway, real TLS, real origins on
this session's loopback block (.210: h2 over TLS, .211: HTTP/1)."""

from __future__ import annotations

import socket
import ssl

import hpack
import pytest
from hyperframe.frame import ContinuationFrame, HeadersFrame

from tests.e2e.helpers import (  # noqa: F401  (fixtures)
    H2Client, audit_for, connect_proxy, extra_static_hosts, fresh_upstreams, get, shared_gateway, tls_tunnel,
)
from tests.support.h2_origin import serve_h2
from tests.support.tcp_origin import read_head, start_accepting

RULES = """
- id: heads
  hosts: [h2heads.test, h1heads.test]
  schemes: [http, https]
"""
MANY = 300  # over the default egress_max_header_fields (256)


class HeadsH2Origin:
    """An h2 origin whose answer depends on the path: /block a 1 MiB header block in CONTINUATION
    frames, /fields MANY header fields, /trailers MANY trailer fields, anything else 200 ok."""

    def __init__(self, host: str, cert, key):
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(cert), str(key))
        self._tls.set_alpn_protocols(["h2"])
        self._sock = socket.create_server((host, 443))
        self.paths: list[str] = []
        start_accepting(self._sock, self._handle)

    def _handle(self, raw: socket.socket) -> None:
        serve_h2(raw, self._tls, self._request, 30)

    def _request(self, sock, conn, event) -> None:
        path = dict(event.headers)[":path"]
        self.paths.append(path)
        self._answer(sock, conn, event.stream_id, path)

    @staticmethod
    def _answer(sock, conn, stream_id: int, path: str) -> None:
        if path == "/block":
            sock.sendall(conn.data_to_send())
            block = hpack.Encoder().encode([(":status", "200"), ("x-big", "v" * (1 << 20))], huffman=False)
            for n, at in enumerate(range(0, len(block), 16384)):
                if n >= 63:
                    break  # h2's limit of 64 frames a block: the block never ends
                frame = (HeadersFrame if n == 0 else ContinuationFrame)(stream_id, block[at:at + 16384])
                sock.sendall(frame.serialize())
            return
        if path == "/big-frame":  # a frame header declaring 1 MiB, more than any frame size agreed
            sock.sendall(conn.data_to_send() + (1 << 20).to_bytes(3, "big") + b"\0\0" + stream_id.to_bytes(4, "big")
                         + b"x" * 1000)
            return
        headers = [(":status", "200")]
        if path == "/fields":
            headers += [(f"x-f{n}", "0") for n in range(MANY)]
        if path == "/trailers":
            conn.send_headers(stream_id, headers)
            conn.send_data(stream_id, b"ok\n")
            conn.send_headers(stream_id, [(f"x-t{n}", "0") for n in range(MANY)], end_stream=True)
            return
        conn.send_headers(stream_id, headers + [("content-length", "3")])
        conn.send_data(stream_id, b"ok\n", end_stream=True)

    def stop(self) -> None:
        self._sock.close()


class HeadsH1Origin:
    """An HTTP/1 origin: /fields answers with MANY header fields, anything else 200 ok."""

    def __init__(self, host: str):
        self._sock = socket.create_server((host, 80))
        start_accepting(self._sock, self._handle)

    @staticmethod
    def _handle(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                got = read_head(conn)
                if got is None:
                    return
                path = got[0].split(b" ", 2)[1]
                if path.endswith(b"/tiny-fields"):  # 50,000 fields in 250 KB: under the 256 KiB head limit
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n" + b"a:0\r\n" * 50_000 + b"\r\nok\n")
                elif path.endswith(b"/trailers"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: a\r\n\r\n"
                                 b"3\r\nok\n\r\n0\r\n" + b"a:0\r\n" * 50_000 + b"\r\n")
                else:
                    extra = b"".join(b"X-F%d: 0\r\n" % n for n in range(MANY)) if path.endswith(b"/fields") else b""
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n" + extra + b"\r\nok\n")
                conn.recv(1)  # until the gateway closes
            except OSError:
                pass

    def stop(self) -> None:
        self._sock.close()


@pytest.fixture(scope="module")
def origins(upstreams, pki):
    h2_host, h1_host = f"{upstreams.block}.210", f"{upstreams.block}.211"
    cert, key = pki.issue(["h2heads.test"], [h2_host], stem="h2heads")
    made = HeadsH2Origin(h2_host, cert, key), HeadsH1Origin(h1_host)
    yield made
    for origin in made:
        origin.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstreams, pki, origins):
    extra = extra_static_hosts({"h2heads.test": f"{upstreams.block}.210", "h1heads.test": f"{upstreams.block}.211"})
    process = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name="upstreamheads")
    yield process
    process.stop()


@pytest.mark.parametrize("path", ["/block", "/fields", "/trailers", "/big-frame"])
def test_an_upstream_h2_head_past_its_limits_is_502_and_the_gateway_goes_on(gateway, origins, path):
    """A 1 MiB header block (never ended) was joined and decoded whole before any check; 300
    response or trailer fields went to every hook. Now 502 response_too_large (a trailer section
    comes after the head went out: that stream is reset), and the connection goes on."""
    with tls_tunnel(gateway, "h2heads.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        stream = client.send("h2heads.test", path)
        client.wait(stream)
        answer = client.responses[stream]
        if path == "/trailers":
            assert answer["reset"] and answer["trailers"] == [], answer
        else:
            assert answer["status"] == 502, answer
            assert dict(answer["headers"])["x-egress-reason"] == "response_too_large", answer
        after = client.send("h2heads.test", "/ok")
        client.wait(after)
        assert client.responses[after]["status"] == 200
        lines = audit_for(gateway, conn.client, 3)
    assert any(a.get("reason") == "response_too_large" for a in lines), lines
    assert "Traceback" not in gateway.log()


@pytest.mark.parametrize("path", ["/fields", "/tiny-fields"])
def test_an_upstream_http1_head_of_too_many_fields_is_502(gateway, origins, path):
    """Counted before mitmproxy parses it: 50,000 fields in a 250 KB head cost ~70 ms of the loop."""
    with connect_proxy(gateway) as conn:
        response = get(conn, f"http://h1heads.test{path}", "h1heads.test")
        assert (response.status, response.egress_reason) == (502, "response_too_large"), response
    with connect_proxy(gateway) as conn:
        assert get(conn, "http://h1heads.test/ok", "h1heads.test").status == 200


def test_an_upstream_http1_trailer_section_of_too_many_fields_is_cut_off(gateway, origins):
    """50,000 trailer fields (~200 ms of the loop each time, once h11 had parsed them): counted
    before they are parsed; the response had started, so it is cut off (no end of body)."""
    with connect_proxy(gateway) as conn:
        conn.send(b"GET http://h1heads.test/trailers HTTP/1.1\r\nHost: h1heads.test\r\n\r\n")
        with pytest.raises(Exception):
            conn.read_response()
        lines = audit_for(gateway, conn.client, 2)
    assert any(a.get("reason") == "response_too_large" for a in lines), lines
