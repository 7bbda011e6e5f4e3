"""What one HTTP/2 request head may cost (addons/h2_limits.py BoundedFrameBuffer, addons/http2_server.py
GatewayHttp2Server): a header block is bounded while it arrives, before h2 joins it and HPACK
decodes it; what it decodes to is bounded too; an unfinished block has a deadline; a head with too
many fields is refused on its stream before any hook sees it. Driven through the real layer
(mitmproxy's sans-I/O API) with real frames."""

from __future__ import annotations

import dataclasses

import h2.config
import h2.connection
import h2.errors
import h2.events
import hpack
from hyperframe.frame import ContinuationFrame, HeadersFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from addons import h2_limits
from addons.http2_server import GatewayHttp2Server

LIMIT = h2_limits.DEFAULT_MAX_HEAD_BYTES
BASE = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test"), (b":path", b"/")]


def _server(**limits):
    from mitmproxy.addons import proxyserver
    from mitmproxy.connection import Client
    from mitmproxy.proxy import events
    from mitmproxy.proxy.context import Context
    from mitmproxy.test import taddons

    with taddons.context(proxyserver.Proxyserver()) as tctx:
        options = tctx.options
    client = Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=0)
    refused: list[tuple[str, dict]] = []
    layer = GatewayHttp2Server(Context(client, options),
                               lambda context, decision, *args, **fields: refused.append((decision.reason, fields)))
    if limits:
        layer.limits = dataclasses.replace(layer.limits, **limits)
    layer.started = list(layer.handle_event(events.Start()))  # (its SETTINGS frame)
    return layer, client, refused


def _client():
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=False))
    h2c.initiate_connection()
    return h2c


def _send(layer, client, data: bytes) -> list:
    """What the layer does with `data`, as the event loop would run it: a backlog step that ran out
    of time (gateway/h2budget.py Backlog: 1 ms, which a loaded machine passes before the first
    request) goes on at its wakeup, delivered here; the commands of every step, without those
    wakeups (the layer's other timers are returned, not run)."""
    from mitmproxy.proxy import commands as mc, events

    commands = list(layer.handle_event(events.DataReceived(client, data)))
    for _ in range(10_000):
        due = [c for c in commands if isinstance(c, mc.RequestWakeup) and c is layer._backlog_wakeup]
        if not due:
            return commands
        commands = [c for c in commands if c is not due[0]] + list(layer.handle_event(events.Wakeup(due[0])))
    raise AssertionError("the layer's backlog never emptied")


def _opened(commands) -> list[int]:
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import RequestHeaders

    return [c.event.stream_id for c in commands if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestHeaders)]


def _answer(h2c, commands) -> list:
    """What the client makes of the gateway's bytes."""
    from mitmproxy.proxy import commands as mc

    return h2c.receive_data(b"".join(c.data for c in commands if isinstance(c, mc.SendData)))


def _block_frames(block: bytes, piece: int, stream_id: int = 1) -> list[bytes]:
    """One header block as HEADERS + CONTINUATION frames of `piece` bytes each."""
    pieces = [block[at:at + piece] for at in range(0, len(block), piece)] or [b""]
    frames = []
    for n, data in enumerate(pieces):
        frame = HeadersFrame(stream_id, data) if n == 0 else ContinuationFrame(stream_id, data)
        frame.flags = {"END_STREAM"} if n == 0 else set()
        if n == len(pieces) - 1:
            frame.flags.add("END_HEADERS")
        frames.append(frame.serialize())
    return frames


@settings(deadline=None, max_examples=40)
@given(st.integers(min_value=0, max_value=3 * LIMIT), st.sampled_from([1024, 16384, 2 ** 17]),
       st.booleans())
