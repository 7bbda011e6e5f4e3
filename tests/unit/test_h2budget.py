"""The HTTP/2 budgets' state machines (gateway/h2budget.py) against simple models, and the
upstream h2 connection's queue (addons/h2_limits.py) that used to recurse once per queued stream."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.settings
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.h2budget import BufferLedger, RefusalAggregator, ResetTracker

times = st.lists(st.floats(min_value=0, max_value=5, allow_nan=False), max_size=200).map(
    lambda gaps: [sum(gaps[: i + 1]) for i in range(len(gaps))])  # non-decreasing timestamps


@given(times, st.integers(min_value=1, max_value=20), st.floats(min_value=0.1, max_value=20))
def test_reset_tracker_trips_exactly_when_more_than_limit_fall_in_the_window(stamps, limit, window):
    tracker = ResetTracker(limit, window)
    for i, now in enumerate(stamps):
        in_window = sum(1 for t in stamps[: i + 1] if now - t <= window)
        assert tracker.note(now) == (in_window > limit)


def test_reset_tracker_zero_means_no_limit():
    tracker = ResetTracker(0, 10)
    assert not any(tracker.note(0.0) for _ in range(10_000))
    assert tracker.total == 10_000


@given(times)
def test_aggregator_writes_at_most_one_line_per_interval_and_loses_no_count(stamps):
    aggregator = RefusalAggregator(interval=1.0)
    lines: list[tuple[float, int]] = []
    for now in stamps:
        count = aggregator.note("too_many_streams", now)
        if count is not None:
            lines.append((now, count))
    held = aggregator.flush().get("too_many_streams", 0)
    assert sum(c for _, c in lines) + held == len(stamps)
    assert all(b - a >= 1.0 for (a, _), (b, _) in zip(lines, lines[1:]))


def test_aggregator_due_returns_held_back_counts_once_the_interval_is_over():
    aggregator = RefusalAggregator(interval=1.0)
    assert aggregator.note("r", 0.0) == 1
    assert aggregator.note("r", 0.5) is None and aggregator.note("r", 0.6) is None
    assert aggregator.due(0.9) == {} and aggregator.held_back
    assert aggregator.due(1.0) == {"r": 2} and not aggregator.held_back
    assert aggregator.flush() == {}


@given(st.integers(min_value=1, max_value=10_000),
       st.lists(st.tuples(st.integers(1, 9), st.integers(0, 5000), st.booleans()), max_size=300))
def test_ledger_never_holds_more_than_its_budget(budget, steps):
    ledger = BufferLedger(budget)
    for stream, size, release in steps:
        if release:
            ledger.release(stream)
        else:
            before = ledger.total
            admitted = ledger.admit(stream, size)
            assert admitted == (before + size <= budget)
        assert ledger.total <= budget


def _upstream_h2_client(layer_class, max_streams: int):
    from mitmproxy.proxy import events

    from tests.support.h2_layers import upstream_h2_context

    context = upstream_h2_context()
    layer = layer_class(context)
    list(layer.handle_event(events.Start()))
    origin = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    origin.initiate_connection()
    origin.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
    list(layer.handle_event(events.DataReceived(context.server, origin.data_to_send())))
    return layer


@settings(deadline=None, max_examples=5)
@given(st.integers(min_value=1, max_value=3))
def test_an_upstream_h2_queue_of_streams_that_close_at_once_drains_without_recursion(max_streams):
    """3,000 streams wait for one of `max_streams` upstream slots, each reset by its client while it
    waited. When a slot frees, each queued stream opens and closes at once. mitmproxy's
    Http2Client resumed the next one from inside the call that handled the previous one: a
    RecursionError from about 1,000 queued streams on (the rapid-reset flood hit it in 2 of 6 runs)."""
    from mitmproxy import http
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http._events import ErrorCode, RequestHeaders, RequestProtocolError

    from addons.h2_limits import GatewayHttp2Client

    layer = _upstream_h2_client(GatewayHttp2Client, max_streams)
    for i in range(3000):
        stream = 1 + 2 * i
        list(layer.handle_event(RequestHeaders(stream, http.Request.make("GET", "https://origin.test/"), True)))
        if i >= max_streams:
            list(layer.handle_event(RequestProtocolError(stream, "reset by the client", ErrorCode.CANCEL)))
    assert len(layer.stream_queue) == 3000 - max_streams
    sent = []
    for i in range(max_streams):
        sent += list(layer.handle_event(RequestProtocolError(1 + 2 * i, "reset by the client", ErrorCode.CANCEL)))
    assert not layer.stream_queue
    assert sum(1 for c in sent if isinstance(c, commands.SendData)) >= 3000 - max_streams


def test_an_aggregated_audit_line_counts_as_many_refusals_in_the_metrics():
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.on_decision({"event": "request", "decision": "deny", "reason": "too_many_streams", "repeated": 1})
    metrics.on_decision({"event": "request", "decision": "deny", "reason": "too_many_streams", "repeated": 41})
    metrics.on_decision({"event": "connection", "mode": "regular", "decision": "deny", "reason": "reset_flood"})
    assert metrics.registry.get_sample_value("egress_requests_total", {
        "sandbox": "none", "rule": "none", "decision": "deny", "reason": "too_many_streams"}) == 42
    assert metrics.registry.get_sample_value("egress_connections_total", {
        "mode": "regular", "decision": "deny", "reason": "reset_flood"}) == 1


def test_control_frames_over_the_limit_in_the_window():
    from gateway.h2budget import ControlFrameTracker
    tracker = ControlFrameTracker(limit=3, window=10.0)
    assert not any(tracker.control(t) for t in (0.0, 1.0, 2.0))
    assert tracker.control(3.0)  # the 4th within 10 s
    spaced = ControlFrameTracker(limit=3, window=10.0)
    assert not any(spaced.control(t * 5.0) for t in range(20))  # never more than 3 in a window
    assert not ControlFrameTracker(limit=0).control(0.0)  # 0: no limit


def test_window_updates_are_earned_by_data_frames_sent():
    from gateway.h2budget import ControlFrameTracker
    tracker = ControlFrameTracker(limit=2, window=10.0)
    tracker.data_sent(1000)
    assert not any(tracker.window_update(0.0) for _ in range(2000))  # two per DATA frame: free
    assert tracker.total == 0
    assert not tracker.window_update(0.0) and not tracker.window_update(0.0)
    assert tracker.window_update(0.0)  # unearned ones count
