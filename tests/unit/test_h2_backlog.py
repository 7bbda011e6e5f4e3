"""The HTTP/2 server layer's backlog (addons/http2_server.py GatewayHttp2Server): one read's events are
handled at most STREAMS_PER_STEP new requests per step of the event loop, the rest on a wakeup, in
order; a stream the client reset before it was handled never becomes a request. Driven through the
real layer (mitmproxy's sans-I/O API), with a real h2 client's bytes."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
from hypothesis import given, settings
from hypothesis import strategies as st

from addons.http2_server import GatewayHttp2Server

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
    layer.preface = b"".join(c.data for c in layer.handle_event(events.Start()) if hasattr(c, "data"))
    return layer, client


def _client(layer) -> h2.connection.H2Connection:
    """A client that has read the gateway's SETTINGS and window (2 GiB), so it may send as much."""
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    h2c.receive_data(layer.preface)
    return h2c


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


def test_a_flood_is_handled_at_once_though_earlier_requests_wait_in_the_backlog():
    """Rapid reset on a busy worker: the first read's requests were still waiting in the backlog
    when the read whose RST_STREAM frames passed the budget came. Queued behind them, the flood's
    GOAWAY went out with the backlog's next step, the client closed, and its close dropped the
    backlog with the flood in it: the connection ended with no reset_flood line. Now the flood is
    recorded and answered in the read that brought it, before any later event."""
    import h2.events
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    from gateway.h2budget import DEFAULT_MAX_RESETS

    layer, client = _server()
    refused = []
    layer.on_refusal = lambda context, decision, *args, **kwargs: refused.append(decision.reason)
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    headers = [(":method", "GET"), (":scheme", "https"), (":authority", "a.test"), (":path", "/")]
    for _ in range(3 * STEP):
        h2c.send_headers(h2c.get_next_available_stream_id(), headers, end_stream=True)
    first = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    assert _wakeups(first) and layer._backlog  # requests still wait
    for _ in range(DEFAULT_MAX_RESETS + 1):
        sid = h2c.get_next_available_stream_id()
        h2c.send_headers(sid, headers, end_stream=True)
        h2c.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    flood = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    assert refused == ["reset_flood"]
    sent = b"".join(c.data for c in flood if isinstance(c, mc.SendData))
    ends = [e for e in h2c.receive_data(sent) if isinstance(e, h2.events.ConnectionTerminated)]
    assert ends and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    list(layer.handle_event(events.ConnectionClosed(client)))  # the client closes on the GOAWAY
    assert refused == ["reset_flood"]


def _flooded(layer, client) -> list:
    from mitmproxy.proxy import events

    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    headers = [(":method", "GET"), (":scheme", "https"), (":authority", "a.test"), (":path", "/")]
    for _ in range(layer.limits.max_resets + 1):
        sid = h2c.get_next_available_stream_id()
        h2c.send_headers(sid, headers, end_stream=True)
        h2c.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    return list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))


def test_a_flood_s_goaway_is_followed_by_a_fin_except_inside_a_connect_tunnel():
    """The lingering close after the gateway's own GOAWAY: FIN first where the layer owns the
    client's socket (transparent mode); inside a CONNECT tunnel mitmproxy's HttpStream turns any
    close of the client into a full one, which reset the connection while the flood still came
    in and destroyed the GOAWAY before the client read it, so there nothing is closed until the
    linger ends (as RefusalLayer does)."""
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy.layers.http import HttpStream

    def closes(commands):
        return [(type(c).__name__, getattr(c, "half_close", False)) for c in commands
                if isinstance(c, mc.CloseConnection)]

    layer, client = _server()
    assert closes(_flooded(layer, client)) == [("CloseTcpConnection", True)]
    layer, client = _server()
    layer.context.layers.insert(0, HttpStream(layer.context.fork(), 1))  # the CONNECT request's stream
    assert closes(_flooded(layer, client)) == []