def test_a_header_block_is_bounded_as_it_arrives_not_once_joined(padding, piece, huffman):
    """An 8 MiB block (63 CONTINUATION frames of 128 KiB) was joined whole and HPACK-decoded in one
    ~2 s callback before anything checked its size. Now HPACK never sees a block over the limit:
    the frame that passes it ends the connection (GOAWAY ENHANCE_YOUR_CALM, one audit line), and
    no frame after it is read; a block within the limit is a request as before."""
    layer, client, refused = _server()
    decoded: list[int] = []
    decode = layer.h2_conn.decoder.decode
    layer.h2_conn.decoder.decode = lambda data, raw=False: decoded.append(len(data)) or decode(data, raw)
    block = hpack.Encoder().encode(BASE + [(b"x-pad", b"a" * padding)], huffman=huffman)
    h2c = _client()
    frames = _block_frames(block, piece)
    commands = _send(layer, client, h2c.data_to_send() + b"".join(frames))
    assert all(size <= LIMIT for size in decoded)
    if len(block) > LIMIT:
        assert _opened(commands) == [] and [reason for reason, _ in refused] == ["request_head_too_large"]
        assert refused[0][1]["bytes"] > LIMIT
        ends = [e for e in _answer(h2c, commands) if isinstance(e, h2.events.ConnectionTerminated)]
        assert ends and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert layer.h2_conn.incoming_buffer._headers_buffer == []  # nothing more of it is kept
    elif len(block) + 32 * 5 + sum(len(n) + len(v) for n, v in BASE) + 5 + padding <= LIMIT:
        assert _opened(commands) == [1] and refused == []


def test_a_small_block_that_decodes_past_the_limit_is_refused_and_audited():
    """HPACK's own header-list limit (a small block of references to one large table entry): h2
    raised DenialOfServiceError and mitmproxy closed the connection with no audit line."""
    layer, client, refused = _server()
    encoder = hpack.Encoder()
    big = (b"x-big", b"b" * 3000)
    block = encoder.encode(BASE + [big] * 40, huffman=False)  # the value once, then 39 one-byte references
    assert len(block) < 4 * 1024
    h2c = _client()
    commands = _send(layer, client, h2c.data_to_send() + b"".join(_block_frames(block, 16384)))
    assert _opened(commands) == [] and [reason for reason, _ in refused] == ["request_head_too_large"]
    ends = [e for e in _answer(h2c, commands) if isinstance(e, h2.events.ConnectionTerminated)]
    assert ends and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


def test_the_gateway_advertises_the_header_list_limit():
    layer, client, _ = _server()
    changed = [e for e in _answer(_client(), layer.started) if isinstance(e, h2.events.RemoteSettingsChanged)]
    settings_ = changed[0].changed_settings
    assert settings_[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE].new_value == LIMIT


