"""A connection's timers are event-loop timers, not tasks that sleep.

mitmproxy 12.3 keeps two kinds of timer per connection, each a task asleep in `asyncio.sleep`: the
client's inactivity watchdog (`TimeoutWatchdog.watch`, for `tcp_timeout`, for the connection's whole
life) and every `RequestWakeup` a layer asks for (`ConnectionHandler.wakeup`: the gateway's body-idle
deadline of an open stream, a head's deadline, HTTP/2 pings). A sleeping task is a Task with its
debug attributes, two coroutines, a Future, a timer handle and a weak reference, and the watchdog
adds an asyncio.Event with its own 760-byte deque of waiters: ~3.5 KB for every open stream, most
of it to wait (bench/tunnel_memory.py --sse --details; docs/performance.md, "Memory per open SSE
stream"). Here each is one `loop.call_later` handle:

- `TimerWatchdog` takes TimeoutWatchdog's place (same attributes and methods). `watch()` arms the
  timer and returns at once. When the timer runs out it looks again: disarmed (a hook under way) it
  looks a full timeout later, active since it looks when the rest has run out, else the connection
  is closed by mitmproxy's own `on_timeout`, as before. The timer is put among the handler's
  `wakeup_timer`, all of which mitmproxy cancels when the client handler ends (the watchdog task
  was cancelled at that same point).
- `wakeup` (mitmproxy's, with the sandbox's turn before the event, addons/fair_share.py): the task
  mitmproxy makes for it gives its place in `wakeup_timer` to a `_Wakeup` timer and ends after one
  step of the loop (mitmproxy adds the task to the set only once it has made it, and its tasks run
  eagerly: a task ended at once would stay in the set). When the timer runs out, a task takes the
  turn and hands the `Wakeup` event on, in the set meanwhile, so that a close still cancels it
  before the event: no Wakeup after a close. A wakeup due at once (delay 0: a body's parse cut at
  its slice goes on at the next step) is handed on by its own task, as before, not one step later.

- `handle_client` (mitmproxy's, 12.3) arms the watchdog in place, where mitmproxy made a task for
  it (a task done at once, kept by the handler for the connection's life), and waits for the
  client's reader on one Future its end resolves, where `asyncio.wait` kept two coroutines, a
  Future, a set and a closure for as long (~1.1 KB per open connection together). What raises in
  it fails the connection closed (addons/crash_close.py), and the connection still ends as
  mitmproxy ends it: mitmproxy let the error end the task, with no audit line, and a disconnect
  hook that raised left the upstreams open (review 50). The rest is mitmproxy's, statement for
  statement (tests/unit/test_conn_timers.py compares them).

A timer's callback runs in the context of the task that armed it, so the loop time of what it does
is charged to the connection's sandbox like any other (addons/fair_share.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import contextmanager

from mitmproxy.proxy import events, server, server_hooks
from mitmproxy.utils import asyncio_utils

from . import crash_close


class TimerWatchdog:
    """mitmproxy's TimeoutWatchdog (12.3) as one loop timer."""

    __slots__ = ("timeout", "callback", "last_activity", "blocker", "_handle", "_loop", "_timers")

    def __init__(self, timeout: float, callback) -> None:
        self.timeout = timeout
        self.callback = callback  # the handler's on_timeout
        self.last_activity = time.time()
        self.blocker = 0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: set | None = None

    def register_activity(self) -> None:
        self.last_activity = time.time()

    async def watch(self) -> None:
        """Arm the timer among the handler's timers (cancelled with them when the client handler ends)."""
        self._loop = asyncio.get_running_loop()
        handler = getattr(self.callback, "__self__", None)
        self._timers = getattr(handler, "wakeup_timer", None)
        if self._timers is not None:
            self._timers.add(self)
        self._arm(self.timeout - (time.time() - self.last_activity))

    def _arm(self, delay: float) -> None:
        self._handle = self._loop.call_later(max(delay, 0.0), self._check)

    def _check(self) -> None:
        self._handle = None
        if self.blocker:  # a hook under way: the end of the disarm counts as activity
            self._arm(self.timeout)
            return
        left = self.last_activity + self.timeout - time.time()
        if left >= 0:
            self._arm(left)
            return
        if self._timers is not None:
            self._timers.discard(self)
        asyncio.ensure_future(self.callback())

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @contextmanager
    def disarm(self):
        self.blocker += 1
        try:
            yield
        finally:
            self.blocker -= 1
            if self.blocker == 0:
                self.register_activity()