@settings(deadline=None, max_examples=25)
@given(st.integers(min_value=0, max_value=4 * STEP), st.booleans())
def test_a_flood_s_goaway_names_the_last_stream_handled_not_the_last_parsed(waiting, drained):
    """RFC 9113 6.8: streams above a GOAWAY's last stream id were not acted on, and a client may
    retry them elsewhere. Streams still in the backlog when a flood ends the connection (and those
    of the read h2 stopped parsing in) never reached a hook or an upstream: the GOAWAY must not
    claim them, and must claim every stream that was handled."""
    import h2.events
    from mitmproxy.proxy import commands as mc
    from mitmproxy.proxy import events

    layer, client = _server()
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    headers = [(":method", "GET"), (":scheme", "https"), (":authority", "a.test"), (":path", "/")]
    for _ in range(waiting):
        h2c.send_headers(h2c.get_next_available_stream_id(), headers, end_stream=True)
    commands = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    handled = _opened(commands)
    while drained and (pending := _wakeups(commands)):  # else the rest still wait in the backlog
        commands = list(layer.handle_event(events.Wakeup(pending[0])))
        handled += _opened(commands)
    floods = []
    for _ in range(layer.limits.max_resets + 1):
        floods.append(h2c.get_next_available_stream_id())
        h2c.send_headers(floods[-1], headers, end_stream=True)
        h2c.reset_stream(floods[-1], h2.errors.ErrorCodes.CANCEL)
    flood = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    sent = b"".join(c.data for c in flood if isinstance(c, mc.SendData))
    ends = [e for e in h2c.receive_data(sent) if isinstance(e, h2.events.ConnectionTerminated)]
    assert len(ends) == 1 and ends[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert ends[0].last_stream_id == max(handled, default=0)
    if drained:
        assert len(handled) == waiting


def _opened_without_end(h2c, count: int) -> list[int]:
    headers = [(":method", "POST"), (":scheme", "https"), (":authority", "a.test"), (":path", "/")]
    ids = []
    for _ in range(count):
        ids.append(h2c.get_next_available_stream_id())
        h2c.send_headers(ids[-1], headers, end_stream=False)
    return ids


@settings(deadline=None, max_examples=20)
@given(st.integers(min_value=STEP + 1, max_value=90), st.integers(min_value=1, max_value=12),
       st.integers(min_value=1, max_value=16_000))
def test_the_data_waiting_in_the_backlog_is_charged_to_the_buffer_budget(streams, reads, size):
    """The gateway advertises 2 GiB windows (as mitmproxy does), so flow control does not bound
    what waits in the backlog: DATA read behind requests not handled yet. What is charged to the
    connection's buffer account is, after every event, what the backlog holds plus the partial
    frame; all of it released once the backlog has run."""
    import h2.events
    from mitmproxy.proxy import events

    from gateway.budget import Ledger

    layer, client = _server()
    ledger = Ledger(per_connection=None, per_sandbox=None)
    layer._frames_account = account = ledger.account("c", "s")
    h2c = _client(layer)
    ids = _opened_without_end(h2c, streams)
    pending = _wakeups(list(layer.handle_event(events.DataReceived(client, h2c.data_to_send()))))
    for _ in range(reads):
        h2c.send_data(ids[-1], b"x" * size)
        pending += _wakeups(list(layer.handle_event(events.DataReceived(client, h2c.data_to_send()))))
        waiting = sum(len(e.data) for e in layer._backlog if isinstance(e, h2.events.DataReceived))
        assert account.held == waiting + layer.h2_conn.incoming_buffer.pending_bytes
        assert ledger.held(sandbox="s") == account.held
    while pending:
        pending = _wakeups(list(layer.handle_event(events.Wakeup(pending.pop(0)))))
    assert not layer._backlog and account.held == 0


def _answers(h2c, commands) -> dict:
    """What the client reads of the gateway's bytes in `commands`: each stream's status, the
    streams reset, and whether the connection was ended (GOAWAY)."""
    import h2.events
    from mitmproxy.proxy import commands as mc

    sent = b"".join(c.data for c in commands if isinstance(c, mc.SendData))
    answers = {"status": {}, "reset": set(), "goaway": False}
    for event in h2c.receive_data(sent):
        if isinstance(event, h2.events.ResponseReceived):
            answers["status"][event.stream_id] = dict(event.headers)[":status"]
        elif isinstance(event, h2.events.StreamReset):
            answers["reset"].add(event.stream_id)
        elif isinstance(event, h2.events.ConnectionTerminated):
            answers["goaway"] = True
    return answers


def _drain(layer, commands) -> list:
    """Every command of the backlog's later steps, run one wakeup at a time until none is asked.

    Only the backlog's own wakeups are fired: the aggregator's flush wakeup re-arms itself while
    it holds bytes back and no time passes, so firing it here would never end."""
    from mitmproxy.proxy import events

    out = []
    pending = [w for w in _wakeups(commands) if w is layer._backlog_wakeup]
    while pending:
        more = list(layer.handle_event(events.Wakeup(pending.pop(0))))
        out += more
        pending += [w for w in _wakeups(more) if w is layer._backlog_wakeup]
    return out


def test_data_waiting_in_the_backlog_past_the_budget_refuses_its_stream_not_the_connection():
    """Over the connection's (or the sandbox's) buffer budget, the stream whose DATA waits in the
    backlog is refused (503 buffer_budget, RST_STREAM), its events dropped and its window given
    back; the connection and the other streams go on (a GOAWAY ended them all before)."""
    from mitmproxy.proxy import events

    from gateway.budget import Ledger

    layer, client = _server()
    refused = []
    layer.on_refusal = lambda context, decision, *args, **kwargs: refused.append(decision.reason)
    ledger = Ledger(per_connection=64 * 1024, per_sandbox=None)
    layer._frames_account = account = ledger.account("c", "s")
    h2c = _client(layer)
    ids = _opened_without_end(h2c, 90)
    commands = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    for _ in range(8):
        if refused:
            break
        h2c.send_data(ids[-1], b"x" * 16_000)
        commands += list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
        assert account.held <= 64 * 1024
    assert refused == ["buffer_budget"]
    assert all(_stream_of_event(e) != ids[-1] for e in layer._backlog)
    assert account.held == layer._backlog.bytes + layer.h2_conn.incoming_buffer.pending_bytes
    commands += _drain(layer, commands)
    answers = _answers(h2c, commands)
    assert not answers["goaway"]
    assert answers["status"] == {ids[-1]: "503"} and answers["reset"] == {ids[-1]}
    assert _opened(commands) == ids[:-1]  # every other stream was handled, in order
    assert h2c.outbound_flow_control_window >= 65_535 - 16_000  # what it sent was acknowledged
    list(layer.handle_event(events.ConnectionClosed(client)))
    assert account.closed and ledger.held(sandbox="s") == 0


def _stream_of_event(event):
    return getattr(event, "stream_id", None)


@settings(deadline=None, max_examples=10)
@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12),
       st.integers(min_value=16_384, max_value=96 * 1024))