def test_an_unfinished_header_block_has_a_deadline():
    """HEADERS without END_HEADERS, then silence: the connection was held until tcp_timeout, and
    95 such connections held 784 MiB. Now the head timeout runs from the block's first frame."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client, refused = _server(head_timeout=30.0)
    block = hpack.Encoder().encode(BASE + [(b"x-pad", b"a" * 100)], huffman=False)
    h2c = _client()
    first = _block_frames(block, 50)[:-1]  # every frame but the one that ends the block
    commands = _send(layer, client, h2c.data_to_send() + b"".join(first))
    timers = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert len(timers) == 1 and 29.9 < timers[0].delay <= 30.0
    # Woken early (the block has waited 10 s): the timer is set again for what is left.
    layer.h2_conn.incoming_buffer.block_started -= 10
    commands = list(layer.handle_event(events.Wakeup(timers[0])))
    again = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert refused == [] and len(again) == 1 and 19 < again[0].delay <= 20
    layer.h2_conn.incoming_buffer.block_started -= 20
    commands = list(layer.handle_event(events.Wakeup(again[0])))
    assert [reason for reason, _ in refused] == ["request_head_timeout"]
    ends = [e for e in _answer(h2c, commands) if isinstance(e, h2.events.ConnectionTerminated)]
    assert ends and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert any(isinstance(c, mc.CloseConnection) for c in commands)


def test_a_header_block_that_ends_in_time_clears_its_deadline():
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client, refused = _server(head_timeout=30.0)
    block = hpack.Encoder().encode(BASE + [(b"x-pad", b"a" * 100)], huffman=False)
    h2c = _client()
    frames = _block_frames(block, 50)
    commands = _send(layer, client, h2c.data_to_send() + b"".join(frames[:-1]))
    timer = [c for c in commands if isinstance(c, mc.RequestWakeup)][0]
    assert _opened(_send(layer, client, frames[-1])) == [1]
    assert layer.h2_conn.incoming_buffer.block_started is None
    layer.h2_conn.incoming_buffer.block_bytes = 0
    commands = list(layer.handle_event(events.Wakeup(timer)))
    assert refused == [] and not [c for c in commands if isinstance(c, (mc.RequestWakeup, mc.CloseConnection))]


@settings(deadline=None, max_examples=30)
@given(st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=30), st.booleans(),
       st.sampled_from(["GET", "HEAD", "POST"]))
def test_a_head_with_too_many_fields_is_refused_on_its_stream(fields, limit, with_body, method):
    """12,000 tiny fields in a 60 KB head cost ~100 ms of the loop per request in the header
    checks. Over egress_max_header_fields (pseudo-header fields not counted) the stream is
    answered 431 too_many_header_fields and never becomes a request; the connection goes on."""
    layer, client, refused = _server(max_header_fields=limit)
    h2c = _client()
    headers = [(b":method", method.encode())] + BASE[1:] + [(b"x-f%d" % n, b"0") for n in range(fields)]
    h2c.send_headers(1, headers, end_stream=not with_body)
    commands = _send(layer, client, h2c.data_to_send())
    if fields <= limit:
        assert _opened(commands) == [1] and refused == []
        return
    assert _opened(commands) == [] and [reason for reason, _ in refused] == ["too_many_header_fields"]
    answer = _answer(h2c, commands)
    responses = [e for e in answer if isinstance(e, h2.events.ResponseReceived)]
    assert responses and dict(responses[0].headers)[b":status"] == b"431"
    assert dict(responses[0].headers)[b"x-egress-reason"] == b"too_many_header_fields"
    body = b"".join(e.data for e in answer if isinstance(e, h2.events.DataReceived))
    assert (body == b"") == (method == "HEAD")
    assert any(isinstance(e, h2.events.StreamReset) for e in answer) == with_body
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in answer)
    # The connection still serves the next request.
    h2c.send_headers(3, BASE, end_stream=True)
    assert _opened(_send(layer, client, h2c.data_to_send())) == [3]


def test_trailers_with_too_many_fields_refuse_their_stream():
    from mitmproxy.proxy import events

    layer, client, refused = _server(max_header_fields=4)
    h2c = _client()
    h2c.send_headers(1, [(b":method", b"POST")] + BASE[1:])
    h2c.send_data(1, b"body")
    assert _opened(_send(layer, client, h2c.data_to_send())) == [1]
    h2c.send_headers(1, [(b"x-t%d" % n, b"0") for n in range(5)], end_stream=True)
    commands = _send(layer, client, h2c.data_to_send())
    assert [reason for reason, _ in refused] == ["too_many_header_fields"]
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import RequestProtocolError, RequestTrailers

    sent_up = [c.event for c in commands if isinstance(c, ReceiveHttp)]
    assert not any(isinstance(e, RequestTrailers) for e in sent_up)
    assert any(isinstance(e, RequestProtocolError) for e in sent_up)
    del events


@settings(deadline=None, max_examples=20)
@given(st.integers(min_value=2 ** 17 + 1, max_value=2 ** 24 - 1), st.sampled_from([0x1, 0x0, 0x9, 0x8]),
       st.integers(min_value=0, max_value=3))
def test_a_frame_declaring_more_than_the_maximum_is_refused_from_its_header(length, kind, split):
    """h2 waited for the whole frame before checking its length: a header declaring 16 MiB, then
    15 MiB of it, was held per connection (95 of them: 2 GiB) with no refusal. Now the 9 bytes of
    the frame header are enough: GOAWAY FRAME_SIZE_ERROR, one audit line, nothing of it kept."""
    layer, client, refused = _server()
    h2c = _client()
    header = length.to_bytes(3, "big") + bytes([kind, 0]) + (1).to_bytes(4, "big")
    data = h2c.data_to_send() + header
    commands = []
    if split:  # the header itself in pieces
        commands += _send(layer, client, data[:-split])
        assert refused == []
        data = data[-split:]
    commands += _send(layer, client, data + b"x" * 1000)
    assert [reason for reason, _ in refused] == ["malformed_request"]
    ends = [e for e in _answer(h2c, commands) if isinstance(e, h2.events.ConnectionTerminated)]
    assert ends and ends[0].error_code == h2.errors.ErrorCodes.FRAME_SIZE_ERROR
    assert len(layer.h2_conn.incoming_buffer._data) == 0


def test_a_protocol_error_is_audited():
    """PUSH_PROMISE from a client: GOAWAY PROTOCOL_ERROR, and now an audit line too."""
    from hyperframe.frame import PushPromiseFrame

    layer, client, refused = _server()
    h2c = _client()
    h2c.send_headers(1, BASE, end_stream=True)
    promise = PushPromiseFrame(1, hpack.Encoder().encode(BASE))
    promise.promised_stream_id = 2
    promise.flags = {"END_HEADERS"}
    _send(layer, client, h2c.data_to_send() + promise.serialize())
    assert [reason for reason, _ in refused] == ["malformed_request"]


def _frame_header(length: int, kind: int, flags: int = 0, stream_id: int = 1) -> bytes:
    return length.to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big")


def test_a_header_block_frame_declaring_more_than_a_head_is_refused_from_its_header():
    """A HEADERS frame may declare up to the 128 KiB frame size, twice the head limit: it was kept
    until whole (and with no deadline: 400 such connections held ~240 KB each, uncharged). Now its
    9-byte header is enough to refuse it."""
    layer, client, refused = _server()
    h2c = _client()
    commands = _send(layer, client, h2c.data_to_send() + _frame_header(LIMIT + 1, HeadersFrame.type, 0x4)
                     + b"\0" * 1000)
    assert [reason for reason, _ in refused] == ["request_head_too_large"] and refused[0][1]["bytes"] > LIMIT
    ends = [e for e in _answer(h2c, commands) if isinstance(e, h2.events.ConnectionTerminated)]
    assert ends and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert len(layer.h2_conn.incoming_buffer._data) == 0


def test_a_continuation_is_judged_with_the_block_it_continues():
    layer, client, refused = _server()
    h2c = _client()
    block = hpack.Encoder().encode(BASE, huffman=False)
    first = HeadersFrame(1, block + b"\0" * 0)
    first.flags = {"END_STREAM"}
    _send(layer, client, h2c.data_to_send() + first.serialize())
    assert refused == []
    _send(layer, client, _frame_header(LIMIT - len(block) + 1, ContinuationFrame.type, 0x4))
    assert [reason for reason, _ in refused] == ["request_head_too_large"]


def test_an_incomplete_frame_other_than_data_has_the_head_deadline():
    """A HEADERS frame within the limits, trickled: no block had started (h2 keeps the frame until
    whole), so no deadline ran. Now the head timeout runs from its first byte."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client, refused = _server(head_timeout=30.0)
    h2c = _client()
    commands = _send(layer, client, h2c.data_to_send() + _frame_header(60000, HeadersFrame.type, 0x4) + b"\0" * 10)
    timers = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert len(timers) == 1 and 29.9 < timers[0].delay <= 30.0
    assert layer.h2_conn.incoming_buffer.pending_since is not None
    _send(layer, client, b"\0" * 10)  # a trickle does not restart it
    layer.h2_conn.incoming_buffer.partial_started -= 30
    commands = list(layer.handle_event(events.Wakeup(timers[0])))
    assert [reason for reason, _ in refused] == ["request_head_timeout"]
    assert refused[0][1]["bytes"] >= 29
    ends = [e for e in _answer(h2c, commands) if isinstance(e, h2.events.ConnectionTerminated)]
    assert ends and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


