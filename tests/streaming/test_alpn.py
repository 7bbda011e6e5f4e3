"""Behaviour 4: HTTP/2 to the client whenever the client offers h2, whatever order it lists ALPN
in. httpx with `http2=True` lists http/1.1 first inside a tunnel; it must still get HTTP/2 when
the origin speaks h2 - and its stream must arrive event by event (httpx's own streaming API)."""

from __future__ import annotations

import contextlib
import ssl

import pytest

from .clients import Events, Fetch, connect_tunnel, follow
from .conftest import RULE_KINDS, check_origin_saw, model_events, name
from .origins import WAIT, paced_stream, plan_events

pytestmark = pytest.mark.e2e


def httpx_client(gateway, http2: bool = True):
    import httpx

    context = ssl.create_default_context(cafile=str(gateway.ca_cert))
    return httpx.Client(http2=http2, proxy=gateway.proxy_url, verify=context, trust_env=False,
                        timeout=httpx.Timeout(WAIT))


@contextlib.contextmanager
def httpx_stream(client, url: str):
    """client.stream("GET", url), with a clear failure when the response head does not arrive."""
    import httpx

    try:
        with client.stream("GET", url) as response:
            yield response
            return
    except httpx.ReadTimeout as exc:
        if "response" not in locals():
            raise AssertionError(f"the response headers never reached httpx within {WAIT:g}s: "
                                 "the gateway held the response back") from exc
        raise


def httpx_reader(response):
    """An Events source over httpx's raw stream (the deadline is httpx's read timeout)."""
    import httpx

    chunks = response.iter_raw()

    def read_some(deadline: float):
        try:
            return next(chunks)
        except StopIteration:
            return None
        except httpx.ReadTimeout:
            raise TimeoutError from None

    return read_some


@pytest.mark.parametrize("rule", RULE_KINDS)
def test_httpx_http2_gets_http2_and_streams(gateway, routes, origins, rule):
    events = model_events(4)
    route, lock = paced_stream(routes, plan_events(events))
    with httpx_client(gateway) as client:
        with httpx_stream(client, f"https://{name('h2', rule)}{route.path}") as response:
            assert response.status_code == 200
            assert response.http_version == "HTTP/2", (
                f"httpx offered h2 (after http/1.1) and got {response.http_version}")
            lock.ack(0)
            follow(Events(httpx_reader(response)), events, lock)
    check_origin_saw(route.exchange, rule)
    assert route.exchange.protocol == "HTTP/2"


def _follow_a_paced_stream(routes, sock, protocol: str, host: str) -> None:
    """Two events streamed in lockstep over the negotiated `protocol` ("h2" or "h1") arrive each
    before the next is sent."""
    events = model_events(2)
    route, lock = paced_stream(routes, plan_events(events))
    fetch = Fetch(sock, protocol, host, route.path)
    fetch.read_head()
    lock.ack(0)
    follow(fetch.events(), events, lock)


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("offer", [["http/1.1", "h2"], ["h2", "http/1.1"], ["h2"]],
                         ids=["http1.1-first", "h2-first", "h2-only"])
def test_any_offer_of_h2_gets_h2(gateway, routes, origins, offer, rule):
    host = name("h2", rule)
    sock = connect_tunnel(gateway, host, offer)
    try:
        assert sock.selected_alpn_protocol() == "h2", (
            f"the client offered {offer}, the gateway chose {sock.selected_alpn_protocol()!r}")
        _follow_a_paced_stream(routes, sock, "h2", host)
    finally:
        sock.close()


def test_an_http11_only_client_keeps_http11(gateway, routes, origins):
    host = name("h2", "unbound")
    sock = connect_tunnel(gateway, host, ["http/1.1"])
    try:
        assert sock.selected_alpn_protocol() == "http/1.1"
        _follow_a_paced_stream(routes, sock, "h1", host)
    finally:
        sock.close()


def test_httpx_http2_to_an_http11_only_origin_still_works(gateway, routes, origins):
    """The h1 origin refuses h2: whatever the gateway speaks to the client, the stream arrives."""
    events = model_events(3)
    route, lock = paced_stream(routes, plan_events(events))
    with httpx_client(gateway) as client:
        with httpx_stream(client, f"https://{name('h1', 'unbound')}{route.path}") as response:
            assert response.status_code == 200
            lock.ack(0)
            follow(Events(httpx_reader(response)), events, lock)
    assert route.exchange.protocol == "HTTP/1.1"


def test_httpx_plain_http_through_the_proxy(gateway, routes, origins):
    """Plain http:// through the proxy with an http2=True client: HTTP/1.1 (no h2c), still streamed."""
    events = model_events(3)
    route, lock = paced_stream(routes, plan_events(events))
    with httpx_client(gateway) as client:
        with httpx_stream(client, f"http://{name('h1', 'unbound')}{route.path}") as response:
            assert response.status_code == 200
            assert response.http_version == "HTTP/1.1"
            lock.ack(0)
            follow(Events(httpx_reader(response)), events, lock)