def test_past_the_budget_only_streams_with_data_waiting_are_refused_and_the_rest_fits(pieces, budget):
    """Streams opened in one read, 2 x STEP more than a step handles, then one read with
    `pieces[i]` DATA frames of 8 KiB for the i-th of the last ones (their DATA waits behind the
    requests of the next step): whatever the budget, what is charged never passes it, only streams
    that had DATA waiting are refused, heaviest first (none refused carried less than one kept),
    the connection goes on, and every other stream is handled in order."""
    from mitmproxy.proxy import events

    from gateway.budget import Ledger

    layer, client = _server()
    layer.h2_conn.incoming_buffer.parse_seconds = 0  # (the read is parsed whole: a busy machine may not)
    refused = []  # (reason, the refusals its audit line stands for)
    layer.on_refusal = lambda context, decision, *args, **kwargs: refused.append(
        (decision.reason, kwargs.get("repeated", 1)))
    ledger = Ledger(per_connection=budget, per_sandbox=None)
    layer._frames_account = account = ledger.account("c", "s")
    h2c = _client(layer)
    ids = _opened_without_end(h2c, 2 * STEP + len(pieces))
    commands = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    with_data = ids[2 * STEP:]
    for stream_id, count in zip(with_data, pieces):
        for _ in range(count):
            h2c.send_data(stream_id, b"x" * 8192)
    commands += list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    assert account.held <= budget
    carried = {sid: 8192 * n for sid, n in zip(with_data, pieces)}
    if sum(carried.values()) > budget:
        assert refused  # (none of it was handled in the read's own step)
    commands += _drain(layer, commands)
    answers = _answers(h2c, commands)
    refused_ids = {sid for sid, status in answers["status"].items() if status == "503"}
    assert not answers["goaway"] and answers["reset"] == refused_ids
    assert all(carried[sid] > 0 for sid in refused_ids)
    if refused_ids:
        assert min(carried[sid] for sid in refused_ids) >= max(
            (carried[sid] for sid in with_data if sid not in refused_ids), default=0)
        # no more refused than needed: the kept ones plus the lightest refused one would not fit
        lightest = min(carried[sid] for sid in refused_ids)
        kept = sum(carried[sid] for sid in with_data if sid not in refused_ids)
        assert kept + lightest > budget
    assert _opened(commands) == [sid for sid in ids if sid not in refused_ids]
    assert not layer._backlog and account.held == 0
    list(layer.handle_event(events.ConnectionClosed(client)))  # (writes the refusals held back)
    assert {reason for reason, _ in refused} <= {"buffer_budget"}
    assert sum(count for _, count in refused) == len(refused_ids)


