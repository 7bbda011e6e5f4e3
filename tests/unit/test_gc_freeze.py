"""addons/gc_freeze.py: full collections walk what is new: start-up's objects and the survivors of
the last full collection are frozen; a thaw frees what died frozen; a cancelled task's frames do
not hold its connection in a cycle."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

import pytest

from addons import gc_freeze
from addons.gc_freeze import CollectorFreeze, break_cancelled_cycles
from gateway.budget import Ledger


class Cycle:
    pass


def _cycle() -> weakref.ref:
    """A two-object cycle, alive (its first object is returned) until the caller drops it."""
    a, b = Cycle(), Cycle()
    a.other, b.other = b, a
    return a


@pytest.fixture
def collector():
    """A CollectorFreeze running on a fresh loop; the interpreter's collector as it was, after."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    loop = asyncio.new_event_loop()
    addon = CollectorFreeze(SimpleNamespace(buffers=Ledger(None, None)))

    async def start():
        addon.running()
    loop.run_until_complete(start())
    try:
        yield addon, loop
    finally:
        addon.done()
        loop.close()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_running_freezes_what_exists_and_later_objects_are_still_collected(collector):
    addon, _ = collector
    assert gc.get_threshold()[2] == gc_freeze.FULL_EVERY  # shorter full collections
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # this interpreter's modules, at least
    young = weakref.ref(_cycle())  # made after the freeze, dead at once: collected as before
    gc.collect(1)
    assert young() is None


def test_the_survivors_of_a_full_collection_are_frozen_and_a_thaw_frees_those_that_died(collector):
    addon, _ = collector
    alive = _cycle()
    gc.collect()  # a full collection: `alive` survives it, and is frozen with its cycle
    assert addon._frozen >= 1
    frozen = gc.get_freeze_count()
    assert frozen >= 2
    dead = weakref.ref(alive)
    del alive  # now cyclic garbage, but frozen: no collection walks it
    gc.collect()
    assert dead() is not None
    addon.thaw()
    assert dead() is None
    assert addon._frozen == 0 and addon._closed == 0


def test_the_frozen_count_is_kept_as_objects_are_frozen_not_walked_for(collector, monkeypatch):
    """gc.get_freeze_count() walks every frozen object: asked at each closed connection it cost
    7.6% of a worker's CPU with ~1,000 connections open. The count is kept as survivors are frozen."""
    addon, _ = collector
    before = addon._frozen_count
    kept = [_cycle() for _ in range(5000)]
    gc.collect()
    assert addon._frozen_count - before >= 10_000  # the cycles, at least
    assert abs(addon._frozen_count - gc.get_freeze_count()) < 0.01 * gc.get_freeze_count()
    walks = []
    monkeypatch.setattr(gc_freeze.gc, "get_freeze_count", lambda: walks.append(1) or 0)
    for _ in range(gc_freeze.THAW_AFTER_CLOSES + 100):
        addon.server_disconnected(None)
    assert walks == []
    del kept


def test_a_thaw_comes_after_enough_closes_and_not_more_often_than_the_minimum(collector, monkeypatch):
    addon, _ = collector
    thaws = []
    monkeypatch.setattr(addon, "thaw", lambda: thaws.append(addon._closed))
    clock = [1000.0]
    monkeypatch.setattr(gc_freeze.time, "monotonic", lambda: clock[0])
    addon._last_thaw, addon._frozen = clock[0], 1
    for _ in range(gc_freeze.THAW_AFTER_CLOSES + 10):
        addon.server_disconnected(None)
    assert thaws == []  # enough closes, but too soon after the last thaw
    clock[0] += gc_freeze.MIN_THAW_SECONDS
    addon.client_disconnected(None)
    assert thaws == [gc_freeze.THAW_AFTER_CLOSES + 11]
    addon._frozen, addon._closed, addon._last_thaw = 0, 0, clock[0]
    clock[0] += gc_freeze.MAX_THAW_SECONDS
    assert not addon._thaw_due(clock[0])  # nothing frozen since: nothing to thaw
    addon._frozen = 1
    assert addon._thaw_due(clock[0])  # and the timer thaws at the latest after MAX_THAW_SECONDS


