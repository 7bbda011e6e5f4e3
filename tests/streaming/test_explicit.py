"""Behaviour 1 in explicit mode: a response of unknown length (HTTP/1.1 chunked, read-until-close,
HTTP/2 without content-length), and every text/event-stream / application/x-ndjson response even
with a Content-Length, reaches the client from its first byte: the head at once, each event as
soon as the origin sends it.

Every stream is paced by the client: the origin sends the head, waits until the client has it,
sends event 1, waits until the client confirms event 1, and so on. A gateway that holds anything
back deadlocks, and the test fails on its bounded wait naming the event that never arrived.

Clients: a raw HTTP/1.1 socket and an h2 connection, through CONNECT tunnels (TLS to the origin)
and, for HTTP/1.1, as plain `http://` absolute-form requests; for an unbound rule and for a
credential-bound one (its responses go through the redactor).
"""

from __future__ import annotations

import pytest

from .clients import (Events, Fetch, H2Client, connect_proxy, connect_tunnel, follow, grpc_split, ndjson_split,
                      paced_fetch, sse_split)
from .conftest import RULE_KINDS, check_origin_saw, model_event, model_events, name, ndjson_events
from .origins import paced_stream, plan_events

pytestmark = pytest.mark.e2e

ALPN = {"h1": ["http/1.1"], "h2": ["h2"]}

# (client protocol, origin, origin framing). An HTTP/1.1-only client makes the gateway offer only
# HTTP/1.1 upstream, so "h2 origin" needs an h2 client; the h1 origin never speaks h2.
TUNNEL_CASES = [
    pytest.param("h1", "h1", "chunked", id="h1-client-h1-origin-chunked"),
    pytest.param("h1", "h1", "close", id="h1-client-h1-origin-until-close"),
    pytest.param("h2", "h2", "chunked", id="h2-client-h2-origin-no-length"),
    pytest.param("h2", "h1", "chunked", id="h2-client-h1-origin-chunked"),
    pytest.param("h2", "h1", "close", id="h2-client-h1-origin-until-close"),
]


def run_paced(gateway, routes, client: str, host: str, events: list[bytes], *, plain: bool = False,
              origin_protocol: str | None = None, rule: str = "unbound", **options):
    """One paced stream through the explicit proxy (a CONNECT tunnel, or plain absolute-form)."""
    if plain:
        fetch, route = paced_fetch(routes, lambda: connect_proxy(gateway), "h1", host, events, absolute=True, **options)
    else:
        fetch, route = paced_fetch(routes, lambda: connect_tunnel(gateway, host, ALPN[client]), client, host, events,
                                   **options)
    exchange = route.exchange
    check_origin_saw(exchange, rule)
    if origin_protocol is not None:
        assert exchange.protocol == origin_protocol, (
            f"the gateway spoke {exchange.protocol} to the origin; this case needs {origin_protocol}")
    return fetch


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client,origin,framing", TUNNEL_CASES)
def test_sse_through_a_tunnel(gateway, routes, origins, client, origin, framing, rule):
    run_paced(gateway, routes, client, name(origin, rule), model_events(5), framing=framing, rule=rule,
              origin_protocol="HTTP/2" if origin == "h2" else "HTTP/1.1")


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_sse_as_plain_http(gateway, routes, origins, framing, rule):
    """`GET http://h1.../...` absolute-form to the proxy port, an HTTP/1.1 origin on port 80."""
    run_paced(gateway, routes, "h1", name("h1", rule), model_events(5), framing=framing, plain=True, rule=rule)


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client", ["h1", "h2"])
def test_ndjson_stream(gateway, routes, origins, client, rule):
    origin = "h2" if client == "h2" else "h1"
    run_paced(gateway, routes, client, name(origin, rule), ndjson_events(5), content_type="application/x-ndjson",
              split=ndjson_split, rule=rule)


