"""Many small pieces, from an upstream or towards a client that does not read (review 32): each
read of an HTTP/1 upstream's chunked body comes out as one event (addons/http1.py ChunkMerger with
`take` None), each read of an upstream HTTP/2 connection's DATA frames of one stream as one event
(addons/h2_limits.py UpstreamH2Connection), and data queued for a peer's flow-control window is
joined into frame-sized pieces (CoalescedSends): what walks those queues pays per piece. Bytes and
their order are kept; properties over random piece sizes."""

from __future__ import annotations

import math

import h11
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from h11._readers import ChunkedReader
from h11._receivebuffer import ReceiveBuffer
from hypothesis import example, given, settings, strategies as st

from addons.h2_limits import CoalescedSends, UpstreamH2Connection
from addons.http1 import ChunkMerger, TrailerCatcher

pieces = st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=400)


def _pair(server_class=h2.connection.H2Connection, window: int = 65535, client_class=h2.connection.H2Connection):
    """A client and a server past their preface, the client's window `window`, one stream open
    (id 1) and answered with a head."""
    client = client_class(h2.config.H2Configuration(client_side=True))
    server = server_class(h2.config.H2Configuration(client_side=False))
    client.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    client.initiate_connection()
    server.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", "a.test"), (":path", "/")],
                        end_stream=True)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200")])
    client.receive_data(server.data_to_send())
    return client, server


@settings(max_examples=60, deadline=None)
@given(pieces)
def test_data_waiting_for_a_window_is_kept_in_frame_sized_pieces_in_order(sent):
    client, server = _pair(CoalescedSends, window=0)
    for piece in sent:
        server.send_data(1, piece)
    server.end_stream(1)
    waiting = server.stream_buffers[1]
    total = sum(map(len, sent))
    assert len(waiting) <= math.ceil(total / server.max_outbound_frame_size) + 2  # (+ the end of stream)
    assert b"".join(bytes(p.data) for p in waiting) == b"".join(sent)
    got, ended = b"", False
    client.increment_flow_control_window(total + 1, stream_id=1)
    for _ in range(100):
        server.receive_data(client.data_to_send())
        for event in client.receive_data(server.data_to_send()):
            if isinstance(event, h2.events.DataReceived):
                got += event.data
                client.acknowledge_received_data(event.flow_controlled_length, 1)
            ended = ended or isinstance(event, h2.events.StreamEnded)
        if ended:
            break
    assert got == b"".join(sent) and ended


def test_a_million_one_byte_pieces_are_a_few_dozen_frames_waiting():
    """The review's case: an upstream's 1-byte pieces for a client whose window stays shut."""
    client, server = _pair(CoalescedSends, window=0)
    for _ in range(1_000_000):
        server.send_data(1, b"x")
    assert len(server.stream_buffers[1]) == math.ceil(1_000_000 / server.max_outbound_frame_size)


@settings(max_examples=60, deadline=None)
@given(pieces)
@example([b"y" * 300] * 400)  # past h2's default 64 KiB window (mitmproxy's h2 opens its own wide)
def test_an_upstreams_data_frames_of_one_read_are_one_event(sent):
    ours, upstream = _pair(client_class=UpstreamH2Connection, window=1 << 24)
    for piece in sent:
        upstream.send_data(1, piece)
    upstream.end_stream(1)
    events = ours.receive_data(upstream.data_to_send())
    data = [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert len(data) == 1 and data[0].data == b"".join(sent) and data[0].stream_ended is not None


@settings(max_examples=60, deadline=None)
@given(pieces, st.integers(min_value=1, max_value=4))
def test_an_upstreams_chunks_of_one_read_are_one_event(sent, reads):
    wire = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in sent) + b"0\r\n\r\n"
    reader = TrailerCatcher(ChunkMerger(ChunkedReader(), None, 100, malformed=False))
    buf, out, step = ReceiveBuffer(), [], math.ceil(len(wire) / reads)
    ended = False
    for start in range(0, len(wire), step):
        buf += wire[start:start + step]
        events = 0
        while (event := reader(buf)) is not None:
            if isinstance(event, h11.EndOfMessage):
                ended = True
                break
            out.append(bytes(event.data))
            events += 1
        assert events <= 1
    assert ended and b"".join(out) == b"".join(sent)