def test_a_cancelled_tasks_frames_are_cleared_so_what_they_held_is_freed_without_a_collection():
    """mitmproxy's connection tasks keep their CancelledError (`cancelled = e ... raise cancelled`):
    the exception's traceback holds the frames, whose locals hold the exception and the connection."""
    held = []

    async def connection():
        big = Cycle()
        held.append(weakref.ref(big))
        cancelled = None
        try:
            await asyncio.sleep(60)  # not synchronisation: parked until cancelled
        except asyncio.CancelledError as e:
            cancelled = e
        raise cancelled

    async def main(breaking: bool):
        task = asyncio.get_running_loop().create_task(connection())
        if breaking:
            task.add_done_callback(break_cancelled_cycles)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task])
        await asyncio.sleep(0)  # (the done callbacks)

    gc.disable()
    try:
        asyncio.run(main(breaking=False))
        assert held[-1]() is not None  # in a cycle: only a collection would free it
        asyncio.run(main(breaking=True))
        assert held[-1]() is None
    finally:
        gc.enable()
        gc.collect()


def test_running_makes_every_task_break_its_cancelled_cycles(collector):
    _, loop = collector
    assert getattr(loop.get_task_factory(), "breaks_cancelled_cycles", False)


def test_a_thaw_follows_a_disconnect_once_enough_buffers_were_given_back(monkeypatch):
    """A closed connection is cycles only a full collection frees: once COLLECT_AFTER bytes of
    buffers were given back, the next disconnect is followed by a thaw (bench/noisy.py bound_lines)."""
    ledger = Ledger(None, None)  # no limits: the test reserves 64 MiB on one connection
    addon = gc_freeze.CollectorFreeze(SimpleNamespace(buffers=ledger))
    thawed = []

    async def main():
        done = asyncio.Event()
        monkeypatch.setattr(addon, "thaw", lambda: (thawed.append(ledger.released), done.set()))
        account = ledger.account("c1", "s1")
        account.reserve(gc_freeze.COLLECT_AFTER - 1)
        account.close()
        addon.client_disconnected(None)
        assert addon._pending is None  # not enough given back yet
        account = ledger.account("c2", "s1")
        account.reserve(1)
        account.close()
        addon.client_disconnected(None)
        addon.client_disconnected(None)  # one thaw scheduled, not two
        await asyncio.wait_for(done.wait(), 5)

    asyncio.run(main())
    assert thawed == [gc_freeze.COLLECT_AFTER]


def test_a_thaw_follows_a_full_collection_once_enough_buffers_were_given_back_however_few_closed(
        collector, monkeypatch):
    """Review 25: the flows of kept-alive connections, frozen alive and done since, grew a worker
    from 85 MiB to 1.9 GiB before the 120 s thaw, no connection ever closed. What finished flows
    gave back to the buffer ledger now calls for a thaw, right after the full collection that sees it."""
    addon, loop = collector
    thaws = []
    monkeypatch.setattr(addon, "thaw", lambda: thaws.append(True))
    ledger = addon.state.buffers
    account = ledger.account("c1", "s1")
    account.reserve(gc_freeze.THAW_AFTER_RELEASED // 2)
    account.release()
    gc.collect()
    loop.run_until_complete(asyncio.sleep(0))
    assert thaws == []  # given back, but not enough
    account.reserve(gc_freeze.THAW_AFTER_RELEASED // 2 + 1)
    account.close()
    gc.collect()
    gc.collect()  # (one thaw scheduled, not two)
    loop.run_until_complete(asyncio.sleep(0))
    assert thaws == [True]


def test_breaking_a_cancelled_tasks_cycles_never_ends_another_task():
    """Review 25: clearing the frames of a chained exception's traceback also cleared the frame of
    another task still running (it had caught the error and handed it over): that task ended with
    GeneratorExit. Only the references to the tracebacks are dropped now."""
    ticks = []

    async def main():
        handed: asyncio.Future = asyncio.get_running_loop().create_future()

        async def worker():  # catches an error in its loop, hands it over, goes on
            try:
                raise ValueError("handed over")
            except ValueError as error:
                handed.set_result(error)
            while True:
                ticks.append(1)
                if len(ticks) >= ticked[0]:
                    went_on.set()
                await asyncio.sleep(0)

        handling = asyncio.Event()
        went_on = asyncio.Event()  # the worker ticked past `ticked[0]`
        ticked = [float("inf")]

        async def handler():
            error = await handed
            try:
                raise error  # ... handled while this task is cancelled: chained to its CancelledError
            except ValueError:
                handling.set()
                await asyncio.sleep(60)  # not synchronisation: parked until cancelled

        b = asyncio.create_task(worker())
        a = asyncio.create_task(handler())
        a.add_done_callback(break_cancelled_cycles)
        await handling.wait()
        a.cancel()
        await asyncio.wait([a])
        ticked[0] = len(ticks) + 3
        await asyncio.wait_for(went_on.wait(), 10)  # the worker goes on after the cancellation
        assert not b.done()
        b.cancel()

    asyncio.run(main())
