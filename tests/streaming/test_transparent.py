"""Behaviours 1, 2, 3, 4 and 6 in transparent mode: the sandbox has no proxy settings, its TCP 80
and 443 are redirected to the gateway by iptables (docker/sandbox-net.sh, as in tests/transparent),
and the origins live in the test's "internet" namespace. The clients are sockets opened inside the
sandbox namespace, dialling the origin's own address.

Needs root and `ip netns` (skips otherwise); everything runs in namespaces with no route off the
machine (tests/support/topology.py checks it).
"""

from __future__ import annotations

import json

import pytest

from .clients import Events, H1Client, H2Client, paced_fetch
from .conftest import KEY, REDACTED, RULE_KINDS, check_origin_saw, model_event, model_events, name
from .origins import pieces_of, plan_events
from .test_bytes import check_chunked_framing, redaction_plan, secret_event
from .test_uploads import PIECES, expected_answer, recording_upload, wait_origin_has

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

ALPN = {"h1": ["http/1.1"], "h2": ["h2"]}

CASES = [
    pytest.param("h1", "h1", "chunked", id="h1-client-h1-origin-chunked"),
    pytest.param("h1", "h1", "close", id="h1-client-h1-origin-until-close"),
    pytest.param("h2", "h2", "chunked", id="h2-client-h2-origin-no-length"),
    pytest.param("h2", "h1", "chunked", id="h2-client-h1-origin-chunked"),
]


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client,origin,framing", CASES)
def test_sse_over_redirected_tls(sandboxed, routes, client, origin, framing, rule):
    host = name(origin, rule)
    _, route = paced_fetch(routes, lambda: sandboxed.tls(origin, host, ALPN[client]), client, host,
                           model_events(5), framing=framing)
    check_origin_saw(route.exchange, rule)
    assert route.exchange.protocol == ("HTTP/2" if origin == "h2" else "HTTP/1.1")
    assert route.exchange.sni == host
    assert_decided_transparently(sandboxed, route.path)


def assert_decided_transparently(sandboxed, path: str) -> None:
    """The request went through the transparent listener (not some other way to the origin)."""
    lines = [line for line in sandboxed.gateway.audit()
             if line.get("event") == "request" and path in (line.get("path") or line.get("url") or "")]
    assert [(line.get("mode"), line.get("decision")) for line in lines] == [("transparent", "allow")], lines


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_sse_over_redirected_plain_http(sandboxed, routes, framing, rule):
    host = name("h1", rule)
    _, route = paced_fetch(routes, lambda: sandboxed.connect("h1", 80), "h1", host, model_events(5), framing=framing)
    check_origin_saw(route.exchange, rule)
    assert_decided_transparently(sandboxed, route.path)


@pytest.mark.parametrize("rule", RULE_KINDS)
def test_http11_first_offer_gets_h2(sandboxed, routes, rule):
    host = name("h2", rule)
    sock = sandboxed.tls("h2", host, ["http/1.1", "h2"])
    assert sock.selected_alpn_protocol() == "h2", f"the gateway chose {sock.selected_alpn_protocol()!r}"
    _, route = paced_fetch(routes, lambda: sock, "h2", host, model_events(3))
    check_origin_saw(route.exchange, rule)


def test_bound_small_writes_arrive_byte_for_byte(sandboxed, routes):
    host = name("h1", "bound")
    events = model_events(4)
    fetch, route = paced_fetch(routes, lambda: sandboxed.tls("h1", host, ["http/1.1"]), "h1", host, events,
                               plan=plan_events(events, pieces_of(5)))
    check_chunked_framing(fetch, b"".join(events))
    check_origin_saw(route.exchange, "bound")


@pytest.mark.parametrize("client", ["h1", "h2"])
def test_echoed_secret_split_across_writes_is_redacted(sandboxed, routes, client):
    origin = "h1" if client == "h1" else "h2"
    host = name(origin, "bound")
    events = [model_event(1), secret_event(), model_event(3), model_event(4)]
    expected = [e.replace(KEY.encode(), REDACTED) for e in events]
    fetch, route = paced_fetch(routes, lambda: sandboxed.tls(origin, host, ALPN[client]), client, host, events,
                               plan=redaction_plan(events, "split"), expected=expected)
    if client == "h1":
        check_chunked_framing(fetch, b"".join(expected))
    check_origin_saw(route.exchange, "bound")


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client", ["h1", "h2"])
def test_upload_of_unknown_length_streams(sandboxed, routes, client, rule):
    route, progress = recording_upload(routes)
    host = name("h1", rule)
    if client == "h1":
        http = H1Client(sandboxed.tls("h1", host, ["http/1.1"]))
        try:
            http.send_request("POST", route.path, [("Host", host), ("Transfer-Encoding", "chunked")])
            total = 0
            for n, piece in enumerate(PIECES, 1):
                http.send_chunk(piece)
                total += len(piece)
                wait_origin_has(progress, total, n)
            http.send_chunk(b"")
            http.read_head()
            body = Events(http.read_some, lambda b: [b] if b else []).expect_end()
        finally:
            http.close()
    else:
        h2 = H2Client(sandboxed.tls("h1", host, ["h2"]))
        try:
            sid = h2.request(host, route.path, "POST", body=None, end_stream=False)
            total = 0
            for n, piece in enumerate(PIECES, 1):
                h2.send_data(sid, piece)
                total += len(piece)
                wait_origin_has(progress, total, n)
            h2.end_stream(sid)
            h2.read_head(sid)
            body = b"".join(h2.wait_end(sid).frames)
        finally:
            h2.close()
    assert json.loads(body) == expected_answer()
    check_origin_saw(route.exchange, rule)