def test_an_upstreams_broken_chunk_framing_is_left_to_mitmproxy():
    """mitmproxy turns h11's ProtocolError on an upstream body into a closed connection and a 502;
    the merger must not turn it into the client-side MalformedBody."""
    reader = TrailerCatcher(ChunkMerger(ChunkedReader(), None, 0, malformed=False))
    buf = ReceiveBuffer()
    buf += b"zz\r\nhello\r\n"
    with pytest.raises(h11.ProtocolError):
        reader(buf)


@settings(max_examples=40, deadline=None)
@given(pieces)
@example([b"x"] * 64)
@example([b"x"] * 65)
def test_a_parse_cut_at_its_slice_goes_on_where_it_stopped(sent):
    """With a slice of 0 s a parse stops after every SLICE_CHECK chunks: `cut` is set, the next
    call says "no more for now" (None) once, and the calls after go on with what is left."""
    from addons.http1 import SLICE_CHECK

    wire = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in sent) + b"0\r\n\r\n"
    merger = ChunkMerger(ChunkedReader(), None, 0, malformed=False, slice_seconds=0.0)
    buf = ReceiveBuffer()
    buf += wire
    out, cuts, ended = [], 0, False
    for _ in range(10_000):
        event = merger(buf)
        if event is None:
            assert merger.cut  # (only a cut parse stops with the whole body in the buffer)
            merger.cut = False
            cuts += 1
            continue
        if isinstance(event, h11.EndOfMessage):
            ended = True
            break
        out.append(bytes(event.data))
    assert ended and b"".join(out) == b"".join(sent)
    assert cuts == len(sent) // SLICE_CHECK


def test_the_read_ahead_gate_opens_only_once_every_source_that_closed_it_is_down_to_half():
    from addons import read_ahead

    client, first, second = object(), object(), object()
    over, half = read_ahead.READ_AHEAD_BYTES + 1, read_ahead.READ_AHEAD_BYTES // 2
    read_ahead.settle_bytes(client, first, over)
    read_ahead.settle_bytes(client, second, over)
    read_ahead.settle_bytes(client, first, 0)
    assert read_ahead.closed(client)  # the second still holds it
    read_ahead.settle_bytes(client, second, half + 1)
    assert read_ahead.closed(client)
    read_ahead.settle_bytes(client, second, half)
    assert not read_ahead.closed(client)
    read_ahead.settle_bytes(client, first, half)  # a source that never closed it changes nothing
    assert not read_ahead.closed(client)


def test_what_an_upstream_sent_before_bad_framing_goes_on_before_the_error():
    """Review 33: the chunks merged in a read were dropped when a later chunk line of the same read
    was malformed; they go on first, and the error comes at the next call (a client's request body
    stays refused whole: nothing of that read goes on)."""
    from addons.http1 import MalformedBody

    wire = b"3\r\nabc\r\n2\r\nde\r\nzz\r\nhello\r\n"
    reader, buf = ChunkMerger(ChunkedReader(), None, 0, malformed=False), ReceiveBuffer()
    buf += wire
    assert bytes(reader(buf).data) == b"abcde"
    with pytest.raises(h11.ProtocolError):
        reader(buf)
    client, buf = ChunkMerger(ChunkedReader(), None, 0), ReceiveBuffer()
    buf += wire
    with pytest.raises(MalformedBody):
        client(buf)


def _upstream_h2_layer():
    """The gateway's upstream HTTP/2 layer past its preface, with one request (stream 1) sent to
    an h2 origin that has read it; returns both."""
    from mitmproxy import http
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers.http._events import RequestHeaders

    from addons.h2_limits import GatewayHttp2Client
    from tests.support.h2_layers import upstream_h2_context

    context = upstream_h2_context()
    layer = GatewayHttp2Client(context)
    origin = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    origin.initiate_connection()
    sent = [c.data for c in layer.handle_event(events.Start()) if hasattr(c, "data")]
    request = http.Request.make("GET", "https://origin.test/")
    request.authority = "origin.test"
    sent += [c.data for c in layer.handle_event(RequestHeaders(1, request, True)) if hasattr(c, "data")]
    origin.receive_data(b"".join(sent))
    list(layer.handle_event(events.DataReceived(context.server, origin.data_to_send())))
    return layer, origin


