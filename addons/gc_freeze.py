"""The garbage collector leaves what the gateway loaded at start-up alone.

A full collection walks every object the interpreter tracks, and at start-up that is everything
mitmproxy, its dependencies and the compiled policy made: measured under load, full collections
held the event loop for 75-90 ms each, every other connection of the worker waiting behind them
(issue 15's noisy-neighbour benchmark, where they were B's slowest requests). `gc.freeze()` once
the gateway is running moves those objects to a generation no collection walks; what connections
create later is collected as before, and frozen objects are still freed by reference counting.

A closed connection is a web of cycles (its layers, contexts and flows) that only a full collection
frees. Its large bodies no longer wait for one (addons/http_stream.py `_drop_bodies` lets them go when
the flow is done: 18 MB bound responses had piled up to 376 MiB of RSS between two, bench/noisy.py
bound_lines), but what else such webs hold still does: so once COLLECT_AFTER bytes of buffers were
given back since the last, a client's disconnect is followed by a full collection (25-45 ms of the
loop each, so rare: at most one a second, and with bodies let go, RSS stayed at ~135 MiB without).

With the start-up objects frozen, the automatic full collections come often (the survivors they
weigh the young against are few) and each frees what closed connections left since the last: under
a request flood, ~6,000 objects, 5-9 ms of the loop every ~2 s, the other sandboxes' slowest
requests. FULL_EVERY = 2 (CPython's default is 10 younger collections per full one) makes them five
times as frequent and as short (1.3-4.8 ms), for about the same total time.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

COLLECT_AFTER = 512 * 1024 * 1024
FULL_EVERY = 2  # middle-generation collections per full one
MIN_INTERVAL = 1.0


class CollectorFreeze:
    def __init__(self, state=None) -> None:
        self.state = state
        self._mark = 0  # the ledger's bytes given back at the last collection
        self._last = 0.0
        self._pending = None

    def client_disconnected(self, client) -> None:
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
        gc.collect()

    def running(self) -> None:
        gc.collect()  # start-up's garbage is freed, not frozen
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_EVERY)
        logging.getLogger("egress").debug("egress gateway: %d start-up objects frozen out of collections",
                                          gc.get_freeze_count())