def test_an_incomplete_data_frame_has_the_body_idle_deadline_not_the_head_one():
    """A large DATA frame arriving slowly is an upload: it has the body's idle limit (120 s), not
    the head's 30 s; past it, the connection ends (review 9: 400 connections each trickling a
    128 KiB DATA frame held ~100 MB with no deadline)."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client, refused = _server(head_timeout=30.0, data_frame_timeout=120.0)
    h2c = _client()
    h2c.send_headers(1, [(b":method", b"POST")] + BASE[1:], end_stream=False)
    commands = _send(layer, client, h2c.data_to_send() + _frame_header(16000, 0x0) + b"x" * 100)
    assert _opened(commands) == [1] and refused == []
    timers = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert layer.h2_conn.incoming_buffer.partial_data and len(timers) == 1 and 119.9 < timers[0].delay <= 120
    layer.h2_conn.incoming_buffer.partial_started -= 120
    list(layer.handle_event(events.Wakeup(timers[0])))
    assert [reason for reason, _ in refused] == ["request_body_timeout"]


def test_a_frame_header_split_before_its_type_has_a_bodys_deadline_not_a_heads():
    """Review 9: a read ending two bytes into a DATA frame's header (TLS records do) made it a
    pending 'non-DATA' frame with the 30 s head deadline. Review 12: but it had no deadline at
    all, and 1 to 3 bytes then silence held the connection until tcp_timeout. Now the body's."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    for cut in (1, 2, 3):
        layer, client, refused = _server(head_timeout=30.0, data_frame_timeout=120.0)
        h2c = _client()
        h2c.send_headers(1, [(b":method", b"POST")] + BASE[1:], end_stream=False)
        commands = _send(layer, client, h2c.data_to_send() + _frame_header(16000, 0x0)[:cut])
        buffer = layer.h2_conn.incoming_buffer
        timers = [c for c in commands if isinstance(c, mc.RequestWakeup)]
        assert buffer.partial_data and timers and 119.9 < timers[-1].delay <= 120, cut
        buffer.partial_started -= 120
        list(layer.handle_event(events.Wakeup(timers[-1])))
        assert [reason for reason, _ in refused] == ["request_body_timeout"], cut