def _with_open_streams(count: int):
    """A server layer with `count` streams opened (POSTs whose bodies are still to come) and
    handled, and the client that opened them."""
    from mitmproxy.proxy import events

    layer, client = _server()
    h2c = _client(layer)
    ids = _opened_without_end(h2c, count)
    _drain(layer, list(layer.handle_event(events.DataReceived(client, h2c.data_to_send()))))
    return layer, client, h2c, ids


class _HoldingStream:
    """Stands for the HTTP layer's stream of a request whose body is buffered (GatewayHttp2Server
    `_holding` asks only these attributes)."""

    _paused = None
    state_wait_for_request_headers = state_done = state_errored = object()

    def __init__(self):
        self.state_consume_request_body = self.client_state = object()
        self.holds = 0


def _rotating_data(h2c, ids: list[int], frames: int) -> None:
    for n in range(frames):
        h2c.send_data(ids[n % len(ids)], b"x")


def test_a_read_of_one_byte_data_frames_over_many_streams_is_handled_a_slice_at_a_time():
    """Review 15: a step of the backlog ended by time only after a request, so one read of ~6,500
    one-byte DATA frames rotating over streams ran as one step of ~1 s. The step now ends once its
    time is spent after any event: with a clock that moves 0.25 ms a look, a 1 ms step hands out a
    few DATA events (one a stream: a read's frames of a stream are merged), the rest on wakeups,
    every byte in order."""
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import RequestData

    layer, client, h2c, ids = _with_open_streams(90)
    now = [0.0]

    def clock():
        now[0] += 0.00025
        return now[0]

    layer._backlog._clock = clock
    layer.h2_conn.incoming_buffer.parse_seconds = 0  # (the read is parsed whole: a busy machine may not)
    _rotating_data(h2c, ids, 3 * 90)
    first = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    data = [c.event for c in first if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestData)]
    assert 0 < len(data) <= 8 and layer._backlog, len(data)  # a slice; the rest waits for its turn
    assert [w for w in _wakeups(first) if w is layer._backlog_wakeup]
    rest = _drain(layer, first)
    data += [c.event for c in rest if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestData)]
    assert [(e.stream_id, e.data) for e in data] == [(sid, b"xxx") for sid in ids]  # merged per stream, in order
    assert not layer._backlog


def test_a_data_frame_is_checked_against_the_buffer_budget_in_constant_time():
    """Review 15: before each DATA frame went up, every stream in the ledger was looked at (and the
    ledger summed), frames x streams for 9,000 one-byte frames over 100 streams. Streams that
    stopped holding are now let go only when the budget would refuse: one look per frame."""
    from mitmproxy.proxy import events

    layer, client, h2c, ids = _with_open_streams(50)
    for sid in ids:
        layer._streams[sid] = _HoldingStream()
    looks = [0]
    holding = layer._holding

    def counted(stream):
        looks[0] += 1
        return holding(stream)

    layer._holding = counted
    for n in range(500):  # one frame a read: each its own event
        h2c.send_data(ids[n % len(ids)], b"x")
        _drain(layer, list(layer.handle_event(events.DataReceived(client, h2c.data_to_send()))))
    assert layer.ledger.total == 500 == sum(layer.ledger.held.values())
    assert looks[0] <= 500 + 10, looks[0]  # (was 500 x 50)


def test_a_read_of_many_small_data_frames_is_parsed_a_slice_at_a_time():
    """Review 15: h2 parsed a whole read in one call, ~50 µs a frame: a 64 KiB read of 1-byte
    DATA frames held the loop ~0.3 s before any of it reached the backlog. The parse stops before
    a DATA frame once PARSE_SECONDS were spent, the rest on the server's next steps; every byte
    arrives, each stream's in order."""
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import RequestData

    layer, client, h2c, ids = _with_open_streams(10)
    now = [0.0]

    def clock():  # a frame's look costs 0.5 ms: a 2 ms slice parses a few
        now[0] += 0.0005
        return now[0]

    buffer = layer.h2_conn.incoming_buffer
    buffer.parse_clock = clock
    _rotating_data(h2c, ids, 300)
    first = list(layer.handle_event(events.DataReceived(client, h2c.data_to_send())))
    assert buffer.more and buffer.pending_bytes > 0  # the rest of the read waits, unparsed
    data = [c.event for c in first if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestData)]
    assert sum(len(e.data) for e in data) < 20
    data += [c.event for c in _drain(layer, first) if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestData)]
    got = {}
    for e in data:
        got[e.stream_id] = got.get(e.stream_id, b"") + e.data
    assert got == {sid: b"x" * 30 for sid in ids} and not buffer.more and buffer.pending_bytes == 0
