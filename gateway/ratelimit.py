"""Rates and budgets: token buckets (the gateway-wide defence) and sliding windows (policy `limits:`).

Pure: no I/O, no mitmproxy; every object takes the time as an argument or from an injectable clock,
so tests drive it without sleeping. Every decision is O(1) (a window's bounded slot count is a
constant), and memory is bounded:

- `BucketTable` holds one token bucket per key (a sandbox id, or a client address when the policy
  has no sandboxes section). A bucket that has refilled to full is the same as no bucket, so idle
  full buckets are evicted as the table is used, and the table never holds more than `max_keys`
  (the least recently used bucket goes first): an attacker cycling source addresses cannot grow it.
- `SlidingWindow` counts what happened in the last `period` seconds in `SLOTS` slots, so a budget
  "per minute" means any minute, not a calendar minute (at most one slot's worth, 1/60 of the
  period, of slack), and `Quotas` keeps one per (sandbox, rule, credential, key) the policy names:
  bounded by the policy, not by traffic.
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

Clock = Callable[[], float]

SLOTS = 60  # per window: a minute in seconds, an hour in minutes
MIN_RATE = 0.001  # per second (one token in ~17 minutes): the smallest non-zero rate an option takes
MAX_RETRY_AFTER = 3600  # seconds: the longest wait a refusal names (Retry-After, and a bucket's wait)
DEFAULT_MAX_KEYS = 65536  # buckets per table: 64 Ki keys at ~200 bytes each, about 13 MiB at worst
# Policy-limit windows (a few per sandbox with limits): ~1 KiB each, about 32 MiB at worst. Sandbox
# ids come from traffic too (a verified token's subject), so the table is bounded: empty windows
# are dropped first, oldest first, and past the cap the least recently used goes even if not empty.
DEFAULT_MAX_WINDOWS = 32768
SWEEP_PER_CALL = 4  # least recently used windows looked at (and dropped if empty) per new window: O(1)


class _Bucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: float):
        self.tokens = tokens
        self.stamp = stamp


class BucketTable:
    """Token buckets by key: `rate` tokens a second, at most `burst` saved up. `rate` 0: no limit."""

    def __init__(self, rate: float, burst: float, max_keys: int = DEFAULT_MAX_KEYS, clock: Clock = time.monotonic):
        self.clock = clock
        self.max_keys = max(1, int(max_keys))
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()  # least recently used first
        self.configure(rate, burst)

    def configure(self, rate: float, burst: float) -> None:
        """New settings; buckets in use keep their tokens (capped to the new burst)."""
        if rate < 0 or burst < 0:
            raise ValueError("rate and burst must be >= 0")
        self.rate = float(rate)
        self.burst = max(float(burst), 1.0) if rate else 0.0
        for bucket in self._buckets.values():
            bucket.tokens = min(bucket.tokens, self.burst)
        if not rate:
            self._buckets.clear()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: Hashable, cost: float = 1.0) -> float:
        """Take `cost` tokens from `key`'s bucket: 0.0 when taken, else the seconds until they are
        there (nothing is taken then). Always 0.0 when the table has no rate."""
        if not self.rate:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.stamp) * self.rate)
            bucket.stamp = now
            self._buckets.move_to_end(key)
        if bucket.tokens >= cost:
            bucket.tokens -= cost
            wait = 0.0
        else:
            wait = min((cost - bucket.tokens) / self.rate, float(MAX_RETRY_AFTER))
        self._evict(now)
        return wait

    def _evict(self, now: float) -> None:
        """Up to two idle buckets that have refilled to full (forgetting them changes nothing), then
        the least recently used ones while over `max_keys`: amortised O(1) per `take`."""
        for _ in range(2):
            if not self._buckets:
                return
            key, oldest = next(iter(self._buckets.items()))
            if oldest.tokens + max(0.0, now - oldest.stamp) * self.rate < self.burst:
                break
            del self._buckets[key]
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)


class SlidingWindow:
    """What was counted in the last `period` seconds (`SLOTS` slots), against `limit`."""

    __slots__ = ("limit", "period", "width", "counts", "head", "total")

    def __init__(self, limit: int, period: float, now: float, slots: int = SLOTS):
        if limit < 0 or period <= 0 or slots < 1:
            raise ValueError("limit >= 0, period > 0 and slots >= 1")
        self.limit = limit
        self.period = float(period)
        self.width = self.period / slots
        self.counts = [0] * slots
        self.head = math.floor(now / self.width)  # the slot `now` falls in
        self.total = 0

    def _advance(self, now: float) -> None:
        slot = math.floor(now / self.width)
        if slot <= self.head:
            return  # the same slot, or a clock that stepped back: nothing expires
        n = len(self.counts)
        for k in range(self.head + 1, min(slot, self.head + n) + 1):
            self.total -= self.counts[k % n]
            self.counts[k % n] = 0
        self.head = slot

    def used(self, now: float) -> int:
        self._advance(now)
        return self.total

    def remaining(self, now: float) -> int:
        return max(0, self.limit - self.used(now))

    def fits(self, amount: int, now: float) -> bool:
        return self.used(now) + amount <= self.limit

    def add(self, amount: int, now: float) -> None:
        """Count `amount` now, whether it fits or not (bytes already relayed are counted as they are)."""
        if amount <= 0:
            return
        self._advance(now)
        self.counts[self.head % len(self.counts)] += amount
        self.total += amount

    def retry_after(self, amount: int, now: float) -> float:
        """Seconds until `amount` more fits (0.0 if it does now); an amount larger than the whole
        limit never fits, and gets the full period."""
        self._advance(now)
        excess = self.total + amount - self.limit
        if excess <= 0:
            return 0.0
        if amount > self.limit:
            return self.period
        n = len(self.counts)
        freed = 0
        for k in range(self.head - n + 1, self.head + 1):  # oldest slot first
            freed += self.counts[k % n]
            if freed >= excess:
                return max(0.0, (k + n) * self.width - now)  # slot k leaves the window then
        return self.period


class Quotas:
    """One sliding window per key, created when first used. `keep` (after a policy reload) drops
    the windows whose key the new policy no longer has and sets the new limits on the others, so a
    counter survives a reload exactly when its (sandbox, rule, credential, key) still exists.

    Bounded by `max_windows`: each new window first looks at the SWEEP_PER_CALL least recently used
    windows and drops those not asked for and empty for a whole period (dropping one loses nothing: a
    request that asked for a window within its period may still be counting on it), and past
    the cap drops the least recently used one even if it is not (`evicted_in_use` counts those: a
    sandbox idle for that long starts afresh). With `group` (key -> its group: a sandbox), one
    group's windows go at once (`drop_group`: a deregistered sandbox's), in O(its windows)."""

    def __init__(self, clock: Clock = time.monotonic, max_windows: int = DEFAULT_MAX_WINDOWS,
                 group: Callable[[Hashable], Hashable] | None = None):
        self.clock = clock
        self.max_windows = max_windows
        self._windows: OrderedDict[Hashable, SlidingWindow] = OrderedDict()
        self._asked: dict[Hashable, float] = {}  # when each window was last asked for
        self.evicted_in_use = 0
        self._group = group
        self._groups: dict[Hashable, set[Hashable]] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def window(self, key: Hashable, limit: int, period: float) -> SlidingWindow:
        now = self.clock()
        window = self._windows.get(key)
        if window is None or window.period != period:
            self._sweep(now)
            window = self._windows[key] = SlidingWindow(limit, period, now)
            if self._group is not None:
                self._groups.setdefault(self._group(key), set()).add(key)
        self._windows.move_to_end(key)
        self._asked[key] = now
        window.limit = limit
        return window

    def _sweep(self, now: float) -> None:
        oldest = [key for key, _ in zip(self._windows, range(SWEEP_PER_CALL))]
        for key in oldest:
            window = self._windows[key]
            if now - self._asked.get(key, now) >= window.period and window.used(now) == 0:
                self._drop(key)
        while len(self._windows) >= self.max_windows:
            key = next(iter(self._windows))
            if self._windows[key].used(now) != 0 or now - self._asked.get(key, now) < self._windows[key].period:
                self.evicted_in_use += 1
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        del self._windows[key]
        self._asked.pop(key, None)
        if self._group is not None:
            group = self._group(key)
            members = self._groups.get(group)
            if members is not None:
                members.discard(key)
                if not members:
                    del self._groups[group]

    def drop_group(self, group: Hashable) -> int:
        """Every window of `group` goes (a deregistered sandbox's); how many."""
        keys = self._groups.pop(group, set())
        for key in keys:
            self._windows.pop(key, None)
            self._asked.pop(key, None)
        return len(keys)

    def keep(self, valid: Callable[[Hashable], int | None]) -> None:
        """`valid(key)`: the key's limit under the new policy, or None when it is gone."""
        for key in list(self._windows):
            limit = valid(key)
            if limit is None:
                self._drop(key)
            else:
                self._windows[key].limit = limit

    def keys(self) -> Iterable[Hashable]:
        return list(self._windows)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*\Z", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: object) -> int:
    """A byte count: a non-negative integer, or text like `100MiB`, `1.5 GB`, `512KiB`, `10B`
    (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024). ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("a size is a number of bytes or text like 100MiB, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if not isinstance(value, str) or not (match := _SIZE_RE.match(value)):
        raise ValueError("a size is a number of bytes or text like 100MiB, 1.5GB, 512KiB")
    number, unit = match.group(1), (match.group(2) or "").lower()
    size = float(number) * _UNITS[unit]
    if not math.isfinite(size) or size > 2**63:
        raise ValueError("too large")
    return int(size)


def parse_rate(text: object) -> float:
    """A rate option (per second): 0 (no limit), or a finite decimal number from `MIN_RATE` up whose
    inverse (the seconds a token takes) is finite too. ValueError otherwise: a rate like 1e-320
    would make every wait infinite, and every refusal fail."""
    try:
        rate = float(str(text).strip())
    except ValueError:
        raise ValueError(f"a rate is a number of requests or connections a second, not {text!r}") from None
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"a rate must be a finite number >= 0, not {text!r}")
    if rate == 0:
        return 0.0
    if rate < MIN_RATE or not math.isfinite(1 / rate):
        raise ValueError(f"a rate must be 0 (no limit) or at least {MIN_RATE:g} a second, not {text!r}")
    return rate


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds; never 0 for a refusal (a client would retry at once), never more
    than `MAX_RETRY_AFTER` (nor infinite, nor NaN: those are `MAX_RETRY_AFTER` too)."""
    if not seconds <= MAX_RETRY_AFTER:  # NaN too
        return str(MAX_RETRY_AFTER)
    if not seconds >= 1:  # down to -inf (math.ceil(-inf) raises: a 500 where a 429 was due)
        return "1"
    return str(math.ceil(seconds))