STREAMING_TYPES = {
    "text/event-stream": (model_events, sse_split),
    "text/event-stream; charset=utf-8": (model_events, sse_split),
    "application/x-ndjson": (ndjson_events, ndjson_split),
    "application/grpc": (lambda n: grpc_messages(n), grpc_split),
    "application/grpc+proto": (lambda n: grpc_messages(n), grpc_split),
    "application/grpc-web+proto": (lambda n: grpc_messages(n), grpc_split),
}


def grpc_messages(count: int) -> list[bytes]:
    return [b"\x00" + (24).to_bytes(4, "big") + f"message {n:04d} payload bytes".encode()[:24].ljust(24, b".")
            for n in range(1, count + 1)]


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client", ["h1", "h2"])
@pytest.mark.parametrize("kind", list(STREAMING_TYPES))
def test_streaming_types_stream_even_with_a_content_length(gateway, routes, origins, client, kind, rule):
    """The origin announced the length, but the type says the events are meant to be read live."""
    make, split = STREAMING_TYPES[kind]
    origin = "h2" if client == "h2" else "h1"
    run_paced(gateway, routes, client, name(origin, rule), make(4), content_type=kind, split=split, length=True,
              rule=rule)


@pytest.mark.parametrize("rule", RULE_KINDS)
def test_plain_http_ndjson_with_a_content_length(gateway, routes, origins, rule):
    run_paced(gateway, routes, "h1", name("h1", rule), ndjson_events(4), content_type="application/x-ndjson",
              split=ndjson_split, length=True, plain=True, rule=rule)


def test_a_long_stream_of_small_events(gateway, routes, origins):
    """Sixty events, each one confirmed before the next: nothing accumulates anywhere."""
    run_paced(gateway, routes, "h2", name("h2", "bound"), model_events(60), rule="bound")


@pytest.mark.parametrize("rule", RULE_KINDS)
def test_two_streams_on_one_http2_connection_interleave(gateway, routes, origins, rule):
    """Two paced streams on one h2 connection, confirmed alternately: neither waits for the other."""
    host = name("h2", rule)
    client = H2Client(connect_tunnel(gateway, host, ["h2"]))
    try:
        streams = []
        for label in ("a", "b"):
            events = [model_event(n, text=f"stream {label} event {n}") for n in range(1, 4)]
            route, lock = paced_stream(routes, plan_events(events), label=label)
            sid = client.request(host, route.path)
            streams.append((events, route, lock, sid))
        for events, route, lock, sid in streams:
            client.read_head(sid)
            lock.ack(0)
        readers = [Events(lambda d, sid=sid: client.read_some(sid, d)) for *_, sid in streams]
        for n in range(1, 4):
            for (events, route, lock, sid), reader in zip(streams, readers):
                reader.expect(n, events[n - 1])
                lock.ack(n)
        for (events, route, lock, sid), reader in zip(streams, readers):
            assert reader.expect_end() == b"".join(events)
            check_origin_saw(route.exchange, rule)
    finally:
        client.close()


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_http11_connection_is_reusable_after_a_stream(gateway, routes, origins, framing, rule):
    """Two paced streams one after the other on one kept-alive HTTP/1.1 tunnel: the first one's
    framing ends exactly where it should (no stray bytes before the second response)."""
    host = name("h1", rule)
    sock = connect_tunnel(gateway, host, ["http/1.1"])
    try:
        for round_ in (1, 2):
            events = [model_event(n, text=f"round {round_} event {n}") for n in range(1, 4)]
            plan = plan_events(events)
            length = sum(map(len, events)) if framing == "length" else None
            route, lock = paced_stream(routes, plan, framing="chunked", length=length)
            fetch = Fetch(sock, "h1", host, route.path)  # the same socket, a new request
            fetch.read_head(f"the response headers of request {round_}")
            assert fetch.status == 200
            lock.ack(0)
            follow(fetch.events(), events, lock)
            assert not fetch.h1.conn.buf, f"stray bytes after response {round_}: {fetch.h1.conn.buf[:100]!r}"
            check_origin_saw(route.exchange, rule)
    finally:
        sock.close()