def test_a_header_cut_before_its_type_has_the_head_deadline_from_its_first_byte_once_known():
    """The type arrives and says HEADERS: the head's 30 s count from the frame's first byte."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client, refused = _server(head_timeout=30.0, data_frame_timeout=120.0)
    h2c = _client()
    header = _frame_header(100, HeadersFrame.type, 0x4)
    _send(layer, client, h2c.data_to_send() + header[:2])
    buffer = layer.h2_conn.incoming_buffer
    buffer.partial_started -= 40  # the rest of the header comes 40 s later
    commands = _send(layer, client, header[2:] + b"\0" * 5)
    assert not buffer.partial_data
    timers = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert timers and timers[-1].delay == 0.0  # due at once: a new, nearer deadline is armed
    list(layer.handle_event(events.Wakeup(timers[-1])))
    assert [reason for reason, _ in refused] == ["request_head_timeout"]


def test_a_nearer_deadline_is_not_shadowed_by_a_later_timer():
    """Review 12: a partial DATA frame armed its 120 s (here 30 s) timer; the frame completed and
    a header block began, whose 3 s deadline then waited for that timer: GOAWAY at 29 s, not 3 s."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client, refused = _server(head_timeout=3.0, data_frame_timeout=30.0)
    h2c = _client()
    h2c.send_headers(1, [(b":method", b"POST")] + BASE[1:], end_stream=False)
    frame = _frame_header(100, 0x0) + b"x" * 100
    first = _send(layer, client, h2c.data_to_send() + frame[:59])
    long_timer = [c for c in first if isinstance(c, mc.RequestWakeup)]
    assert long_timer and 29.9 < long_timer[-1].delay <= 30
    commands = _send(layer, client, frame[59:] + _frame_header(50, HeadersFrame.type, 0x4, stream_id=3) + b"\0" * 5)
    short = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert short and 2.9 < short[-1].delay <= 3.0
    layer.h2_conn.incoming_buffer.partial_started -= 3
    list(layer.handle_event(events.Wakeup(short[-1])))
    assert [reason for reason, _ in refused] == ["request_head_timeout"]
    list(layer.handle_event(events.Wakeup(long_timer[-1])))  # the old timer, when it fires, does nothing more
    assert len(refused) == 1


def test_a_later_deadline_arms_no_second_timer():
    """No wakeup per read while an armed one fires first (a trickled frame: one timer)."""
    from mitmproxy.proxy import commands as mc

    layer, client, refused = _server(head_timeout=30.0)
    h2c = _client()
    commands = _send(layer, client, h2c.data_to_send() + _frame_header(60000, HeadersFrame.type, 0x4) + b"\0" * 10)
    assert len([c for c in commands if isinstance(c, mc.RequestWakeup)]) == 1
    for _ in range(5):
        assert not [c for c in _send(layer, client, b"\0" * 10) if isinstance(c, mc.RequestWakeup)]


def test_an_incomplete_frame_is_charged_to_the_buffer_budget():
    """Review 12: 300 connections each holding a partial 128 KiB frame took 75 MiB past an 8 MiB
    sandbox budget, uncharged. The frame's bytes are the connection's and the sandbox's; past the
    budget, GOAWAY and `buffer_budget`; what a completed frame held is given back."""
    from mitmproxy.proxy import events

    from gateway.budget import Ledger

    ledger = Ledger(per_connection=10_000, per_sandbox=25_000)
    layers = []
    for n in range(3):
        layer, client, refused = _server()
        layer._frames_account = ledger.account(f"c{n}", "sandbox:a")
        h2c = _client()
        h2c.send_headers(1, [(b":method", b"POST")] + BASE[1:], end_stream=False)
        _send(layer, client, h2c.data_to_send() + _frame_header(16000, 0x0) + b"x" * 5000)
        layers.append((layer, client, refused))
    assert ledger.held(sandbox="sandbox:a") == 3 * (9 + 5000) and all(r == [] for *_, r in layers)
    layer, client, refused = layers[0]
    _send(layer, client, b"x" * 6000)  # past the connection's 10,000
    assert [reason for reason, _ in refused] == ["buffer_budget"]
    layer, client, refused = layers[1]
    _send(layer, client, b"x" * 11000)  # the rest of its frame: whole, handed on, given back
    assert refused == [] and ledger.held(connection="c1") == 0
    layer, client, refused = layers[2]
    list(layer.handle_event(events.ConnectionClosed(client)))
    assert ledger.held(connection="c2") == 0


