"""The HTTP/2 server layer's backlog (addons/layers.py GatewayHttp2Server): one read's events are
handled at most STREAMS_PER_STEP new requests per step of the event loop, the rest on a wakeup, in
order; a stream the client reset before it was handled never becomes a request. Driven through the
real layer (mitmproxy's sans-I/O API), with a real h2 client's bytes."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
from hypothesis import given, settings
from hypothesis import strategies as st

from addons.layers import GatewayHttp2Server

STEP = GatewayHttp2Server.STREAMS_PER_STEP


def _server():
    from mitmproxy.addons import proxyserver
    from mitmproxy.connection import Client
    from mitmproxy.proxy import events
    from mitmproxy.proxy.context import Context
    from mitmproxy.test import taddons

    with taddons.context(proxyserver.Proxyserver()) as tctx:
        options = tctx.options
    client = Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=0)
    layer = GatewayHttp2Server(Context(client, options), lambda *args, **kwargs: None)
    list(layer.handle_event(events.Start()))
    return layer, client


def _opened(commands) -> list[int]:
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import RequestHeaders

    return [c.event.stream_id for c in commands if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestHeaders)]


def _wakeups(commands) -> list:
    from mitmproxy.proxy import commands as mc

    return [c for c in commands if isinstance(c, mc.RequestWakeup)]


@settings(deadline=None, max_examples=40)
@given(st.integers(min_value=1, max_value=90), st.sets(st.integers(min_value=0, max_value=89), max_size=20),
       st.booleans())
def test_streams_of_one_read_open_a_step_at_a_time_in_order_and_reset_ones_never(count, reset, reset_later):
    from mitmproxy.proxy import events

    layer, client = _server()
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    ids = []
    for n in range(count):
        ids.append(h2c.get_next_available_stream_id())
        h2c.send_headers(ids[-1], [(":method", "GET"), (":scheme", "https"), (":authority", "a.test"),
                                   (":path", f"/{n}")], end_stream=True)
    reset_ids = {ids[n] for n in reset if n < count}
    if not reset_later:
        for sid in sorted(reset_ids):
            h2c.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    commands = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    opened = _opened(commands)
    steps = [opened]
    if reset_later:  # a second read, while the first one's streams wait in the backlog
        for sid in sorted(reset_ids):
            h2c.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        more = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
        steps.append(_opened(more))
        commands += more
    pending = _wakeups(commands)
    while pending:
        assert len(pending) == 1, pending  # one wakeup at a time
        commands = list(layer.handle_event(events.Wakeup(pending[0])))
        steps.append(_opened(commands))
        pending = _wakeups(commands)
    assert all(len(step) <= STEP for step in steps), [len(s) for s in steps]
    if count - len(reset_ids) > STEP and not reset_later:
        assert len([s for s in steps if s]) > 1  # the rest came on wakeups
    handled = [sid for step in steps for sid in step]
    assert handled == sorted(handled)  # in order
    if reset_later:  # those handled before their reset arrived were requests; none after it
        early = set(handled) & reset_ids
        assert early <= set(ids[:STEP]), early
        assert set(handled) == set(ids) - (reset_ids - early)
    else:
        assert set(handled) == set(ids) - reset_ids


def test_a_step_of_the_backlog_ends_once_its_time_is_spent(monkeypatch):
    """Eight requests a step took 2-15 ms under rapid reset: the step also ends after
    STEP_SECONDS (here 0: one request a step), the rest on wakeups, all in order."""
    from mitmproxy.proxy import events

    monkeypatch.setattr(GatewayHttp2Server, "STEP_SECONDS", 0.0)
    layer, client = _server()
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    ids = []
    for n in range(5):
        ids.append(h2c.get_next_available_stream_id())
        h2c.send_headers(ids[-1], [(":method", "GET"), (":scheme", "https"), (":authority", "a.test"),
                                   (":path", f"/{n}")], end_stream=True)
    commands = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    steps = [_opened(commands)]
    while pending := _wakeups(commands):
        commands = list(layer.handle_event(events.Wakeup(pending[0])))
        steps.append(_opened(commands))
    assert [step for step in steps if step] == [[sid] for sid in ids]  # (a last step may handle what
    # follows the last request: its END_STREAM)
