"""Each sandbox's share of a worker's event loop (gateway/fairshare.py `LoopShare`), enforced by
making its connections wait for their turns.

What a sandbox is charged: the time of every callback the event loop runs for one of its
connections (asyncio.Handle._run, timed; a connection's handler marks its task's context, and the
tasks it starts, for its connections and its hooks, inherit the mark). That is all of it, measured
where it runs: TLS, HTTP/1 and HTTP/2 parsing, WebSocket framing, the layers, every addon's
decision, audit and metrics work, and nothing while a hook awaits (a DNS answer costs the loop
nothing, and the work of others that runs meanwhile is theirs), nor a garbage collection that
happens to run inside its callback (`_not_charged`). The cost: two clock reads per
callback. The time is summed on the handler and charged at its next turn.

A turn (`turn`) comes before each read of one of its connections is handled (addons/conn_close.py's
read loop), before each blocking hook (the requests a client pipelined, or opened as HTTP/2
streams, go on from hook to hook with no read in between) and before each timer's event
(addons/conn_timers.py). It waits for its slot (`LoopShare.reserve`) while the sandbox is over its
share on a contended loop, and, over its share whether contended or not, yields while a sandbox
within its share is being served.
Its sockets' buffers fill and TCP slows it down; nothing is refused, and a sandbox alone on a
worker, or next to an idle loop, is never slowed.

Between turns, the order of the loop's ready callbacks (gateway/fairshare.py `ReadyOrder`): while
a lighter sandbox is being served, a heavier one's callback is set aside while a lighter one's waits
in it (kept per sandbox in order; at each poll the oldest few go back to the front of the ready
queue, ahead of all made since: `_SetAside`), and at most a millisecond of such work runs between
two polls for I/O. Each sandbox's own callbacks keep their order, and each sandbox has one load for
all its connections (noted at turns).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import selectors
import contextvars
import itertools
import logging
import time
from dataclasses import dataclass

from asyncio import selector_events

from mitmproxy import ctx, exceptions
from mitmproxy.proxy import commands

from gateway.fairshare import MAX_WAIT, LoopShare, ReadyOrder, yields_to

from . import accept_gate, crash_close
from .options import declare

ATTR = "_egress_share_key"
_step = [0.0]  # when the loop's current callback began, or was last charged (one callback at a time)
_began = [0.0]  # when the loop's current callback began
_gc_began = [0.0]  # when the garbage collection under way began (0: none)
# A connection's reader goes on to its next read in the same step of the loop while its stream has
# bytes buffered (StreamReader.read does not yield then): 256 KiB the transport read at once, four
# of mitmproxy's reads, each parsed and decided. Past this much of a step it yields first, so that
# what other connections wait for is a slice, not everything one client sent.
STEP_SLICE = 0.002
# The loop counts as contended for a sandbox in debt also while another sandbox within its share
# is being served (a callback of it ended within PRIORITY_WINDOW), whatever the load averaged over
# the last second says: under that average nothing slowed a flood, which then ran unslowed for a
# few hundred ms at a time, one of its ~2.5 ms requests between every two of a neighbour's ~45
# callbacks (the neighbour's request: 25 ms, then two of 220 ms, every 0.75 s). The indebted turn
# then waits for its slot on a timer, like any other: a first version that held it spinning for as
# long as the lighter one stayed busy let a sandbox sending one byte a millisecond cut a legitimate
# upload to a quarter (a fresh-eyes review), and 400 spinning connections filled every loop step.
PRIORITY_WINDOW = 0.002
# The bytes one read of a connection takes (addons/conn_close.py): mitmproxy's 64 KiB, or, while the
# connection's sandbox gives way to a lighter one (ReadyOrder.yielding), one TLS record's worth. A
# read is handled in one piece of work nothing can cut: 64 KiB of HEADERS+RST_STREAM pairs took
# 6 ms on average and up to 15 ms, between a neighbour's every two callbacks (rapid reset).
FULL_READ = 65535
YIELDING_READ = 16384
# How far into the loop's ready queue (asyncio's own deque, BaseEventLoop._ready) a yielding
# callback looks for a lighter sandbox's (ReadyOrder): the queue is only read, and the callback, if
# it waits, goes back to its end.
READY_SCAN = 64
_order = ReadyOrder()
_ACCEPT = accept_gate.ACCEPT_CALLBACKS  # the listening socket's callback (asyncio's, or the gated one)
_SETUP_CODE: list = [None]  # the code of keyed_accept_connection (install)
_light: list = [-1.0, None]  # when a callback of a sandbox within its share last ended, and that sandbox
_serving: contextvars.ContextVar = contextvars.ContextVar("egress_serving", default=None)  # a _Serving


class _Serving:
    """The ConnectionHandler a context serves, in a holder emptied when its client is gone. Every
    callback asyncio schedules keeps the context it was made in, a cancelled timer too, until its
    time comes (mitmproxy's 600 s idle watchdog): holding the handler itself there kept a closed
    connection's every layer and flow, and the bodies they held, alive (33 MiB per 18 MB bound
    response, a review's probe; gc could not free it)."""

    __slots__ = ("handler",)

    def __init__(self, handler):
        self.handler = handler


class _Accepted:
    """A connection being accepted and set up, before mitmproxy has a handler for it: its sandbox
    is known from its peer address, so that its setup is ordered as its sandbox's. As no sandbox's
    work, a flood of connections reset before their handler knew them went ahead of every heavier
    sandbox (a review: a neighbour's p99 ~2x worse under it). Its time is the sandbox's too: what it
    spent goes to the handler once there is one (`adopt`), and what its callbacks spend after that
    (the rest of the callback that made the handler) straight to it. Uncharged, a connection's setup
    (~0.8 ms under load: transport, protocol, mitmproxy's handler and its first hooks) hid ~14% of
    the loop from the loads of four sandboxes opening 90 connections at once (stop 44)."""

    __slots__ = ("_egress_share_key", "_spent", "_egress_light", "owner")

    def __init__(self, key: str):
        self._egress_share_key, self._spent, self._egress_light, self.owner = key, 0.0, False, None

    @property
    def _egress_spent(self) -> float:
        return self.owner._egress_spent if self.owner is not None else self._spent

    @_egress_spent.setter
    def _egress_spent(self, value: float) -> None:
        if self.owner is not None:
            self.owner._egress_spent = value
        else:
            self._spent = value


def adopt(handler, accepted) -> None:
    """The handler made for an accepted connection takes over its setup's time (charged at its
    next turn), and what the setup's callbacks still spend."""
    if isinstance(accepted, _Accepted) and accepted.owner is None:
        handler._egress_spent += accepted._spent
        accepted._spent, accepted.owner = 0.0, handler


def disown(accepted) -> None:
    """At the handler's end: the setup's holder no longer names it (a cancelled timer keeps its
    context until its time; through it, a closed connection's layers were kept alive)."""
    if isinstance(accepted, _Accepted):
        accepted.owner = None


def _accepted(extra) -> _Accepted | None:
    try:
        if _state is not None:
            return _Accepted(_state.sandbox_key_of_peer((extra or {}).get("peername")))
    except Exception:  # (no policy yet, an odd address): the setup is then no sandbox's
        pass
    return None


def serve(handler) -> _Serving:
    """Mark the running context (and every task it starts) as serving `handler`."""
    holder = _Serving(handler)
    _serving.set(holder)
    return holder


def serving(context: contextvars.Context | None = None):
    """The handler the running context (or `context`) serves, or None."""
    holder = context.get(_serving) if context is not None else _serving.get()
    return holder.handler if holder is not None else None

_share = LoopShare()
_state = None  # the gateway's GatewayState (install)
# How long one parse of what a connection read (an upstream's chunked body, HTTP/2 frames) may run
# in one step while its sandbox gives way to a lighter one: each step of a neighbour waits for the
# callback running when it became ready, and a sandbox whose upstream sends 1-byte chunks on 8
# connections made every callback a ~1 ms slice (review 33: the neighbour's p99 2.7-3x).
YIELDING_PARSE_SLICE = 0.00025


def parse_slice(default: float) -> float:
    """The parse slice for the connection being served now: `default`, or YIELDING_PARSE_SLICE
    while its sandbox gives way to a lighter one (addons/http1.py, addons/h2_limits.py)."""
    handler = serving()
    key = getattr(handler, ATTR, None) if handler is not None else None
    if key is None or not _order.yielding(key, _share.noted_load(key), time.perf_counter()):
        return default
    return min(default, YIELDING_PARSE_SLICE)


def _key(handler) -> str | None:
    """The handler's sandbox, once its client is known to the gateway (cached on the handler)."""
    key = getattr(handler, ATTR, None)
    if key is None and _state is not None:
        conn = _state.connections.get(handler.client.id)
        if conn is not None:
            key = _state.sandbox_key(conn)
            setattr(handler, ATTR, key)
    return key


def _known_key(handler) -> str | None:
    """`_key`, for a handler seen in the ready queue (None, never an error: the order must not
    break the loop it orders)."""
    try:
        return _key(handler)
    except Exception:
        return None


def _lighter_served(key: str) -> bool:
    """Whether another sandbox, within its share, was being served in the last PRIORITY_WINDOW
    (the last such callback: a sandbox never yields to its own connections)."""
    return _light[1] != key and time.perf_counter() - _light[0] < PRIORITY_WINDOW


def _setting_up(handle) -> bool:
    """Whether a ready callback for no sandbox is the loop accepting a connection: the listening
    socket's accept, or the first step of the setup task it starts (`keyed_accept_connection`,
    before it marks its context). Only these go before a heavier sandbox's work: the rest of what
    runs for no sandbox (a decode thread's completion, in the empty context a thread gives it;
    the callbacks of a connection already closed; the gateway's timers) went first too, uncharged
    and unbounded but by MAX_SET_ASIDE, the heavy sandbox's own decodes among them (a review)."""
    callback = handle._callback
    if getattr(callback, "__func__", None) in _ACCEPT:
        return True
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        return getattr(coro, "cr_code", None) is _SETUP_CODE[0]
    return False


def _is_accept(handle) -> bool:
    """Whether a selector's reader callback is a listening socket's accept (not cancelled)."""
    return (handle is not None and not handle._cancelled
            and getattr(handle._callback, "__func__", None) in _ACCEPT)


def _lighter_ready(ready, handler, key, load: float) -> bool:
    """Whether a callback that `handler`'s sandbox (`key`, at `load`) yields to is in the loop's
    ready queue: one of a lighter sandbox, of a connection whose sandbox is not known yet, or of
    the loop accepting a connection (`_setting_up`; the setup then counts as its peer's sandbox's,
    `_Accepted`). Before, a new connection's every setup step (about four callbacks) waited behind
    the flood's ready work, and a neighbour's fresh request spent 8.7 ms (1.8 ms alone) before its
    first callback of its own.

    Another thread may append to the queue meanwhile (mitmproxy_rs's UDP receiver and the decode
    pool hand their work over with call_soon_threadsafe), and a deque changed during iteration
    raises: that escaped the loop and killed the worker (review 36: a UDP flood of DNS queries, 3
    runs of 4). Then no lighter one counts as found, and the callback runs."""
    try:
        return _scan_lighter(ready, key, load)
    except RuntimeError:  # (deque mutated during iteration)
        return False


def _scan_lighter(ready, key, load: float) -> bool:
    for other in itertools.islice(ready, READY_SCAN):
        if other._cancelled:
            continue
        holder = other._context.get(_serving) if other._context is not None else None
        if holder is None:
            if _setting_up(other):
                return True
            continue
        served = holder.handler
        if served is None:
            continue  # a connection already closed: nobody's turn
        other_key = getattr(served, ATTR, None) or _known_key(served)
        if other_key is None:
            return True  # a handler whose client is not known yet
        if other_key != key:
            other_load = _share.noted_load(other_key)
            if other_load >= 0 and yields_to(load, other_load, _order.heavy):
                return True
    return False


DEFERRED = "_egress_deferred"  # a selector loop's `_SetAside`: callbacks set aside (`_defer`)
# Of a sandbox's callbacks set aside, how many go back to the ready queue at a poll: as many as a
# waiting sandbox's first callback looks at for a lighter one's (READY_SCAN), so that a poll's first
# callbacks are the waiting sandbox's, as when all of them were put back. (256 measured no better:
# the neighbour's p50 151 against 105 ms, one run each, same hour.)
PUT_BACK_PER_SANDBOX = READY_SCAN


def _next_poll() -> None:
    """A ready callback that does nothing: with callbacks set aside, the loop polls at once."""


def _key_of(handle):
    """The sandbox a ready callback serves (None: no sandbox's, or not known yet)."""
    holder = handle._context.get(_serving) if handle._context is not None else None
    handler = holder.handler if holder is not None else None
    return getattr(handler, ATTR, None) if handler is not None else None


class _SetAside:
    """A selector loop's callbacks set aside, per sandbox in the order they were made; at each poll
    the oldest PUT_BACK_PER_SANDBOX of each sandbox go back to the front of the ready queue
    (`put_back`), ahead of everything made ready since. Those that must wait again go back to the
    front of their sandbox's queue, and a callback made ready while its sandbox has some set aside
    waits behind them (`behind`): each sandbox's callbacks still run in the order they were made.

    Before, every callback set aside went back at every poll and was set aside again one by one: a
    flood of ~1,000 connections had hundreds waiting, re-queued and re-deferred at each poll (a
    quarter of the worker's CPU), and each neighbour's callback queued behind all of them."""

    __slots__ = ("queues", "again", "ids", "batch", "batch_ids", "poll_pending", "quota", "sent")

    def __init__(self) -> None:
        self.queues: dict = {}  # sandbox -> deque of its callbacks set aside, oldest first
        self.again: dict = {}  # sandbox -> those put back at the last poll and set aside again (older)
        self.quota: dict = {}  # sandbox -> how many of its go back at the next poll (`_quota`)
        self.sent: dict = {}  # sandbox -> how many of its went back at the last poll
        self.ids: set[int] = set()  # ids of every callback in `queues` and `again` (each set aside once)
        self.batch: list = []  # what the last poll put back (held: their ids stay theirs until the next)
        self.batch_ids: set[int] = set()
        self.poll_pending = False  # a `_next_poll` is in the ready queue

    def add(self, handle, key) -> bool:
        """Set `handle` aside; False if it is already (a socket's reader, made ready again by a poll)."""
        handle_id = id(handle)
        if handle_id in self.ids:
            return False
        self.ids.add(handle_id)
        if handle_id in self.batch_ids or isinstance(handle, asyncio.TimerHandle):
            self.again.setdefault(key, []).append(handle)
        else:
            queue = self.queues.get(key)
            if queue is None:
                queue = self.queues[key] = collections.deque()
            queue.append(handle)
        return True

    def behind(self, handle, key) -> bool:
        """Whether `handle`, of sandbox `key`, must wait behind callbacks of its sandbox set aside."""
        return ((key in self.queues or key in self.again) and id(handle) not in self.batch_ids
                and not isinstance(handle, asyncio.TimerHandle))

    def put_back(self, ready) -> None:
        """At a poll: the oldest of each sandbox's callbacks back at the front of `ready`."""
        for key, sent in self.sent.items():
            self.quota[key] = _quota(self.quota.get(key, PUT_BACK_PER_SANDBOX), sent, len(self.again.get(key, ())))
        self.sent.clear()
        for key, again in self.again.items():
            queue = self.queues.get(key)
            if queue is None:
                queue = self.queues[key] = collections.deque()
            queue.extendleft(reversed(again))
        self.again.clear()
        back = []
        for key in list(self.queues):
            queue = self.queues[key]
            count = min(self.quota.get(key, PUT_BACK_PER_SANDBOX), len(queue))
            self.sent[key] = count
            for _ in range(count):
                handle = queue.popleft()
                self.ids.discard(id(handle))
                back.append(handle)
            if not queue:
                del self.queues[key]
                self.quota.pop(key, None)  # (its next wait starts from the full put-back)
        ready.extendleft(reversed(back))
        self.batch = back
        self.batch_ids = {id(handle) for handle in back}


def _quota(quota: int, sent: int, waited: int) -> int:
    """How many of a sandbox's callbacks set aside go back at the next poll: as many as ran of
    those put back at the last one, plus one, or twice as many if none waited again (at most
    PUT_BACK_PER_SANDBOX). Each one put back that waits again costs a look and a requeue: with 50
    connections a sandbox had 64 put back at each poll to run one or two (review 33: ~35,000
    requeues a second, a third of the loop, and the neighbour's p99 ~5x)."""
    if waited:
        return max(1, sent - waited + 1)
    return quota if sent < quota else min(PUT_BACK_PER_SANDBOX, 2 * quota)  # (sent < quota: no more were there)


def _set_aside(loop) -> _SetAside:
    aside = loop.__dict__.get(DEFERRED)
    if aside is None:
        aside = loop.__dict__[DEFERRED] = _SetAside()
    return aside


def _defer(handle, key=None) -> None:
    """Set a callback aside until a later poll, where it goes back to the front of the ready queue
    (`counted_process_events`), ahead of everything made ready since. Appended to the queue's end
    instead, it ran after callbacks its own sandbox's earlier ones had made meanwhile: one
    connection's callbacks out of order (a review)."""
    loop = handle._loop
    aside = _set_aside(loop)
    if aside.add(handle, _key_of(handle) if key is None else key) and not aside.poll_pending:
        aside.poll_pending = True
        loop.call_soon(_next_poll)  # (in the loop's own context: never set aside itself)


def _without_queued_readers(event_list, aside_ids, queued_ids):
    """The poll's events, less the reads and writes whose callback is set aside or already back in
    the ready queue: a socket whose reader waited is reported readable at every poll until it is
    read, and a socket whose connect completed writable at every poll until the connect's done
    callback removes its writer (`BaseSelectorEventLoop._sock_connect_cb`); each report queued the
    same callback once more (a flood's upstream connects ran ~13,000 writers a second that had
    nothing left to do, and every one of its requests stalled)."""
    if not aside_ids and not queued_ids:
        return event_list
    kept = []
    for key, mask in event_list:
        if key.data:
            reader, writer = key.data
            if mask & selectors.EVENT_READ and reader is not None and (
                    id(reader) in aside_ids or id(reader) in queued_ids):
                mask &= ~selectors.EVENT_READ
            if mask & selectors.EVENT_WRITE and writer is not None and (
                    id(writer) in aside_ids or id(writer) in queued_ids):
                mask &= ~selectors.EVENT_WRITE
            if not mask:
                continue
        kept.append((key, mask))
    return kept


def _client_transport(handler):
    io = handler.transports.get(handler.client)
    writer = getattr(io, "writer", None) if io is not None else None
    return getattr(writer, "transport", None)  # (None: a mitmproxy_rs stream, transparent mode)


def _mark_reader(handler) -> None:
    """asyncio made the client socket's read callback when it accepted the connection, in the
    server's context: every read of the socket (one per TCP segment a client trickles) then ran
    uncharged, and 400 connections sending two bytes at a time took the whole loop that way. Made
    again here, in the handler's marked context, it is timed and charged like the rest."""
    transport = _client_transport(handler)
    try:
        if transport is not None and transport.is_reading():
            transport.pause_reading()
            transport.resume_reading()
    except Exception:  # a transport being torn down: its reads are over anyway
        pass


def _pause(handler):
    """Stop reading the client socket while its sandbox waits for its turn (the kernel's buffers
    fill and TCP slows the sandbox down); the transport, to resume, or None."""
    transport = _client_transport(handler)
    try:
        if transport is not None and transport.is_reading():
            transport.pause_reading()
            return transport
    except Exception:
        pass
    return None


def _resume(transport) -> None:
    try:
        if not transport.is_closing():
            transport.resume_reading()
    except Exception:
        pass


def _charge(handler, seconds: float) -> None:
    try:
        key = _key(handler)
        if key is not None:
            _share.charge(key, seconds)
    except Exception:  # accounting must never break the connection it accounts for
        logging.getLogger("egress").exception("egress gateway: loop-share accounting failed")


def current_key():
    """The sandbox of the connection the running task serves (None: not a proxy connection's task,
    or its sandbox not known yet)."""
    handler = serving()
    return _key(handler) if handler is not None else None


def charge_key(key, seconds: float) -> None:
    """Charge work done for a sandbox off the loop (addons/decode_pool.py: a decode on a pool
    thread) to it, as if the loop had done it."""
    try:
        if seconds > 0:
            _share.charge(key, seconds)
    except Exception:  # accounting must never break the connection it accounts for
        logging.getLogger("egress").exception("egress gateway: loop-share accounting failed")


async def current_turn() -> None:
    """The running task's sandbox's turn (a plain yield outside a proxy connection's task)."""
    handler = serving()
    if handler is not None and hasattr(handler, "egress_turn"):
        await handler.egress_turn()
    else:
        await asyncio.sleep(0)


def active() -> int:
    """Sandboxes active on this worker's loop now (the metrics' heartbeat reads it, on the loop)."""
    return _share.active()


def _waited(key: str, seconds: float) -> None:
    sandbox = key.removeprefix("sandbox:") if key.startswith("sandbox:") else None
    for listener in list(_state.wait_listeners if _state is not None else ()):
        try:
            listener(sandbox, seconds)
        except Exception:  # a metrics bug must not break the connection
            logging.getLogger("egress").exception("egress gateway: a loop-share listener failed")


def _not_charged(phase: str, info: dict) -> None:
    """gc callback: a collection's time is nobody's. It runs inside whatever callback happened to
    allocate (or a thaw's), and was charged to that callback's sandbox: a 100-300 ms thaw made a
    neighbour timing one request every 0.1 s "heavy" (its load over the last 0.1 s 0.4-0.8), so it
    gave way to the very sandboxes whose connections made the garbage (four sandboxes each opening
    90 connections at once; stop 44). The charge window moves past it."""
    if phase == "start":
        _gc_began[0] = time.perf_counter()
    elif _gc_began[0]:
        _step[0] += time.perf_counter() - _gc_began[0]
        _gc_began[0] = 0.0


def install(state) -> None:
    """Time every callback the event loop runs and charge it to the sandbox whose connection it
    serves, and make that sandbox's reads wait while it is over its share."""
    global _state
    _state = state
    from mitmproxy.proxy import events, server

    handler_class = server.ConnectionHandler
    if getattr(handler_class.handle_client, "_egress_share", False):
        return
    handle_client, run = handler_class.handle_client, asyncio.Handle._run
    process_events = selector_events.BaseSelectorEventLoop._process_events
    accept_connection = selector_events.BaseSelectorEventLoop._accept_connection2

    async def keyed_accept_connection(self, protocol_factory, conn, extra, *args, **kwargs):
        """asyncio's setup of an accepted connection, in a context marked with the sandbox its
        peer address names (every callback the setup makes, until the handler's own mark)."""
        accepted = _accepted(extra)
        if accepted is not None:
            _serving.set(_Serving(accepted))
            # Its sandbox is being served from its accept on: a heavier one yields to it now, not
            # once the setup's steps have each waited behind all of that one's ready work (review
            # 34: a sandbox's first request after an idle spell waited 180-300 ms to be set up).
            key = accepted._egress_share_key
            _order.ran(key, max(_share.noted_load(key), 0.0), perf_counter(), 0.0, False)
        return await accept_connection(self, protocol_factory, conn, extra, *args, **kwargs)

    _SETUP_CODE[0] = keyed_accept_connection.__code__

    async def marked_handle_client(self) -> None:
        accepted = serving()  # its setup's (_Accepted), if the connection was accepted here
        holder = serve(self)  # this task's context, and every task it starts (connections, hooks)
        try:
            adopt(self, accepted)
            _mark_reader(self)
        except Exception as exc:  # the connection fails closed, and still ends as it ends (review 50)
            crash_close.fail(self, exc)
        try:
            await handle_client(self)
        finally:
            holder.handler = None
            disown(accepted)

    def timed_run(self) -> None:
        holder = self._context.get(_serving)
        handler = holder.handler if holder is not None else None
        if handler is None:
            return run(self)
        key = getattr(handler, ATTR, None)
        if key is not None and isinstance(self._loop, selector_events.BaseSelectorEventLoop) and (
                _order.held(key) or ((aside := self._loop.__dict__.get(DEFERRED)) is not None
                                     and aside.behind(self, key))):
            # Once one of its callbacks waited, each of the sandbox's later ones waits too, until
            # the next poll, and behind those still set aside: decided first, as cheaply as possible.
            _order.waits(key, perf_counter())
            _defer(self, key)
            return None
        load = _share.noted_load(key) if key is not None else -1.0
        _step[0] = _began[0] = perf_counter()
        yielding = _order.yielding(key, load, _step[0])
        if key is not None and isinstance(self._loop, selector_events.BaseSelectorEventLoop) and (
                _order.held(key) or (yielding and not _order.overdue(key, _step[0]) and (
                    _order.sliced() or _lighter_ready(self._loop._ready, handler, key, load)))):
            _order.waits(key, _step[0])
            _defer(self, key)
            return None
        try:
            return run(self)
        finally:
            now = perf_counter()
            spent = now - _step[0]
            handler._egress_spent += spent  # charged at its next read (cheap here)
            if handler._egress_light:
                _light[0], _light[1] = now, getattr(handler, ATTR, None)
            _order.ran(key, load, now, spent, yielding)

    def counted_process_events(self, event_list) -> None:
        _order.polled()  # (every step of a selector loop polls, with no wait while callbacks are ready)
        aside = self.__dict__.get(DEFERRED)
        if aside is not None and (aside.ids or aside.batch):
            # The oldest of each sandbox's back at the front: before all that was made ready since.
            aside.poll_pending = False
            aside.put_back(self._ready)
            event_list = _without_queued_readers(event_list, aside.ids, aside.batch_ids)
            if aside.ids:  # more to put back at the next poll, which must not wait for I/O
                # The marker must be in the ready queue at the next poll: queued from here it ran in
                # this very step (asyncio counts the ready callbacks after the poll's events), and
                # once all that was put back waited again the loop slept in select() until some
                # unrelated event (review 28: up to the 1 s heartbeat, 6.6-13.5 s of 30).
                aside.poll_pending = True
                self.call_soon(self.call_soon, _next_poll)
        accepts = [key.data[0] for key, mask in event_list
                   if mask & selectors.EVENT_READ and _is_accept(key.data[0])]
        if accepts:  # a new connection's accept goes first: nothing of it can be waiting yet
            event_list = [(key, mask) for key, mask in event_list if key.data[0] not in accepts]
            self._ready.extendleft(reversed(accepts))
        return process_events(self, event_list)

    async def turn(self, may_slice: bool = True) -> None:
        """The handler's sandbox's turn on the loop, before the handler goes on: after each read
        of one of its connections, and after each hook before its completion is handled (the
        requests a client pipelined, or opened as HTTP/2 streams, are handled from there, with no
        read in between)."""
        # The work just done ran in this very step of the loop: its time so far is charged now,
        # before the next turn is reserved (else each connection had one read uncharged).
        spent, self._egress_spent = self._egress_spent, 0.0
        if serving() is self:  # (always, for a proxy connection's reader and its hooks)
            now = perf_counter()
            spent += now - _step[0]
            _step[0] = now
        if spent:
            _charge(self, spent)
        key = _key(self)
        if key is None:
            if may_slice and perf_counter() - _began[0] > STEP_SLICE and serving() is self:
                await asyncio.sleep(0)
            return
        # A turn waits for its own slot (LoopShare.reserve): its sandbox's debt paid, and the turns
        # of its other connections before it spaced by what a turn costs, however many it holds; a
        # wait cut at MAX_WAIT reserves again, so that capped turns do not all resume at once.
        waited = 0.0
        paused = None
        try:
            while wait := _share.reserve(key, pressed=_lighter_served(key)):
                paused = paused or _pause(self)
                await asyncio.sleep(wait)
                waited += wait
                if wait < MAX_WAIT:
                    break
        finally:
            if paused is not None:
                _resume(paused)
        self._egress_light = not _share.in_debt(key)
        load = _share.note_load(key)
        _order.heavy = _share.heavy()  # (the level it follows is recomputed at most every 50 ms)
        if waited:
            _waited(key, waited)
        elif may_slice and serving() is self and perf_counter() - _began[0] > (
                _order.slice if _order.yielding(key, load, perf_counter()) else STEP_SLICE):
            await asyncio.sleep(0)  # (charged: the next step is timed like any other)

    def read_size(self) -> int:
        """How many bytes the handler's next read of a connection takes: FULL_READ, or
        YIELDING_READ while its sandbox gives way to a lighter one and a full read of it would
        cost more than a slice. The sandbox's cost per read was measured at the size the
        connection reads now: at full reads it goes to YIELDING_READ once that cost passes the
        slice, and back once a quarter of the slice (64/16) no longer holds it. (Scaling the cost
        by 64/16 at either size made an upload whose full reads take 0.2-0.55 ms flip between the
        two and mostly read 16 KiB: review 30.)"""
        key = getattr(self, ATTR, None)
        if key is None or not _order.yielding(key, _share.noted_load(key), perf_counter()):
            self._egress_small_reads = False
            return FULL_READ
        cost = _share.read_cost(key)
        small = cost * (FULL_READ / YIELDING_READ) > _order.slice if self._egress_small_reads else cost > _order.slice
        self._egress_small_reads = small
        return YIELDING_READ if small else FULL_READ

    async def shared_hook_task(self, hook) -> None:
        """mitmproxy's hook_task (12.3), with the sandbox's turn before the hook runs: the hook and
        its completion stay one piece of work (what a hook charges, e.g. a decoded body, is handed
        on as the completion sends it)."""
        if hook.blocking:
            # Only a sandbox that must wait waits here: a hook that does not is run at once, as
            # mitmproxy's eager tasks run it (a yield before every hook reordered the handing on of
            # a decoded body's charge: tests/credentials/test_buffer_budget.py under load).
            await turn(self, may_slice=False)
        await self.handle_hook(hook)
        if hook.blocking:
            await self.server_event(events.HookCompleted(hook))

    if _not_charged not in gc.callbacks:
        gc.callbacks.append(_not_charged)
    perf_counter = time.perf_counter
    handler_class._egress_spent = 0.0  # loop time of the handler's callbacks not charged yet
    handler_class._egress_light = False  # its sandbox was within its share at its last turn (unknown: not)
    marked_handle_client._egress_share = True
    handler_class.handle_client = marked_handle_client
    handler_class.egress_turn = turn  # awaited between each read and its event (addons/conn_close.py)
    handler_class.egress_read_size = read_size  # (addons/conn_close.py)
    handler_class._egress_small_reads = False  # its reads were cut to YIELDING_READ at its last read
    handler_class.hook_task = shared_hook_task
    asyncio.Handle._run = timed_run
    selector_events.BaseSelectorEventLoop._process_events = counted_process_events
    selector_events.BaseSelectorEventLoop._accept_connection2 = keyed_accept_connection


@dataclass
class EgressPaceHook(commands.StartHook):
    """Started by a stream between two pieces of a large body it sends (addons/http_stream.py
    `paced_sends`): the sandbox's turn, so that one buffered 18 MB response is not encrypted and
    written in one step of the loop (~50 ms) while every other sandbox waits. Unhandled, it only
    ends at once."""

    flow: object  # the stream's HTTPFlow (mitmproxy hands every hook one argument)


class FairShare:
    """Declares the options and installs the wrappers; gives a stream's paced sends their turns."""

    async def egress_pace(self, flow) -> None:
        await current_turn()

    def __init__(self, state) -> None:
        install(state)

    def load(self, loader) -> None:
        declare(
            loader,
            "egress_max_loop_share_per_sandbox",
            "egress_loop_share_burst",
            "egress_loop_share_busy",
            "egress_loop_share_headroom",
        )

    def configure(self, updated: set[str]) -> None:
        names = {"egress_max_loop_share_per_sandbox", "egress_loop_share_burst", "egress_loop_share_busy",
                 "egress_loop_share_headroom"}
        if updated & names:
            try:
                _share.configure(float(ctx.options.egress_max_loop_share_per_sandbox),
                                 float(ctx.options.egress_loop_share_burst), float(ctx.options.egress_loop_share_busy),
                                 float(ctx.options.egress_loop_share_headroom))
            except ValueError as exc:
                raise exceptions.OptionsError(f"{', '.join(sorted(names))}: {exc}") from None
