"""The garbage collector walks what is new, not everything that lives.

A full collection walks every object the interpreter tracks and has not frozen, and holds the event
loop for as long as that takes: every other connection of the worker waits behind it.

- **Start-up.** At start-up that is everything mitmproxy, its dependencies and the compiled policy
  made: measured under load, full collections held the loop for 75-90 ms each (issue 15's
  noisy-neighbour benchmark, where they were B's slowest requests). `gc.freeze()` once the gateway
  is running moves those objects to a generation no collection walks; frozen objects are still
  freed by reference counting.
- **Survivors.** With many connections open, each full collection walked all of them: one sandbox
  holding 1,000 keep-alive connections with 9 upstreams each is ~640,000 tracked objects, ~350 ms of
  CPU per full collection, every few seconds under its own traffic (review 20: a neighbour's p99
  1.9 s against 0.1 s). So what survives an automatic full collection is frozen too: the next ones
  walk only what was made since (200 such connections: 1.3-2 ms instead of 70-80 ms). The price: an
  object frozen alive that later becomes cyclic garbage (a connection that closes) waits for the
  next *thaw* (unfreeze, one full collection of everything, freeze what survives): as soon as the
  buffer ledger gave back THAW_AFTER_RELEASED, or the frozen objects doubled, since the last one
  (checked after every full collection: frozen garbage is also every finished flow of a kept-alive
  connection);
  once THAW_AFTER_CLOSES connections closed, at most every MIN_THAW_SECONDS; and at least every
  MAX_THAW_SECONDS while anything was frozen since.
- **Cancelled tasks.** Most of a closed connection's cyclic garbage was one cycle: mitmproxy cancels
  the task of a connection it closes, the task keeps the CancelledError, whose traceback holds every
  frame of the task, whose locals hold the exception (`cancelled = e ... raise cancelled`) and the
  whole connection (its streams, socket, transport, layers). Such a task's exception lets go of its
  traceback once the task is done (`break_cancelled_cycles`), so that reference counting frees what
  the frames held: the
  garbage a closed upstream connection leaves for the collector halved (126,528 objects for 2,000
  connections, 55,795 after).
- **Buffers given back.** A closed connection's large bodies no longer wait for a collection
  (addons/http_stream.py `_drop_bodies`), but what else its cycles hold still does: once
  COLLECT_AFTER bytes of buffers were given back since the last, a client's disconnect is followed
  by a thaw (at most one a second).
- **Young objects.** FULL_EVERY = 2 (CPython's default is 10 younger collections per full one): the
  full collections, short now, come five times as often, each with less to walk.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

COLLECT_AFTER = 512 * 1024 * 1024
FULL_EVERY = 2  # middle-generation collections per full one
MIN_INTERVAL = 1.0  # between two thaws after buffers were given back
THAW_AFTER_CLOSES = 5000  # connections (client or upstream) closed since the last thaw
MIN_THAW_SECONDS = 30.0
MAX_THAW_SECONDS = 120.0
# Memory, whatever the time: frozen garbage is not only closed connections' (review 25: the flows
# of 150 kept-alive connections, each request's 60 KB head in a flow frozen alive and done since,
# took a worker from 85 MiB to 1.9 GiB in 120 s, no connection ever closed). A thaw comes as soon
# as the buffer ledger has been given back this much since the last (the heads and bodies of
# finished flows: what a sandbox made the gateway hold, now garbage), or the frozen objects doubled
# (and by at least THAW_AFTER_OBJECTS) since the count a thaw left: what waits for a thaw is bounded
# by what traffic left behind, not by time. (The process's size is no signal: freed memory stays
# resident, so a threshold over it ratchets up by itself.)
THAW_AFTER_RELEASED = 128 * 1024 * 1024
THAW_AFTER_OBJECTS = 200_000
_CONTEXT_DEPTH = 8  # chained exceptions (__context__) whose tracebacks are cleared

logger = logging.getLogger("egress")


def thaw_all() -> int:
    """Every frozen object back in the walk, one full collection, what survived frozen again: the
    cyclic garbage of what was frozen alive is freed (the gc callback, if installed, freezes the
    survivors itself; the freeze here covers a collector not running). How many were collected."""
    gc.unfreeze()
    collected = gc.collect()
    gc.freeze()
    return collected


def break_cancelled_cycles(task: asyncio.Task) -> None:
    """A done task's callback: if it was cancelled, its CancelledError (and the exceptions chained
    to it) let go of their tracebacks, so that the frames, and what they referenced, are freed by
    reference counting instead of waiting, in a cycle, for a full collection. Only the references
    go: the frames themselves are not cleared (a chained exception's traceback may hold a frame of
    another task that is still running; clearing it would end that task: review 25). Nothing else
    reads them: a cancellation is not an error mitmproxy reports."""
    if not task.cancelled():
        return
    try:
        task.result()  # (the task's own CancelledError, with its traceback)
    except asyncio.CancelledError as error:
        exc: BaseException | None = error
        for _ in range(_CONTEXT_DEPTH):
            if exc is None:
                break
            exc.__traceback__ = None
            exc = exc.__context__


def _breaking(factory):
    """The loop's task factory (mitmproxy sets the eager one), with `break_cancelled_cycles` on
    every task it makes."""
    def make(loop, coro, **kwargs):
        task = factory(loop, coro, **kwargs) if factory is not None else asyncio.Task(coro, loop=loop, **kwargs)
        task.add_done_callback(break_cancelled_cycles)
        return task
    make.breaks_cancelled_cycles = True
    return make


class CollectorFreeze:
    def __init__(self, state=None) -> None:
        self.state = state
        self._mark = 0  # the ledger's bytes given back at the last collection
        self._last = 0.0  # when buffers given back last caused a thaw
        self._pending = None  # a thaw scheduled by given-back buffers
        self._thawing = False
        self._frozen = 0  # survivors frozen since the last thaw (full collections)
        self._closed = 0  # connections closed since the last thaw
        self._last_thaw = time.monotonic()
        self._timer = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released_at_thaw = 0  # the ledger's bytes given back, at the last thaw
        self._frozen_at_thaw = 0  # frozen objects after the last thaw
        self._frozen_count = 0  # frozen objects now (counted as they are frozen)
        self._soon = False  # a thaw is scheduled (the gc callback cannot collect itself)

    # -- freezing survivors -------------------------------------------------------------------------

    def _after_collection(self, phase: str, info: dict) -> None:
        """gc callback: what survived an automatic full collection is frozen (walked no more); if
        what is frozen has grown too much since the last thaw, a thaw comes next (it cannot run
        inside a collection: it is scheduled on the loop, from whatever thread collected)."""
        if phase == "stop" and info.get("generation") == 2 and not self._thawing:
            # Counted as they are frozen: gc.get_freeze_count() walks every frozen object, and was
            # asked at every closed connection (7.6% of a worker's CPU with ~1,000 connections open).
            self._frozen_count += len(gc.get_objects(2))
            gc.freeze()
            self._frozen += 1
            if not self._soon and self._loop is not None and self._grown():
                self._soon = True
                self._loop.call_soon_threadsafe(self._thaw_soon)

    def _released(self) -> int:
        ledger = getattr(self.state, "buffers", None)
        return ledger.released if ledger is not None else 0

    def _grown(self) -> bool:
        if self._released() - self._released_at_thaw > THAW_AFTER_RELEASED:
            return True
        frozen = self._frozen_count
        return frozen > max(2 * self._frozen_at_thaw, self._frozen_at_thaw + THAW_AFTER_OBJECTS)

    def _thaw_soon(self) -> None:
        self._soon = False
        self.thaw()

    def thaw(self) -> None:
        """Every frozen object back in the walk, one full collection, then what survived frozen
        again: the cyclic garbage of what was frozen alive is freed. Start-up's objects are walked
        too (they are frozen the same way), so a thaw costs what a full collection cost before."""
        self._thawing = True
        started = time.perf_counter()
        try:
            collected = thaw_all()
        finally:
            self._thawing = False
        self._frozen = self._closed = 0
        self._last_thaw = time.monotonic()
        self._frozen_at_thaw = self._frozen_count = gc.get_freeze_count()  # (once a thaw: walked anyway)
        self._released_at_thaw = self._released()
        logger.debug("egress gateway: thawed: %d objects collected in %.1f ms, %d frozen", collected,
                     (time.perf_counter() - started) * 1000, self._frozen_count)

    def _thaw_due(self, now: float) -> bool:
        if not self._frozen:
            return False
        if self._grown():
            return True
        since = now - self._last_thaw
        return since >= MAX_THAW_SECONDS or (since >= MIN_THAW_SECONDS and self._closed >= THAW_AFTER_CLOSES)

    def _closed_one(self) -> None:
        self._closed += 1
        if self._closed >= THAW_AFTER_CLOSES and self._thaw_due(time.monotonic()):
            self.thaw()

    def _tick(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(MAX_THAW_SECONDS / 4, self._tick)
        if self._thaw_due(time.monotonic()):
            self.thaw()

    # -- hooks --------------------------------------------------------------------------------------

    def server_disconnected(self, data) -> None:
        self._closed_one()

    def client_disconnected(self, client) -> None:
        self._closed_one()
        ledger = getattr(self.state, "buffers", None)
        if ledger is None or self._pending is not None or ledger.released - self._mark < COLLECT_AFTER:
            return
        now = time.monotonic()
        delay = max(0.1, self._last + MIN_INTERVAL - now)  # (0.1 s: the connection's objects let go first)
        self._pending = asyncio.get_running_loop().call_later(delay, self._collect)

    def _collect(self) -> None:
        self._pending = None
        self._mark = getattr(self.state, "buffers").released
        self._last = time.monotonic()
        self.thaw()

    def running(self) -> None:
        loop = asyncio.get_running_loop()
        factory = loop.get_task_factory()
        if not getattr(factory, "breaks_cancelled_cycles", False):
            loop.set_task_factory(_breaking(factory))
        gc.collect()  # start-up's garbage is freed, not frozen
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_EVERY)
        if self._after_collection not in gc.callbacks:
            gc.callbacks.append(self._after_collection)
        self._loop = loop
        self._last_thaw = time.monotonic()
        self._frozen_at_thaw = self._frozen_count = gc.get_freeze_count()
        self._released_at_thaw = self._released()
        if self._timer is None:
            self._timer = loop.call_later(MAX_THAW_SECONDS / 4, self._tick)
        logger.debug("egress gateway: %d start-up objects frozen out of collections", gc.get_freeze_count())

    def done(self) -> None:
        if self._after_collection in gc.callbacks:
            gc.callbacks.remove(self._after_collection)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
