"""The garbage collector leaves what the gateway loaded at start-up alone.

A full collection walks every object the interpreter tracks, and at start-up that is everything
mitmproxy, its dependencies and the compiled policy made: measured under load, full collections
held the event loop for 75-90 ms each, every other connection of the worker waiting behind them
(issue 15's noisy-neighbour benchmark, where they were B's slowest requests). `gc.freeze()` once
the gateway is running moves those objects to a generation no collection walks; what connections
create later is collected as before, and frozen objects are still freed by reference counting.
"""

from __future__ import annotations

import gc
import logging


class CollectorFreeze:
    def running(self) -> None:
        gc.collect()  # start-up's garbage is freed, not frozen
        gc.freeze()
        logging.getLogger("egress").debug("egress gateway: %d start-up objects frozen out of collections",
                                          gc.get_freeze_count())
