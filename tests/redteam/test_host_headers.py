"""Host header shapes: duplicates, obs-fold, NUL and other control bytes, trailing dots, case,
port variants, IPv6 forms, userinfo, lists and emptiness. Inside a tunnel a Host must name the
pinned host and port (421) and be well-formed (400); on the proxy port it must agree with the
absolute URL; in transparent mode the first Host names the destination. Spellings that are the
pinned destination itself are fine and reach only it."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import Conn, build_request, connect_proxy, tls_tunnel, tunnel
from tests.support.topology import ALLOWED, OTHER

from .common import attack, nothing_reached

pytestmark = attack("host-header")

NOT_ALLOWED = ("other.test", "api.test", "deep.wild.test")

# label -> raw header lines (everything but the request line); each must be refused
BAD = {
    "duplicate-same": b"Host: allowed.test\r\nHost: allowed.test\r\n",
    "duplicate-other": b"Host: allowed.test\r\nHost: other.test\r\n",
    "duplicate-case": b"Host: allowed.test\r\nhOsT: other.test\r\n",
    "folded": b"Host: allowed.test\r\n other.test\r\n",
    "folded-tab": b"Host:\r\n\tother.test\r\n",
    "nul": b"Host: allowed.test\x00.other.test\r\n",
    "cr-inside": b"Host: allowed.test\rother.test\r\n",
    "vertical-tab": b"Host: allowed.test\x0bother.test\r\n",
    "space-in-name": b"Host : other.test\r\n",
    "empty": b"Host: \r\n",
    "missing": b"",
    "two-dots": b"Host: allowed.test..\r\n",
    "other-trailing-dot": b"Host: other.test.\r\n",
    "other-upper": b"Host: OTHER.TEST\r\n",
    "port-80": b"Host: allowed.test:80\r\n",
    "port-443": b"Host: allowed.test:443\r\n",
    "port-empty": b"Host: allowed.test:\r\n",
    "port-plus": b"Host: allowed.test:+443\r\n",
    "port-double": b"Host: allowed.test:443:443\r\n",
    "port-wrap": b"Host: allowed.test:65979\r\n",
    "ipv6-loopback": b"Host: [::1]\r\n",
    "ipv6-mapped-allowed-ip": b"Host: [::ffff:{ip}]\r\n",
    "ipv6-unbracketed": b"Host: ::1\r\n",
    "ipv6-zone": b"Host: [fe80::1%25eth0]\r\n",
    "userinfo": b"Host: allowed.test@other.test\r\n",
    "list": b"Host: allowed.test, other.test\r\n",
    "absolute-url": b"Host: http://other.test/\r\n",
}

GOOD = {
    "trailing-dot": "allowed.test.",
    "upper": "ALLOWED.TEST",
    "explicit-port": "allowed.test:443",
    "zero-padded-port": "allowed.test:0443",
}


def _raw(label: str, rt) -> bytes:
    return BAD[label].replace(b"{ip}", rt.ip("allowed.test").encode())


def _answer(conn):
    try:
        return conn.read_response()
    except (ConnectionError, OSError):
        return None  # the parser hung up: also a refusal


@pytest.mark.parametrize("label", sorted(set(BAD) - {"port-443"}))
def test_bad_host_header_in_tls_tunnel(rt, label):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        tls.send(build_request("GET", "/host-shape", [], raw_headers=_raw(label, rt)))
        response = _answer(tls)
    assert response is None or response.status in (400, 421), (response.status, response.text)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("label", sorted(GOOD))
def test_spellings_of_the_pinned_host_reach_only_it(rt, label):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        response = tls.request("GET", f"/spelling-{label}", [("Host", GOOD[label])])
    assert response.status == 200, response.text
    assert [r.path for r in rt.upstreams.tls["allowed.test"].requests] == [f"/spelling-{label}"]
    nothing_reached(rt.recorders(*NOT_ALLOWED))


@pytest.mark.parametrize("label", ["duplicate-other", "folded", "nul", "other-trailing-dot", "port-443",
                                   "userinfo", "list"])
def test_bad_host_header_on_the_proxy_port(rt, label):
    """Absolute-form `http://allowed.test/`: the Host header must agree with the URL."""
    with connect_proxy(rt.gateway) as conn:
        conn.send(build_request("GET", "http://allowed.test/host-shape", [], raw_headers=_raw(label, rt)))
        response = _answer(conn)
    assert response is None or response.status == 400, (response.status, response.text)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("label", ["duplicate-other", "folded", "other-upper", "port-443"])
def test_bad_host_header_in_plain_tunnel(rt, label):
    conn, answer = tunnel(rt.gateway, "allowed.test:80")
    with conn:
        assert answer.status == 200
        conn.send(build_request("GET", "/host-shape", [], raw_headers=_raw(label, rt)))
        response = _answer(conn)
    assert response is None or response.status in (400, 421), (response.status, response.text)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("raw", [b"Host: allowed.test\r\nHost: other.test\r\n", b"Host: other.test\r\nHost: allowed.test\r\n",
                                 b"Host: allowed.test\r\n other.test\r\n", b"Host: allowed.test:443\r\n",
                                 b"Host: other.test.\r\n", b"Host: [::ffff:93.184.216.35]\r\n"],
                         ids=["dup-allowed-first", "dup-other-first", "folded", "port-mismatch",
                              "other-dot", "mapped-other-ip"])
def test_transparent_first_host_header_shapes(world, raw):
    """Plain HTTP dialled to allowed.test's address: the first Host names the destination."""
    with Conn(world.connect(ALLOWED, 80)) as conn:
        conn.send(build_request("GET", "/host-shape", [], raw_headers=raw))
        response = _answer(conn)
    assert response is None or response.status in (400, 403, 421), (response.status, response.text)
    assert world.touched() == []


def test_transparent_host_header_naming_the_dialled_ip_of_another_host(world):
    """Dialled other.test's address, Host is that address: destination = an IP no rule allows."""
    with Conn(world.connect(OTHER, 80)) as conn:
        response = conn.request("GET", "/by-ip", [("Host", OTHER)])
    assert (response.status, response.egress_reason) == (403, "no_rule"), response.text
    assert world.touched() == []
