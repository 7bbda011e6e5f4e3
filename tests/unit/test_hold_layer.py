"""addons/refusal_layers.py HoldLayer: the deadline of a connection's first bytes (the ClientHello, a
first line) is timed by a wakeup whenever the hold is undecided, and only then. A hold made with the
bytes already in hand (mitmproxy's NextLayer replays them right after Start) arms no timer when they
settle it; bytes that leave it undecided, a hold made without bytes, or any other event arm it. Once
decided, the hold keeps neither its callbacks nor the bytes it replayed (issue 18: they held the
ClientHello's reader for the tunnel's life)."""

from __future__ import annotations

from mitmproxy import connection, options
from mitmproxy.proxy import commands, context, events, layer

from addons.refusal_layers import HoldLayer


class Recorder(layer.Layer):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.seen: list = []

    def _handle_event(self, event):
        self.seen.append(event)
        yield from ()


def _context():
    client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080),
                               state=connection.ConnectionState.OPEN)
    return context.Context(client, options.Options())


def _hold(data_follows: bool, decide_on: bytes | None, timeout: float = 10.0):
    expired = []

    def feed(hold, chunk):
        hold.held += chunk
        if decide_on is not None and decide_on in bytes(hold.held):
            hold.layer = Recorder(hold.context)

    hold = HoldLayer(_context(), feed, lambda hold: expired.append(hold), timeout, data_follows=data_follows)
    return hold, expired


def _wakeups(cmds) -> list[commands.RequestWakeup]:
    return [c for c in cmds if isinstance(c, commands.RequestWakeup)]


def test_bytes_that_settle_the_hold_arm_no_timer_and_are_replayed():
    hold, _ = _hold(data_follows=True, decide_on=b"whole")
    client = hold.context.client
    assert _wakeups(hold.handle_event(events.Start())) == []
    assert _wakeups(hold.handle_event(events.DataReceived(client, b"whole hello"))) == []
    assert isinstance(hold.layer, Recorder)
    assert [type(e) for e in hold.layer.seen] == [events.Start, events.DataReceived]
    assert hold.layer.seen[1].data == b"whole hello"
    assert hold.feed is None and hold.expire is None and hold.replay is None and not hold._timers


def test_bytes_that_leave_it_undecided_arm_the_deadline():
    hold, expired = _hold(data_follows=True, decide_on=b"rest")
    client = hold.context.client
    assert _wakeups(hold.handle_event(events.Start())) == []
    (wakeup,) = _wakeups(hold.handle_event(events.DataReceived(client, b"part")))
    assert 9 < wakeup.delay <= 10
    # more bytes that still do not settle it: the timer runs already
    assert _wakeups(hold.handle_event(events.DataReceived(client, b"more"))) == []
    # the deadline passes: expire is called (it would set a refusal layer)
    hold.started -= 11
    list(hold.handle_event(events.Wakeup(wakeup)))
    assert expired == [hold]


def test_a_hold_made_without_bytes_arms_at_start():
    hold, _ = _hold(data_follows=False, decide_on=b"x")
    (wakeup,) = _wakeups(hold.handle_event(events.Start()))
    assert 9 < wakeup.delay <= 10


def test_any_other_event_than_start_arms_it():
    hold, _ = _hold(data_follows=True, decide_on=b"x")
    assert _wakeups(hold.handle_event(events.Start())) == []
    other = events.DataReceived(hold.context.server, b"server bytes")  # not the client's
    assert len(_wakeups(hold.handle_event(other))) == 1


def test_a_settled_hold_ignores_its_old_timer():
    hold, expired = _hold(data_follows=False, decide_on=b"whole")
    (wakeup,) = _wakeups(hold.handle_event(events.Start()))
    list(hold.handle_event(events.DataReceived(hold.context.client, b"whole")))
    hold.started -= 11
    assert list(hold.handle_event(events.Wakeup(wakeup))) == []
    assert expired == []


def test_a_decided_hold_keeps_shared_empties_not_containers_of_its_own():
    """A hold lives as long as its connection (an SSE stream: minutes): once decided with no timer
    out, its held bytes, events, timers and deadlines are the module's shared empties."""
    from addons import refusal_layers

    hold, _ = _hold(data_follows=True, decide_on=b"whole")
    list(hold.handle_event(events.Start()))
    list(hold.handle_event(events.DataReceived(hold.context.client, b"whole hello")))
    assert hold.held is refusal_layers._NOTHING_HELD and hold.events is refusal_layers._NO_EVENTS
    assert hold._timers is refusal_layers._NO_TIMERS and hold._deadline is refusal_layers._NO_DEADLINE
    assert hold.data_client() == b""
    list(hold.handle_event(events.DataReceived(hold.context.client, b"more")))  # handed on, nothing kept
    assert [type(e) for e in hold.layer.seen] == [events.Start, events.DataReceived, events.DataReceived]


def test_a_hold_decided_with_its_timer_out_keeps_the_timer_until_it_comes():
    hold, expired = _hold(data_follows=False, decide_on=b"whole")
    (wakeup,) = _wakeups(hold.handle_event(events.Start()))
    list(hold.handle_event(events.DataReceived(hold.context.client, b"whole")))
    assert wakeup in hold._timers
    hold.started -= 11
    assert list(hold.handle_event(events.Wakeup(wakeup))) == [] and expired == []
    assert not hold._timers