class _Wakeup:
    """One RequestWakeup's timer, in its handler's `wakeup_timer` until its event is handed on."""

    __slots__ = ("handler", "request", "handle", "task")

    def __init__(self, handler, request, when: float) -> None:
        self.handler = handler
        self.request = request
        self.task: asyncio.Task | None = None
        self.handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle = None  # (the handle refers to this object: no cycle left behind)
        self.task = asyncio.ensure_future(_hand_on(self.handler, self.request, self))
        crash_close.watch(self.handler, self.task)  # (a turn that raises fails the connection closed)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if self.task is not None:
            self.task.cancel()
            self.task = None


async def _hand_on(handler, request, marker) -> None:
    """The sandbox's turn, then the Wakeup event. `marker` (the timer, or the task itself) stays in
    `wakeup_timer` until the turn is over: a close meanwhile cancels it, no Wakeup after the close."""
    try:
        turn = getattr(handler, "egress_turn", None)  # the sandbox's turn (addons/fair_share.py), if installed
        if turn is not None:
            await turn()
    finally:
        handler.wakeup_timer.discard(marker)
        if isinstance(marker, _Wakeup):
            marker.task = None  # (whatever ended the turn: no cycle through the task left behind)
    await handler.server_event(events.Wakeup(request))


async def timer_wakeup(self, request) -> None:
    """mitmproxy's wakeup (12.3): the task gives its place in `wakeup_timer` to a timer and ends; a
    wakeup already due (delay 0: a parse continued at the next step) is handed on from the task."""
    when = asyncio.get_running_loop().time() + request.delay
    await asyncio.sleep(0)  # (mitmproxy adds this task to wakeup_timer once it has made it)
    task = asyncio.current_task()
    if request.delay <= 0:
        await _hand_on(self, request, task)
        return
    self.wakeup_timer.discard(task)
    self.wakeup_timer.add(_Wakeup(self, request, when))


def _resolve(waiter: asyncio.Future, _task) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _ended(task: asyncio.Task) -> asyncio.Future:
    """A Future done when `task` is: what `asyncio.wait([task])` waits for, without its coroutines.
    Cancelling the waiter (the client handler cancelled) leaves the task running, as wait does."""
    waiter = task.get_loop().create_future()
    task.add_done_callback(functools.partial(_resolve, waiter))
    return waiter


async def handle_client(self) -> None:
    """mitmproxy's ConnectionHandler.handle_client (12.3): the watchdog armed in place, the client's
    reader awaited on one Future (see the module docstring)."""
    asyncio_utils.set_current_task_debug_info(
        name=f"client handler",
        client=self.client.peername,
    )
    await self.timeout_watchdog.watch()  # (arms its timer and returns)

    self.log("client connect")
    try:
        await self.handle_hook(server_hooks.ClientConnectedHook(self.client))
        if self.client.error:
            self.log("client kill connection")
            writer = self.transports.pop(self.client).writer
            assert writer
            writer.close()
        else:
            await self.server_event(events.Start())
            handler = asyncio_utils.create_task(
                self.handle_connection(self.client),
                name=f"client connection handler",
                keep_ref=False,
                client=self.client.peername,
            )
            self.transports[self.client].handler = handler
            await _ended(handler)
            if not handler.cancelled() and (e := handler.exception()):
                self.log(
                    f"connection handler has crashed: {e}",
                    logging.ERROR,
                    exc_info=(type(e), e, e.__traceback__),
                )
    except Exception as exc:  # the connection fails closed, and still ends as below (addons/crash_close.py)
        crash_close.fail(self, exc)

    while self.wakeup_timer:
        timer = self.wakeup_timer.pop()
        timer.cancel()

    self.log("client disconnect")
    self.client.timestamp_end = time.time()
    try:
        await self.handle_hook(server_hooks.ClientDisconnectedHook(self.client))
    except Exception as exc:  # (the transports below are still closed)
        crash_close.fail(self, exc)

    if self.transports:
        self.log("closing transports...", logging.DEBUG)
        for io in self.transports.values():
            if io.handler:
                io.handler.cancel("client disconnected")
        await asyncio.wait(
            [x.handler for x in self.transports.values() if x.handler]
        )
        self.log("transports closed!", logging.DEBUG)


def install() -> None:
    if server.TimeoutWatchdog is TimerWatchdog:
        return
    server.TimeoutWatchdog = TimerWatchdog
    server.ConnectionHandler.wakeup = timer_wakeup
    if server.ConnectionHandler.handle_client.__module__ == server.__name__:
        # (wrapped already, by addons/fair_share.py in a process that made it first: left as it is,
        # mitmproxy's own with its watchdog task, which TimerWatchdog.watch serves as well)
        server.ConnectionHandler.handle_client = handle_client