def _answered(layer, commands, limit: int = 100_000):
    """What the layer hands the HTTP layer from `commands` and from every parse wakeup after them,
    and how many wakeups that took."""
    from mitmproxy.proxy import commands as mc, events
    from mitmproxy.proxy.layers.http._base import ReceiveHttp

    out, wakeups = [], 0
    pending = list(commands)
    while pending and wakeups < limit:
        command = pending.pop(0)
        if isinstance(command, ReceiveHttp):
            out.append(command.event)
        elif isinstance(command, mc.RequestWakeup):
            wakeups += 1
            pending += list(layer.handle_event(events.Wakeup(command)))
    return out, wakeups


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=300), st.booleans())
def test_an_upstreams_read_of_many_data_frames_is_parsed_a_slice_at_a_time(frames, closes):
    """Review 33: one read of an upstream HTTP/2 connection was parsed in one step, whatever it
    held (64 KiB of 1-byte DATA frames: 70-146 ms in which no other sandbox was served). It stops
    before a DATA frame once PARSE_SECONDS were spent and goes on at a wakeup; with a clock that
    moves 1 ms a look and a 2 ms slice, a step parses a frame or two. An upstream close right
    behind the frames waits for them: every byte arrives, in order, then the end of the answer."""
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers.http._events import ResponseData, ResponseEndOfMessage, ResponseProtocolError

    layer, origin = _upstream_h2_layer()
    now = [0.0]

    def clock():
        now[0] += 0.001
        return now[0]

    buffer = layer.h2_conn.incoming_buffer
    buffer.parse_clock = clock
    origin.send_headers(1, [(":status", "200")])
    for piece in frames:
        origin.send_data(1, piece)
    origin.end_stream(1)
    first = list(layer.handle_event(events.DataReceived(layer.conn, origin.data_to_send())))
    if closes:
        first += list(layer.handle_event(events.ConnectionClosed(layer.conn)))
    got, wakeups = _answered(layer, first)
    data = b"".join(bytes(e.data) for e in got if isinstance(e, ResponseData))
    assert data == b"".join(frames)
    assert isinstance(got[-1], ResponseEndOfMessage) and not any(isinstance(e, ResponseProtocolError) for e in got)
    assert wakeups >= len(frames) // 3  # (each step parsed a few frames: the read was cut)
    assert not buffer.more and buffer.pending_bytes == 0


def test_an_upstream_that_ends_its_connection_mid_read_leaves_the_clients_readers_free():
    """A GOAWAY ends the layer in the slice that parses it; whatever the read held behind it
    (here 320 KiB of DATA, more than the read-ahead gate allows) is never parsed, so it must not
    hold the client connection's readers shut until the client leaves."""
    from hyperframe.frame import DataFrame, GoAwayFrame
    from mitmproxy.proxy import events

    from addons import read_ahead

    layer, origin = _upstream_h2_layer()
    now = [0.0]

    def clock():
        now[0] += 0.001
        return now[0]

    layer.h2_conn.incoming_buffer.parse_clock = clock
    origin.send_headers(1, [(":status", "200")])
    origin.send_data(1, b"x")
    behind = b"".join(DataFrame(1, data=b"y" * 16_384).serialize() for _ in range(20))
    wire = origin.data_to_send() + GoAwayFrame(0).serialize() + behind
    try:
        got, _ = _answered(layer, list(layer.handle_event(events.DataReceived(layer.conn, wire))))
        assert layer.h2_conn.incoming_buffer.more  # (the rest was left unparsed)
        assert not read_ahead.closed(layer.context.client)
    finally:
        read_ahead.release(layer.context.client)
