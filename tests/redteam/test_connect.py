"""CONNECT edge cases: port spellings a lax parser would wrap or trim to 443, malformed
authorities, userinfo, a Host header contradicting the authority, CONNECT inside a tunnel
(nested, pipelined, over HTTP/2, in transparent mode), and CONNECT to the gateway's own ports,
the metrics port included."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (
    H2Client, assert_refused, connect_proxy, get, start_tls, tls_tunnel, tunnel,
)
from tests.support.topology import ALLOWED

from .common import attack, nothing_reached

pytestmark = attack("connect")


def _connect_raw(rt, request_line: bytes, headers: bytes = b""):
    """Send a hand-written CONNECT; returns (conn, response or None if the gateway hung up)."""
    conn = connect_proxy(rt.gateway)
    conn.send(request_line + b"\r\n" + headers + b"\r\n")
    try:
        response = conn.read_response(head_only=True)
    except (ConnectionError, OSError):
        return conn, None
    if response.status != 200 and response.header("Content-Length"):
        response.body = conn.read_exactly(int(response.header("Content-Length")))
    return conn, response


@pytest.mark.parametrize("port", ["0", "65536", "65979", "+443", "-443", "443.0", "0x1bb", "४४३", "", "44 3",
                                  "4430000000000000000443"])
def test_connect_port_spellings_are_refused(rt, port):
    """65979 is 443 + 65536 (a 16-bit wrap); ४४३ is 443 in Devanagari digits."""
    conn, answer = tunnel(rt.gateway, f"allowed.test:{port}")
    conn.close()
    assert answer.status == 400, (answer.status, answer.body)
    assert answer.egress_reason in ("bad_host", "malformed_request", "non_http"), answer.body
    nothing_reached(rt.everything())


def test_connect_port_with_leading_zero_is_still_port_443(rt):
    """`0443` is a decimal 443 everywhere (not octal); it must be judged as 443: the forbidden host
    stays forbidden, the allowed one reaches only port 443."""
    conn, answer = tunnel(rt.gateway, "other.test:0443")
    conn.close()
    assert_refused(answer, 403, "no_rule")
    conn, answer = tunnel(rt.gateway, "allowed.test:0443")
    assert answer.status == 200, answer
    with start_tls(conn, rt.gateway, "allowed.test") as tls:
        assert get(tls, "/zero", "allowed.test").status == 200
    assert [r.path for r in rt.upstreams.tls["allowed.test"].requests] == ["/zero"]
    nothing_reached(rt.recorders("other.test", "api.test", "deep.wild.test"))


@pytest.mark.parametrize("line", [
    b"CONNECT allowed.test: 443 HTTP/1.1",
    b"CONNECT allowed.test :443 HTTP/1.1",
    b"CONNECT allowed.test:443  HTTP/1.1",
    b"CONNECT  allowed.test:443 HTTP/1.1",
    b"CONNECT allowed.test:443\tother.test:443 HTTP/1.1",
])
def test_connect_with_spaces_in_the_authority(rt, line):
    conn, answer = _connect_raw(rt, line, b"Host: allowed.test:443\r\n")
    conn.close()
    assert answer is None or answer.status == 400, answer
    nothing_reached(rt.everything())


@pytest.mark.parametrize("authority", [
    "allowed.test", ":443", "allowed.test:", "allowed.test:443:443", "allowed.test:443/x", "allowed.test:443#x",
    "[allowed.test]:443", "[::1:443", "*:443", "allowed.test;other.test:443", "allowed.test,other.test:443",
    "http://other.test:443",
])
def test_malformed_connect_authority(rt, authority):
    conn, answer = tunnel(rt.gateway, authority)
    conn.close()
    assert answer.status == 400, (answer.status, answer.body)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("authority", ["user@other.test:443", "user:pass@allowed.test:443",
                                       "allowed.test:443@other.test:443", "other.test@allowed.test:443",
                                       "allowed.test%40other.test:443"])
def test_connect_with_userinfo(rt, authority):
    conn, answer = tunnel(rt.gateway, authority)
    conn.close()
    assert_refused(answer, 400, "bad_host")
    nothing_reached(rt.everything())


def test_connect_with_a_contradicting_host_header(rt):
    """The CONNECT authority decides; a Host header naming another host moves nothing."""
    conn, answer = tunnel(rt.gateway, "allowed.test:443", host_header="other.test:443")
    if answer.status == 200:
        with start_tls(conn, rt.gateway, None) as tls:
            response = get(tls, "/contradict", "allowed.test")
        assert response.status == 200
        assert [r.path for r in rt.upstreams.tls["allowed.test"].requests] == ["/contradict"]
    else:
        conn.close()
        assert answer.status == 400, answer
    nothing_reached(rt.recorders("other.test", "api.test", "deep.wild.test"))


@pytest.mark.parametrize("where", ["tls-tunnel", "plain-tunnel"])
def test_nested_connect(rt, where):
    if where == "tls-tunnel":
        conn = tls_tunnel(rt.gateway, "allowed.test:443")
    else:
        conn, answer = tunnel(rt.gateway, "allowed.test:80")
        assert answer.status == 200
    with conn:
        response = conn.request("CONNECT", "other.test:443", [("Host", "other.test:443")])
    assert_refused(response, 400, "nested_connect")
    nothing_reached(rt.everything())


def test_requests_after_a_refused_connect(rt):
    """A refused CONNECT leaves a proxy connection: an origin-form request for the refused host on
    it (mitmproxy would route it by Host), then a second CONNECT for it."""
    with connect_proxy(rt.gateway) as conn:
        conn.send(b"CONNECT other.test:80 HTTP/1.1\r\nHost: other.test:80\r\n\r\n")
        refused = conn.read_response()
        try:
            follow = conn.request("GET", "/after", [("Host", "other.test")])
        except (ConnectionError, OSError):
            follow = None
    assert refused.status == 403, refused.text
    assert follow is None or follow.status in (400, 403), follow.text
    nothing_reached(rt.everything())


def test_pipelined_second_connect(rt):
    """Two CONNECTs in one write: the second one arrives inside the first tunnel."""
    conn = connect_proxy(rt.gateway)
    with conn:
        conn.send(b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"
                  b"CONNECT other.test:80 HTTP/1.1\r\nHost: other.test:80\r\n\r\n")
        first = conn.read_response(head_only=True)
        second = conn.read_response()
    assert first.status == 200
    assert_refused(second, 400, "nested_connect")
    nothing_reached(rt.everything())


def test_h2_connect_stream_inside_a_tunnel(rt):
    """:method CONNECT on an HTTP/2 stream (RFC 8441-style tunnelling inside the tunnel)."""
    with tls_tunnel(rt.gateway, "allowed.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.h2.get_next_available_stream_id()
        h2.h2.send_headers(stream, [(":method", "CONNECT"), (":authority", "other.test:443")], end_stream=False)
        h2._flush()
        h2.responses[stream] = {"status": None, "headers": [], "body": b"", "done": False, "reset": False}
        try:
            h2.wait(stream)
        except ConnectionError:
            pass  # GOAWAY: also a refusal
    assert h2.responses[stream]["status"] in (None, 400, 405, 421), h2.responses[stream]
    nothing_reached(rt.everything())


@pytest.mark.parametrize("which", ["proxy", "metrics"])
@pytest.mark.parametrize("host", ["127.0.0.1", "self.test", "[::ffff:127.0.0.1]", "2130706433"])
def test_connect_to_the_gateways_own_ports(rt, which, host):
    """A rule allows 127.0.0.1/self.test on both ports: the gateway's own sockets stay refused."""
    port = rt.gateway.port if which == "proxy" else rt.metrics_port
    conn, answer = tunnel(rt.gateway, f"{host}:{port}")
    conn.close()
    assert_refused(answer, 403, "self_address")
    nothing_reached(rt.everything())


def test_transparent_connect_over_a_redirected_port(world):
    """The sandbox sends CONNECT on port 80 (redirected to the transparent listener)."""
    from tests.e2e.helpers import Conn

    with Conn(world.connect(ALLOWED, 80)) as conn:
        response = conn.request("CONNECT", "other.test:443", [("Host", "other.test:443")])
    assert response.status == 400, response.text
    assert response.egress_reason in ("nested_connect", "non_http"), response.text
    assert world.touched() == []
