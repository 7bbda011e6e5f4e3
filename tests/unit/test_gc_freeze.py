"""addons/gc_freeze.py: once running, what start-up made is out of the collector's walks."""

from __future__ import annotations

import gc

from addons import gc_freeze
from addons.gc_freeze import CollectorFreeze


def test_running_freezes_what_exists_and_later_objects_are_still_collected():
    gc.unfreeze()
    thresholds = gc.get_threshold()
    try:
        CollectorFreeze().running()
        assert gc.get_threshold() == (thresholds[0], thresholds[1], gc_freeze.FULL_EVERY)  # shorter full collections
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this interpreter's modules, at least

        class Cycle:
            pass

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a  # made after the freeze: collected as before
        del a, b
        assert gc.collect() >= 2
        assert gc.get_freeze_count() <= frozen  # (frozen objects are still freed by their counts)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_a_full_collection_follows_a_disconnect_once_enough_buffers_were_given_back(monkeypatch):
    """A closed connection is cycles only a full collection frees: once COLLECT_AFTER bytes of
    buffers were given back, the next disconnect is followed by one (bench/noisy.py bound_lines)."""
    import asyncio
    from types import SimpleNamespace

    from addons import gc_freeze
    from gateway.budget import Ledger

    ledger = Ledger(None, None)  # no limits: the test reserves 64 MiB on one connection
    addon = gc_freeze.CollectorFreeze(SimpleNamespace(buffers=ledger))
    collected = []

    async def main():
        done = asyncio.Event()
        monkeypatch.setattr(gc_freeze.gc, "collect", lambda *a: (collected.append(ledger.released), done.set()))
        account = ledger.account("c1", "s1")
        account.reserve(gc_freeze.COLLECT_AFTER - 1)
        account.close()
        addon.client_disconnected(None)
        assert addon._pending is None  # not enough given back yet
        account = ledger.account("c2", "s1")
        account.reserve(1)
        account.close()
        addon.client_disconnected(None)
        addon.client_disconnected(None)  # one collection scheduled, not two
        await asyncio.wait_for(done.wait(), 5)

    asyncio.run(main())
    assert collected == [gc_freeze.COLLECT_AFTER]
