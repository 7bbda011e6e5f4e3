"""The sockets each sandbox holds on a worker: its client connections, the upstream connections
made for them, and their closed sockets still sending what was queued, against the worker's
open-file limit.

Every connection is a file descriptor, and a worker has a fixed number of them (RLIMIT_NOFILE).
When they ran out, `accept()` failed for every sandbox (asyncio then stops accepting on that
listener for a second) and every dial failed with EMFILE (502 `upstream_failed`). Review 37: three
sandboxes, each inside every budget (1,000 connections, 9 upstreams each: 8 idle kept for reuse and
the one in use), held all 20,000 of a worker's.

So:
- a sandbox's upstream connections have a cap of their own (`upstream_limit`), like its client
  connections;
- a worker shares out its open-file limit less a reserve for its own files (audit log, listeners,
  the event loop's: `hard`). From SHARE_FROM of that on (`soft`), a sandbox holding at least its
  even share of `soft` (`soft` / the sandboxes holding any) opens no more, so the sandbox holding
  the most is refused first; at `hard` nobody opens another. A first version had no `hard`: sandboxes under
  their share went on opening past the limit, and with two sandboxes at 1,024 open files (three
  at 4,096) the worker hit EMFILE and served nobody (review 38). What it cannot do is make room:
  sandboxes that together hold `hard` keep the rest out (refused, not failed) until they let go, so
  the open-file limit must fit the sandboxes a worker serves (docs/options.md).

A sans-I/O core: addons/limits.py counts and asks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

# Of the open-file limit, what is kept back for the worker's own files (audit log, listeners, the
# event loop's, a connection being refused as it is accepted: addons/accept_gate.py).
RESERVE_FRACTION = 0.05
MIN_RESERVE = 64
SHARE_FROM = 0.8  # of what is shared out: from there on, a sandbox over its even share opens no more


def worker_limit_for(open_files: int) -> int:
    """The sockets a worker lets sandboxes hold in all: `open_files` (the RLIMIT_NOFILE soft limit)
    less the reserve."""
    return max(1, open_files - max(MIN_RESERVE, int(open_files * RESERVE_FRACTION)))


class SocketLedger:
    def __init__(self, worker_limit: int, upstream_limit: int = 0):
        self.worker_limit = max(1, int(worker_limit))  # hard: nobody opens past it
        self.soft = max(1, int(self.worker_limit * SHARE_FROM))  # from it on, only those under their share
        self.upstream_limit = max(0, int(upstream_limit))  # per sandbox; 0: none
        self.clients: Counter[Hashable] = Counter()
        self.upstreams: Counter[Hashable] = Counter()
        self.lingering: Counter[Hashable] = Counter()  # closed, still sending what was queued
        self._held: Counter[Hashable] = Counter()  # clients + upstreams, only sandboxes holding any
        self.total = 0

    def held(self, key: Hashable) -> int:
        return self._held.get(key, 0)

    def over_share(self, key: Hashable) -> bool:
        """Whether the sandbox may open no more socket for the worker's sake: all that is shared out
        is taken, or most of it is and the sandbox holds at least its even share."""
        if self.total >= self.worker_limit:
            return True
        if self.total < self.soft:
            return False
        return self.held(key) * max(1, len(self._held)) >= self.soft

    def upstream_refusal(self, key: Hashable) -> str | None:
        """Why the sandbox may not open another upstream connection now (None: it may)."""
        if self.upstream_limit and self.upstreams.get(key, 0) >= self.upstream_limit:
            return (f"{self.upstreams[key]} upstream connections already open for {key} "
                    f"(egress_max_upstream_connections_per_sandbox {self.upstream_limit})")
        if self.over_share(key):
            return self._share_text(key)
        return None

    def client_refusal(self, key: Hashable) -> str | None:
        """Why the sandbox may not keep another client connection now (None: it may)."""
        return self._share_text(key) if self.over_share(key) else None

    def _share_text(self, key: Hashable) -> str:
        if self.total >= self.worker_limit:
            return f"the worker's sockets are all taken ({self.total} of the {self.worker_limit} it shares out)"
        return (f"the worker holds {self.total} sockets of the {self.worker_limit} it shares out, and {key} "
                f"holds {self.held(key)}, at least its share of them")

    def opened(self, key: Hashable, upstream: bool) -> None:
        self._add(self.upstreams if upstream else self.clients, key)

    def closed(self, key: Hashable, upstream: bool) -> None:
        self._remove(self.upstreams if upstream else self.clients, key)

    def lingers(self, key: Hashable) -> None:
        """A closed socket of the sandbox still sends what was queued: it holds its descriptor until
        it is gone (`gone`). Counted apart from its connections: it is one no more, yet it is a file
        (review 40: four sandboxes' lingering sockets took a worker to EMFILE, none counted)."""
        self._add(self.lingering, key)

    def gone(self, key: Hashable) -> None:
        self._remove(self.lingering, key)

    def _add(self, counter: Counter, key: Hashable) -> None:
        counter[key] += 1
        self._held[key] += 1
        self.total += 1

    def _remove(self, counter: Counter, key: Hashable) -> None:
        if counter.get(key, 0) <= 0:
            return
        counter[key] -= 1
        if not counter[key]:
            del counter[key]
        self._held[key] -= 1
        if not self._held[key]:
            del self._held[key]
        self.total -= 1
