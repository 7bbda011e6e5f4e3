"""Behaviour 9: a long poll - the origin sends its response head only after a while.

Event-driven first: the origin signals when the request has arrived and then holds its answer
until the test releases it; the test checks the client is still waiting (no response byte yet),
releases the origin, and the answer must arrive. Then ONE real 8-second silence before the head,
which the gateway must not time out.
"""

from __future__ import annotations

import json
import ssl
import threading

import pytest

from .clients import Fetch, connect_tunnel, follow
from .conftest import RULE_KINDS, check_origin_saw, model_events, name
from .origins import WAIT, Routes, paced_stream, plan_events

pytestmark = pytest.mark.e2e


def long_poll(routes: Routes, delay: float | None = None):
    """The answer (a small JSON body with a Content-Length) comes once released, or after `delay` s."""
    arrived = threading.Event()
    lock = routes.lockstep("poll")
    answer = json.dumps({"updates": [{"id": 1, "text": "something happened"}]}).encode()

    def handler(exchange):
        for _ in exchange.body_pieces():
            pass
        arrived.set()
        if delay is not None:
            threading.Event().wait(delay)  # the origin is slow: that is the behaviour under test
        elif not lock.wait(1):
            exchange.abort()
            return
        exchange.start(200, [("Content-Type", "application/json"), ("Content-Length", str(len(answer)))], "length")
        exchange.write(answer)
        exchange.finish()

    route = routes.add(handler, "poll")
    return route, lock, arrived, answer


def nothing_yet(sock: ssl.SSLSocket) -> bytes:
    """Application bytes already waiting on the socket (b"" when there are none), without blocking."""
    sock.setblocking(False)
    try:
        return sock.recv(65536) or b"<EOF>"
    except (ssl.SSLWantReadError, BlockingIOError):
        return b""
    finally:
        sock.setblocking(True)


def read_body(fetch: Fetch) -> bytes:
    events = fetch.events(lambda body: [body] if body else [])
    return events.expect_end()


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client", ["h1", "h2"])
def test_long_poll_answered_when_the_origin_is_ready(gateway, routes, origins, client, rule):
    route, lock, arrived, answer = long_poll(routes)
    host = name("h2" if client == "h2" else "h1", rule)
    sock = connect_tunnel(gateway, host, ["h2"] if client == "h2" else ["http/1.1"])
    fetch = Fetch(sock, client, host, f"{route.path}?timeout=60")
    try:
        assert arrived.wait(WAIT), f"the long-poll request never reached the origin within {WAIT:g}s"
        if client == "h1":
            early = nothing_yet(sock)
            assert early == b"", f"the client got bytes before the origin answered: {early[:200]!r}"
        else:
            assert fetch.h2.responses[fetch.sid].status is None
        lock.ack(1)  # the origin answers now
        fetch.read_head("the long-poll answer")
        assert fetch.status == 200
        assert read_body(fetch) == answer
    finally:
        fetch.close()
    check_origin_saw(route.exchange, rule)


def test_long_poll_with_a_real_eight_second_wait(gateway, routes, origins):
    """Eight real seconds of silence before the response head: no gateway timeout may fire."""
    route, _lock, arrived, answer = long_poll(routes, delay=8.0)
    host = name("h1", "unbound")
    fetch = Fetch(connect_tunnel(gateway, host, ["http/1.1"]), "h1", host, f"{route.path}?timeout=8")
    try:
        assert arrived.wait(WAIT), "the long-poll request never reached the origin"
        fetch.read_head("the answer after 8 s", timeout=8.0 + WAIT)
        assert fetch.status == 200, (fetch.status, fetch.headers)
        assert read_body(fetch) == answer
    finally:
        fetch.close()


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("client", ["h1", "h2"])
def test_delayed_head_then_a_stream(gateway, routes, origins, client, rule):
    """The head comes only when the origin is released; then the events, paced as everywhere."""
    arrived, release = threading.Event(), threading.Event()
    events = model_events(3)
    route, lock = paced_stream(routes, plan_events(events), arrived=arrived, release=release)
    host = name("h2" if client == "h2" else "h1", rule)
    sock = connect_tunnel(gateway, host, ["h2"] if client == "h2" else ["http/1.1"])
    fetch = Fetch(sock, client, host, route.path)
    try:
        assert arrived.wait(WAIT), "the request never reached the origin"
        if client == "h1":
            assert nothing_yet(sock) == b""
        release.set()
        fetch.read_head("the delayed response headers")
        lock.ack(0)
        follow(fetch.events(), events, lock)
    finally:
        release.set()
        fetch.close()
    check_origin_saw(route.exchange, rule)
