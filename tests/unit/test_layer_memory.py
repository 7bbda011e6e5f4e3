"""addons/layer_memory.py: a mitmproxy layer makes its queue of paused events when it first queues an
event, not in its constructor; until then it shares one empty queue that refuses writes. Queued
events are replayed after the reply exactly as mitmproxy does, each layer in its own queue; and the
copy of mitmproxy's handle_event is of the function this mitmproxy has (an upgrade that changes it
fails here, besides the version check of addons/patches.py)."""

from __future__ import annotations

import ast
import hashlib
import inspect

import pytest
from mitmproxy import connection, options
from mitmproxy.proxy import commands, context, events, layer

from addons import layer_memory
from addons.layer_memory import NO_EVENTS

layer_memory.install()

# sha256 of mitmproxy 12.3's Layer.handle_event source, which layer_memory.handle_event copies
MITMPROXY_HANDLE_EVENT = "8477335124af6b296d5fcfe144858edf1300e008babd177429811d9e11356de6"


class Waiting(layer.Layer):
    """Opens a connection at Start (a blocking command) and records what it handles after."""

    def __init__(self, ctx, server):
        super().__init__(ctx)
        self.server = server
        self.seen: list = []
        self.reply = "none yet"

    def _handle_event(self, event):
        if isinstance(event, events.Start):
            self.reply = yield commands.OpenConnection(self.server)
        else:
            self.seen.append(event)


def _context():
    client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080),
                               state=connection.ConnectionState.OPEN)
    return context.Context(client, options.Options())


def test_a_new_layer_shares_the_empty_queue_which_refuses_writes():
    first, second = Waiting(_context(), None), Waiting(_context(), None)
    assert first._paused_event_queue is NO_EVENTS is second._paused_event_queue
    assert not NO_EVENTS and list(NO_EVENTS) == []
    for write in (lambda q: q.append(1), lambda q: q.appendleft(1), lambda q: q.extend([1]),
                  lambda q: q.extendleft([1]), lambda q: q.insert(0, 1)):
        with pytest.raises(RuntimeError):
            write(NO_EVENTS)
    assert len(NO_EVENTS) == 0


def test_events_while_paused_are_queued_per_layer_and_replayed_after_the_reply():
    layers = []
    for name in ("a.test", "b.test"):
        ctx = _context()
        server = connection.Server(address=(name, 443))
        waiting = Waiting(ctx, server)
        (open_conn,) = list(waiting.handle_event(events.Start()))
        assert isinstance(open_conn, commands.OpenConnection) and waiting._paused is not None
        layers.append((waiting, open_conn, ctx))
    data = {}
    for waiting, _, ctx in layers:
        data[waiting] = events.DataReceived(ctx.client, f"from {id(waiting)}".encode())
        assert list(waiting.handle_event(data[waiting])) == []
    first, second = layers[0][0], layers[1][0]
    assert first._paused_event_queue is not second._paused_event_queue
    assert list(first._paused_event_queue) == [data[first]]
    assert list(second._paused_event_queue) == [data[second]]
    assert len(NO_EVENTS) == 0
    for waiting, open_conn, _ in layers:
        list(waiting.handle_event(events.OpenConnectionCompleted(open_conn, None)))
        assert waiting.reply is None  # the reply reached the paused generator
        assert waiting.seen == [data[waiting]]  # then the queued event, in this layer only
        assert waiting._paused_event_queue is NO_EVENTS  # replayed to the end: its deque is let go


class PausingTwice(Waiting):
    """Opens a connection at Start and another for the first event it handles after that."""

    def _handle_event(self, event):
        if isinstance(event, events.Start) or (isinstance(event, events.DataReceived) and not self.seen):
            if isinstance(event, events.DataReceived):
                self.seen.append(event)
            self.reply = yield commands.OpenConnection(self.server)
        else:
            self.seen.append(event)


def test_a_queue_left_unfinished_by_a_new_pause_is_kept_and_let_go_once_replayed():
    ctx = _context()
    waiting = PausingTwice(ctx, connection.Server(address=("a.test", 443)))
    (first_open,) = list(waiting.handle_event(events.Start()))
    one, two = events.DataReceived(ctx.client, b"1"), events.DataReceived(ctx.client, b"2")
    list(waiting.handle_event(one))
    list(waiting.handle_event(two))
    (second_open,) = list(waiting.handle_event(events.OpenConnectionCompleted(first_open, None)))
    assert waiting.seen == [one] and waiting._paused is not None  # `one` paused it again
    assert list(waiting._paused_event_queue) == [two]  # so `two` still waits, in the same queue
    list(waiting.handle_event(events.OpenConnectionCompleted(second_open, None)))
    assert waiting.seen == [one, two] and waiting._paused_event_queue is NO_EVENTS
    three = events.DataReceived(ctx.client, b"3")
    list(waiting.handle_event(three))  # not paused: handled at once, no queue made
    assert waiting.seen == [one, two, three] and waiting._paused_event_queue is NO_EVENTS


def test_a_layer_that_is_not_paused_handles_at_once():
    waiting = Waiting(_context(), None)
    event = events.DataReceived(waiting.context.client, b"x")
    list(waiting.handle_event(event))
    assert waiting.seen == [event] and waiting._paused_event_queue is NO_EVENTS


def _mitmproxy_function(name: str) -> str:
    source = inspect.getsource(inspect.getmodule(layer.Layer))
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "Layer":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return ast.get_source_segment(source, f)
    raise AssertionError(name)


def test_the_copy_is_of_this_mitmproxy_s_handle_event():
    assert hashlib.sha256(_mitmproxy_function("handle_event").encode()).hexdigest() == MITMPROXY_HANDLE_EVENT, (
        "mitmproxy's Layer.handle_event changed: copy it into addons/layer_memory.py again, then update the hash")
