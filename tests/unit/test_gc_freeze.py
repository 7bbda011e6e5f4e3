"""addons/gc_freeze.py: once running, what start-up made is out of the collector's walks."""

from __future__ import annotations

import gc

from addons.gc_freeze import CollectorFreeze


def test_running_freezes_what_exists_and_later_objects_are_still_collected():
    gc.unfreeze()
    try:
        CollectorFreeze().running()
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
