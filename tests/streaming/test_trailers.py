"""Behaviour 5: trailers pass through on streamed responses.

- gRPC over HTTP/2 (h2 origin, raw h2 client): length-prefixed messages paced one by one, then the
  trailers `grpc-status` / `grpc-message` (OK and an error status with a percent-encoded message).
- HTTP/1.1 chunked trailers from an HTTP/1.1 origin, read by an HTTP/2 client (as a trailing
  HEADERS frame) and by a raw HTTP/1.1 client (trailer lines after the last-chunk `0\\r\\n`).
"""

from __future__ import annotations

import pytest

from .clients import Fetch, connect_tunnel, follow, grpc_split
from .conftest import RULE_KINDS, check_origin_saw, model_events, name
from .origins import paced_stream, plan_events

pytestmark = pytest.mark.e2e


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


GRPC_STATUSES = {
    "ok": [("grpc-status", "0"), ("grpc-message", "")],
    "error": [("grpc-status", "13"), ("grpc-message", "boom%20at%20step%203"), ("x-debug-step", "3")],
}


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("status", list(GRPC_STATUSES))
def test_grpc_status_trailers_over_http2(gateway, routes, origins, status, rule):
    messages = [grpc_message(f"reply {n}: ".encode() + b"x" * 40) for n in range(1, 4)]
    route, lock = paced_stream(routes, plan_events(messages), content_type="application/grpc",
                               trailers=GRPC_STATUSES[status])
    host = name("h2", rule)
    fetch = Fetch(connect_tunnel(gateway, host, ["h2"]), "h2", host, route.path, method="POST",
                  headers=[("content-type", "application/grpc"), ("te", "trailers")],
                  body=grpc_message(b"watch please"))
    try:
        fetch.read_head()
        assert fetch.status == 200
        lock.ack(0)
        follow(fetch.events(grpc_split, "gRPC message"), messages, lock)
        response = fetch.h2.wait_end(fetch.sid)
        assert response.reset is None, f"the stream was reset ({response.reset}) instead of ending with trailers"
        assert response.trailers == GRPC_STATUSES[status], f"trailers: {response.trailers!r}"
    finally:
        fetch.close()
    exchange = route.exchange
    assert exchange.protocol == "HTTP/2"
    assert exchange.header("te") == "trailers"
    check_origin_saw(exchange, rule)


def pacing(events: list[bytes], pace: str):
    """Paced (each event confirmed before the next), or every event at once (trailers checked alone)."""
    plan = plan_events(events)
    return plan if pace == "paced" else [step for step in plan if isinstance(step, bytes)]


HTTP1_TRAILERS = [("X-Checksum", "sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"),
                  ("X-Events", "3")]


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("pace", ["paced", "all-at-once"])
def test_http11_chunked_trailers_to_an_http2_client(gateway, routes, origins, pace, rule):
    events = model_events(3)
    route, lock = paced_stream(routes, pacing(events, pace), framing="chunked", trailers=HTTP1_TRAILERS,
                               headers=[("Trailer", "X-Checksum, X-Events")])
    host = name("h1", rule)
    fetch = Fetch(connect_tunnel(gateway, host, ["h2"]), "h2", host, route.path, headers=[("te", "trailers")])
    try:
        fetch.read_head()
        lock.ack(0)
        follow(fetch.events(), events, lock)
        response = fetch.h2.wait_end(fetch.sid)
        assert response.reset is None, f"the stream was reset ({response.reset})"
        assert response.trailers == [(k.lower(), v) for k, v in HTTP1_TRAILERS], f"trailers: {response.trailers!r}"
    finally:
        fetch.close()
    assert route.exchange.protocol == "HTTP/1.1"
    check_origin_saw(route.exchange, rule)


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("pace", ["paced", "all-at-once"])
def test_http11_chunked_trailers_to_an_http11_client(gateway, routes, origins, pace, rule):
    events = model_events(3)
    route, lock = paced_stream(routes, pacing(events, pace), framing="chunked", trailers=HTTP1_TRAILERS,
                               headers=[("Trailer", "X-Checksum, X-Events")])
    host = name("h1", rule)
    fetch = Fetch(connect_tunnel(gateway, host, ["http/1.1"]), "h1", host, route.path, headers=[("TE", "trailers")])
    try:
        fetch.read_head()
        assert fetch.h1.framing == "chunked", f"the response is {fetch.h1.framing}-delimited: no room for trailers"
        lock.ack(0)
        follow(fetch.events(), events, lock)
        assert [(k.lower(), v) for k, v in fetch.trailers] == [(k.lower(), v) for k, v in HTTP1_TRAILERS], (
            f"trailer section after the last-chunk: {fetch.h1.raw_terminator!r}")
        assert all(fetch.h1.chunks)
    finally:
        fetch.close()
    check_origin_saw(route.exchange, rule)
