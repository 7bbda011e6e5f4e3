"""Destination restating: once a connection's destination is pinned, nothing the sandbox sends
later may move it. An IP with a borrowed SNI, an SNI that differs from the CONNECT host, a Host or
HTTP/2 :authority naming another (even allowed) host, an absolute-form URL inside a tunnel, a
second request on a kept-alive connection, an HTTP/2 stream that tries to coalesce onto the
connection: all refused before any byte goes upstream, in explicit and transparent mode."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import Conn, H2Client, assert_refused, connect_proxy, get, start_tls, tls_tunnel, tunnel
from tests.support.topology import ALLOWED, OTHER

from .common import attack, nothing_reached

pytestmark = attack("restating")

EVERYTHING_BUT_ALLOWED = ("other.test", "api.test", "deep.wild.test")


def test_ip_literal_with_borrowed_sni(rt):
    """CONNECT to an IP a rule allows, then TLS whose SNI names another host."""
    conn, answer = tunnel(rt.gateway, f"{rt.ip('allowed.test')}:443")
    assert answer.status == 200, answer
    with start_tls(conn, rt.gateway, sni="other.test") as tls:
        response = get(tls, "/borrowed", rt.ip("allowed.test"))
    assert_refused(response, 421, "sni_mismatch")
    nothing_reached(rt.everything())


@pytest.mark.parametrize("sni", ["api.test", "deep.wild.test", "allowed.test.api.test"])
def test_sni_differs_from_connect_host(rt, sni):
    """The SNI names a host that another rule allows: still not the pinned one."""
    with tls_tunnel(rt.gateway, "allowed.test:443", sni=sni) as tls:
        response = get(tls, "/sni", "allowed.test")
    assert_refused(response, 421, "sni_mismatch")
    nothing_reached(rt.everything())


def test_host_header_names_another_allowed_host(rt):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        response = get(tls, "/ok/host", "api.test")
    assert_refused(response, 421, "host_mismatch")
    nothing_reached(rt.everything())


@pytest.mark.parametrize("target", ["https://api.test/ok/abs", "https://other.test/abs",
                                    "https://allowed.test:8443/abs", "http://allowed.test:80/abs"])
def test_absolute_form_inside_tls_tunnel(rt, target):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        response = get(tls, target, "allowed.test")
    assert_refused(response, 421, "authority_mismatch")
    nothing_reached(rt.everything())


@pytest.mark.parametrize("target", ["http://allowed.test/abs", "http://allowed.test:443/abs"])
def test_absolute_form_with_the_other_scheme_inside_tls_tunnel(rt, target):
    """`http://allowed.test/...` inside a TLS tunnel pinned to allowed.test:443. mitmproxy takes
    the scheme from the connection (TLS: https), so the URL is judged, and forwarded, as
    https://allowed.test:443: whatever happens, only the pinned destination may see it, over TLS,
    with an absolute URL (if any) that names the pinned destination."""
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        response = get(tls, target, "allowed.test")
    nothing_reached(rt.recorders(*EVERYTHING_BUT_ALLOWED))
    assert not rt.upstreams.plain["allowed.test"].touched
    if response.status != 200:
        assert response.status in (400, 421), response.text
        assert not rt.upstreams.tls["allowed.test"].touched
        return
    [seen] = rt.upstreams.tls["allowed.test"].requests
    assert seen.path.startswith(("/", "https://allowed.test/", "https://allowed.test:443/")), seen.path
    assert [v for k, v in seen.headers if k.lower() == "host"] in ([], ["allowed.test"], ["allowed.test:443"])


def test_absolute_form_inside_plain_tunnel(rt):
    conn, answer = tunnel(rt.gateway, "allowed.test:80")
    with conn:
        assert answer.status == 200
        response = get(conn, "http://other.test/abs", "allowed.test")
    assert_refused(response, 421, "authority_mismatch")
    nothing_reached(rt.everything())


def test_keep_alive_host_switch_in_tunnel(rt):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        first = get(tls, "/first", "allowed.test")
        second = get(tls, "/ok/second", "api.test")
        third = get(tls, "/third", "allowed.test")
    assert first.status == 200 and third.status == 200, (first.text, third.text)
    assert_refused(second, 421, "host_mismatch")
    assert [r.path for r in rt.upstreams.tls["allowed.test"].requests] == ["/first", "/third"]
    nothing_reached(rt.recorders(*EVERYTHING_BUT_ALLOWED))


def test_keep_alive_switch_to_origin_form_on_proxy_port(rt):
    """After an allowed absolute-form request, an origin-form request with another Host on the
    same proxy connection (mitmproxy would derive its destination from Host)."""
    with connect_proxy(rt.gateway) as conn:
        first = conn.request("GET", "http://allowed.test/first", [("Host", "allowed.test")])
        second = conn.request("GET", "/second", [("Host", "other.test")])
    assert first.status == 200, first.text
    assert_refused(second, 400, "origin_form")
    assert [r.path for r in rt.upstreams.plain["allowed.test"].requests] == ["/first"]
    nothing_reached(rt.recorders(*EVERYTHING_BUT_ALLOWED))


@pytest.mark.parametrize("authority", ["api.test", "alias.test", "deep.wild.test", "allowed.test:8443"])
def test_h2_stream_with_another_authority(rt, authority):
    """alias.test (same address, allowed by the same rule) and deep.wild.test are what a browser
    would coalesce onto an open connection: each stream must name the pinned destination."""
    with tls_tunnel(rt.gateway, "allowed.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        good = h2.send("allowed.test", "/h2-good")
        bad = h2.send(authority, "/ok/h2-bad")
        h2.wait(good, bad)
    assert h2.responses[good]["status"] == 200
    assert h2.responses[bad]["status"] == 421, h2.responses[bad]
    assert h2.header(bad, "x-egress-reason") == "authority_mismatch"
    assert [r.path for r in rt.upstreams.tls["allowed.test"].requests] == ["/h2-good"]
    nothing_reached(rt.recorders(*EVERYTHING_BUT_ALLOWED))


# --- transparent mode ---------------------------------------------------------------------------


def _sandbox_tls(world, address: str, sni: str | None, alpn=None) -> Conn:
    return start_tls(Conn(world.connect(address, 443)), world.gateway, sni, alpn)


def test_transparent_ip_with_borrowed_sni(world):
    """Dial other.test's address with SNI allowed.test: only allowed.test's own address is dialled."""
    with _sandbox_tls(world, OTHER, "allowed.test") as tls:
        response = get(tls, "/borrowed", "allowed.test")
    assert response.status == 200, response.text
    assert [r.path for r in world.topology.server(f"{ALLOWED}:443").requests] == ["/borrowed"]
    assert world.touched() == [f"{ALLOWED}:443"], "the dialled address must never be dialled"


def test_transparent_host_differs_from_sni(world):
    with _sandbox_tls(world, ALLOWED, "allowed.test") as tls:
        first = get(tls, "/first", "allowed.test")
        second = get(tls, "/second", "other.test")
    assert first.status == 200
    assert_refused(second, 421, "host_mismatch")
    assert [r.path for r in world.topology.server(f"{ALLOWED}:443").requests] == ["/first"]
    assert world.touched() == [f"{ALLOWED}:443"]


def test_transparent_no_sni_then_host_of_another_name(world):
    """No SNI: the destination is the dialled IP (allowed by an IP rule); a Host naming a host
    is a restatement."""
    with _sandbox_tls(world, ALLOWED, None) as tls:
        response = get(tls, "/nosni", "other.test")
    assert_refused(response, 421, "host_mismatch")
    assert world.touched() == []


def test_transparent_absolute_form_in_tls(world):
    with _sandbox_tls(world, ALLOWED, "allowed.test") as tls:
        response = get(tls, "https://other.test/abs", "allowed.test")
    assert_refused(response, 421, "authority_mismatch")
    assert world.touched() == []


def test_transparent_h2_authority_switch(world):
    with _sandbox_tls(world, ALLOWED, "allowed.test", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        good = h2.send("allowed.test", "/h2-good")
        bad = h2.send("other.test", "/h2-bad")
        h2.wait(good, bad)
    assert h2.responses[good]["status"] == 200
    assert (h2.responses[bad]["status"], h2.header(bad, "x-egress-reason")) == (421, "authority_mismatch")
    assert world.touched() == [f"{ALLOWED}:443"]


def test_transparent_plain_http_keep_alive_switch(world):
    with Conn(world.connect(ALLOWED, 80)) as conn:
        first = get(conn, "/first", "allowed.test")
        second = get(conn, "/second", "other.test")
    assert first.status == 200
    assert_refused(second, 421, "host_mismatch")
    assert world.touched() == [f"{ALLOWED}:80"]
