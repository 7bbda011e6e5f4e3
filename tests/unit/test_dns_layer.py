"""addons/dns_layer.py: DNS mode's layer forgets answered queries and bounds what waits while a
query's hook runs (review 35: +225 MiB from 8 UDP ports in 150 s; +700 MiB from two pipelining
TCP connections in 60 s). Driven sans I/O, as mitmproxy's connection handler would drive it."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.dns import DnsRequestHook

from addons import read_ahead
from addons.dns_layer import MAX_QUEUED_QUERIES, MAX_RATE_REFUSED_IN_A_ROW, RATE_REFUSED_ATTR, GatewayDnsLayer
from tests.support.topology import dns_query_packet


def _layer(transport: str) -> GatewayDnsLayer:
    from mitmproxy.addons import proxyserver
    from mitmproxy.connection import Client
    from mitmproxy.proxy.context import Context
    from mitmproxy.test import taddons

    with taddons.context(proxyserver.Proxyserver()) as tctx:
        options = tctx.options
    client = Client(peername=("127.0.0.1", 5300), sockname=("127.0.0.1", 53), timestamp_start=0,
                    transport_protocol=transport)
    layer = GatewayDnsLayer(Context(client, options))
    list(layer.handle_event(events.Start()))
    return layer


def _answer_all(layer: GatewayDnsLayer, pending: list) -> list:
    """Complete each waiting hook, answering each query as addons/dns_guard.py does (the response
    hook then runs too); returns what was sent."""
    sent = []
    while pending:
        hook = pending.pop(0)
        if isinstance(hook, DnsRequestHook):
            hook.flow.response = hook.flow.request.fail(3)  # NXDOMAIN
        for command in layer.handle_event(events.HookCompleted(hook)):
            if isinstance(command, commands.StartHook):
                pending.append(command)
            elif isinstance(command, commands.SendData):
                sent.append(command.data)
    return sent


def _feed(layer: GatewayDnsLayer, data: bytes, pending: list) -> None:
    for command in layer.handle_event(events.DataReceived(layer.context.client, data)):
        if isinstance(command, commands.StartHook):
            pending.append(command)


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(0, 65535), min_size=1, max_size=300))
def test_an_answered_query_is_forgotten(ids):
    """mitmproxy kept every query's flow for as long as the peer was active; each is answered by
    the gateway itself, so none is kept once its answer is sent, whatever the ids (repeated too)."""
    layer, pending = _layer("udp"), []
    answers = 0
    for query_id in ids:
        _feed(layer, dns_query_packet("a.test", "A", query_id), pending)
        answers += len(_answer_all(layer, pending))
    assert answers == len(ids)
    assert layer.flows == {}


def test_a_udp_peer_that_sends_too_far_ahead_is_cut_off_once():
    """mitmproxy_rs queues a UDP peer's datagrams without limit until they are read: past the
    bound the peer's connection is closed (mitmproxy_rs then drops what it sends), audited once;
    nothing queued behind the cut is handled."""
    layer, pending, cut = _layer("udp"), [], []
    layer.on_cut_off = cut.append
    closes = 0
    for query_id in range(MAX_QUEUED_QUERIES + 1000):
        packet = dns_query_packet("a.test", "A", query_id)
        for command in layer.handle_event(events.DataReceived(layer.context.client, packet)):
            if isinstance(command, commands.StartHook):
                pending.append(command)
            elif isinstance(command, commands.CloseConnection) and command.connection is layer.context.client:
                closes += 1
    assert len(pending) == 1  # the first one's hook runs; the rest waits, or came after the cut
    assert len(layer._paused_event_queue) == MAX_QUEUED_QUERIES and layer.dropped == 1000 - 1
    assert closes == 1 and cut == [layer.context]
    assert len(_answer_all(layer, pending)) == 1  # the one whose hook ran; the queued ones are dropped
    assert layer.flows == {}


def test_a_tcp_connection_s_readers_wait_while_its_queries_queue_past_the_read_ahead():
    read_ahead.install()
    layer, pending = _layer("tcp"), []
    client = layer.context.client
    query = dns_query_packet("a.test", "A", 1)
    framed = struct.pack("!H", len(query)) + query
    try:
        _feed(layer, framed, pending)  # its hook runs: the layer waits
        for _ in range(1000):  # 100 queries a read, as a client pipelining them sends them
            if read_ahead.closed(client):
                break
            assert read_ahead.queued_bytes(layer) <= read_ahead.READ_AHEAD_BYTES
            _feed(layer, framed * 100, pending)
        else:
            pytest.fail("the readers were never held: the queue grew without bound")
        answers = _answer_all(layer, pending)
        assert not read_ahead.closed(client)  # worked off: reading goes on
        assert len(answers) > read_ahead.READ_AHEAD_BYTES // len(framed) and layer.flows == {}
    finally:
        read_ahead.release(client)


def _framed(query_id: int) -> bytes:
    query = dns_query_packet("a.test", "A", query_id)
    return struct.pack("!H", len(query)) + query


def test_a_tcp_read_of_many_queries_is_unpacked_one_query_at_a_time():
    """Review 36: mitmproxy unpacked a whole 64 KiB read at once (3,449 query objects held while
    each one's hook ran, ~30 times the bytes)."""
    layer, pending = _layer("tcp"), []
    data = b"".join(_framed(i) for i in range(500))
    _feed(layer, data, pending)
    assert len(pending) == 1 and len(layer.flows) == 1  # one query taken out; the rest still bytes
    assert len(layer.req_buf) == len(data) - len(_framed(0))
    assert len(_answer_all(layer, pending)) == 500 and layer.flows == {} and not layer.req_buf


def test_a_connection_refused_for_its_rate_enough_times_in_a_row_is_cut_off_and_reads_nothing_more():
    """One rate refusal does not cut a connection off (a resolver's long-lived socket went
    unanswered for as long as it asked, review 36); MAX_RATE_REFUSED_IN_A_ROW in a row do, and
    nothing queued behind them is handled after (they were replayed past the check, review 36)."""
    for transport in ("udp", "tcp"):
        layer, pending, answers, closes = _layer(transport), [], 0, 0
        refuse_from = 3
        for query_id in range(refuse_from + MAX_RATE_REFUSED_IN_A_ROW + 50):
            packet = dns_query_packet("a.test", "A", query_id)
            data = struct.pack("!H", len(packet)) + packet if transport == "tcp" else packet
            for command in layer.handle_event(events.DataReceived(layer.context.client, data)):
                if isinstance(command, commands.StartHook):
                    pending.append(command)
        while pending:  # the hooks complete in order: the first ones answered, then refusals
            hook = pending.pop(0)
            if isinstance(hook, DnsRequestHook):
                if answers >= refuse_from:
                    hook.flow.response = hook.flow.request.fail(5)  # REFUSED
                    setattr(hook.flow, RATE_REFUSED_ATTR, True)
                else:
                    hook.flow.response = hook.flow.request.succeed([])
                answers += 1
            for command in layer.handle_event(events.HookCompleted(hook)):
                if isinstance(command, commands.StartHook):
                    pending.append(command)
                elif isinstance(command, commands.CloseConnection):
                    closes += 1
        assert answers == refuse_from + MAX_RATE_REFUSED_IN_A_ROW, (transport, answers)
        assert closes == 1 and layer.cut_off, transport
