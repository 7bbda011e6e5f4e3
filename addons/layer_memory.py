"""mitmproxy's layers make their queue of paused events only when they first queue one.

Every mitmproxy `Layer` made a `collections.deque()` in its constructor for the events that arrive
while it waits for a reply (a blocking hook, an upstream connection being opened). CPython gives a
deque its first block of 64 slots at once: 760 bytes, for a queue that is empty nearly always, and
an intercepted tunnel keeps ~18 layers (connection, TLS, HTTP, stream and next-layer layers, both
sides): 13-14 KiB of every idle tunnel (bench/tunnel_memory.py --details; docs/performance.md,
"Memory per idle tunnel").

Here a layer starts with NO_EVENTS, one empty queue shared by every layer, which refuses to be
written to (a write to it would hand one connection's events to another: it raises instead, and
the connection fails closed), and gets a deque of its own where mitmproxy's `handle_event` queues
its first event. Every reader of the queue (mitmproxy's `__continue` and HttpStream's
`check_killed`, addons/read_ahead.py, addons/http_stream.py) only tests, iterates or pops it when it
is not empty, and sees the shared one as the empty deque it used to be.

A queue that has been replayed to the end goes back to NO_EVENTS: a layer that was paused once
(every stream and HTTP layer waits for its hooks, a TLS layer for its upstream connection) kept its
empty deque, 760 bytes, for the rest of the connection; an open SSE stream kept ~2.3 of them
(docs/performance.md, "Memory per open SSE stream"). The next event queued makes a new one.

Two wrappers, tabled in addons/patches.py: `Layer.__init__` (mitmproxy's, then the shared queue in
place of the new one) and `Layer.handle_event` (mitmproxy 12.3's, with the queue made on its first
append and let go once replayed empty; nothing else in it changed).
"""

from __future__ import annotations

import collections

from mitmproxy.proxy import commands, events
from mitmproxy.proxy import layer as layer_module

from .empty_deque import SharedEmptyDeque


NO_EVENTS = SharedEmptyDeque()  # the paused-event queue of every layer that has none queued


def install() -> None:
    Layer = layer_module.Layer
    if getattr(Layer.handle_event, "_egress_lazy_queue", False):
        return
    init = Layer.__init__

    def __init__(self, context) -> None:
        init(self, context)
        self._paused_event_queue = NO_EVENTS

    def handle_event(self, event: events.Event):
        """mitmproxy 12.3's Layer.handle_event; only the queueing of an event while paused differs."""
        if self._paused:
            # did we just receive the reply we were waiting for?
            pause_finished = (
                isinstance(event, events.CommandCompleted)
                and event.command is self._paused.command
            )
            if self.debug is not None:
                yield self._Layer__debug(f"{'>>' if pause_finished else '>!'} {event}")
            if pause_finished:
                assert isinstance(event, events.CommandCompleted)
                yield from self._Layer__continue(event)
                if not self._paused_event_queue:
                    self._paused_event_queue = NO_EVENTS  # drained: its block goes (the module's docstring)
            else:
                queue = self._paused_event_queue
                if queue is NO_EVENTS:
                    queue = self._paused_event_queue = collections.deque()
                queue.append(event)
        else:
            if self.debug is not None:
                yield self._Layer__debug(f">> {event}")
            command_generator = self._handle_event(event)
            send = None

            # inlined copy of __process to reduce call stack (as mitmproxy's).
            try:
                command = command_generator.send(send)
            except StopIteration:
                return

            while True:
                if self.debug is not None:
                    if not isinstance(command, commands.Log):
                        yield self._Layer__debug(f"<< {command}")
                if command.blocking is True:
                    # Only this layer blocks; outer layers check for `is True`.
                    command.blocking = self
                    self._paused = layer_module.Paused(
                        command,
                        command_generator,
                    )
                    yield command
                    return
                else:
                    yield command
                    try:
                        command = next(command_generator)
                    except StopIteration:
                        return

    handle_event._egress_lazy_queue = True
    Layer.__init__ = __init__
    Layer.handle_event = handle_event