def test_time_the_gateway_does_not_read_the_client_does_not_count():
    """Review 9: an upload whose upstream stalled made the gateway stop reading the client (its
    reader waits for the upstream's writer); a frame caught half-read then 'took' 30 s and the
    whole connection was closed. The deadline runs on a clock that stops while the reader waits."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    from addons import h2_backpressure

    layer, client, refused = _server(head_timeout=30.0)
    h2c = _client()
    commands = _send(layer, client, h2c.data_to_send() + _frame_header(8, 0x8) + b"\0\0")  # half a WINDOW_UPDATE
    timer = [c for c in commands if isinstance(c, mc.RequestWakeup)][0]
    buffer = layer.h2_conn.incoming_buffer
    buffer.partial_started -= 40  # 40 s have passed...
    h2_backpressure._not_reading[client] = [35.0, None, 0]  # ... 35 of them with the gateway not reading it
    commands = list(layer.handle_event(events.Wakeup(timer)))
    again = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert refused == [] and len(again) == 1 and 24 < again[0].delay <= 25
    h2_backpressure._not_reading[client] = [5.0, None, 0]
    list(layer.handle_event(events.Wakeup(again[0])))
    assert [reason for reason, _ in refused] == ["request_head_timeout"]


def test_a_data_frame_that_keeps_moving_keeps_its_deadline_moving():
    """Review 10: a steady 1 KB/s upload in the advertised 128 KiB frames lost its connection at
    120 s with bytes arriving every second: the body idle limit means no byte for 120 s."""
    layer, client, refused = _server(head_timeout=30.0, data_frame_timeout=120.0)
    h2c = _client()
    h2c.send_headers(1, [(b":method", b"POST")] + BASE[1:], end_stream=False)
    _send(layer, client, h2c.data_to_send() + _frame_header(100_000, 0x0) + b"x" * 100)
    buffer = layer.h2_conn.incoming_buffer
    first = buffer.partial_started
    buffer.partial_started -= 100  # 100 s have passed...
    _send(layer, client, b"x" * 100)  # ... and more of it arrives
    assert buffer.partial_started >= first and layer._pending_wait() > 119


def test_the_wall_clock_caps_a_deadline_the_client_keeps_from_running():
    """Review 10: while the clock was stopped its re-armed wakeups kept tcp_timeout from firing,
    and the connection lived for ever. tcp_timeout caps the wait on the wall clock."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    from addons import h2_backpressure

    layer, client, refused = _server(head_timeout=30.0)
    layer.context.options.tcp_timeout = 600
    h2c = _client()
    commands = _send(layer, client, h2c.data_to_send() + _frame_header(100, HeadersFrame.type, 0x4) + b"\0" * 20)
    timer = [c for c in commands if isinstance(c, mc.RequestWakeup)][0]
    buffer = layer.h2_conn.incoming_buffer
    h2_backpressure._not_reading[client] = [0.0, __import__("time").monotonic(), 1]  # the clock is stopped
    commands = list(layer.handle_event(events.Wakeup(timer)))
    again = [c for c in commands if isinstance(c, mc.RequestWakeup)]
    assert refused == [] and again and again[0].delay >= 1.0  # re-armed, never sooner than a second
    buffer.pending_wall -= 600
    list(layer.handle_event(events.Wakeup(again[0])))
    assert [reason for reason, _ in refused] == ["request_head_timeout"]


def test_only_an_upstream_that_does_not_read_stops_the_clients_clock():
    from types import SimpleNamespace

    from addons import h2_backpressure

    def io(size, high=65536):
        transport = SimpleNamespace(get_write_buffer_size=lambda: size, get_write_buffer_limits=lambda: (high // 4, high))
        return SimpleNamespace(writer=SimpleNamespace(transport=transport))

    client_io = io(10_000_000)  # the client does not read its download: its own writer is full
    handler = SimpleNamespace(transports={"client": client_io, "up": io(0)})
    assert not h2_backpressure._upstream_backed_up(handler, client_io)
    handler.transports["up2"] = io(200_000)  # an upstream that does not read the client's upload
    assert h2_backpressure._upstream_backed_up(handler, client_io)
