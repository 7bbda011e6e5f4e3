"""A fair share of one event loop per sandbox: the time each sandbox's work took, against a share
that shrinks as more sandboxes are active, and how long its next read should wait.

Every other budget bounds what one unit of work may cost or how many units a sandbox may start;
none stops a sandbox that stays inside all of them from taking most of a worker (a flood at the
allowed request rate: another sandbox's p99 4x; rapid-reset connections repeated at the allowed
connection rate: 8x). A worker has one event loop and no scheduler between sandboxes. This is one:

- `charge(key, seconds)` after each piece of a sandbox's work (the adapter times mitmproxy's event
  handling and hooks, addons/fair_share.py);
- each sandbox has a bucket of loop time that refills at its share of a second per second: at most
  `max_share`, and at least 1/N when N sandboxes were active in the last `window` seconds. Above
  that, the share is the max-min level (`fill_level`): what the lighter sandboxes leave of the loop,
  split between the heavier ones, so that light neighbours do not cut the others to 1/N each (a
  flood, four sandboxes making a request a second and one making requests back to back: at 1/6
  the last waited for its turns ~290 times a second while the flood took what the light ones left,
  its latency 4-5x; review 34). It holds at most `burst` seconds;
- `delay(key)` is how long the sandbox's next read waits: zero while its bucket is not in debt,
  while no other sandbox is active, or while the loop is not contended (the work charged over
  about the last second, decayed exponentially, fills less than `busy` of it): the share only
  matters when someone else waits for the loop, so a lone sandbox, or a busy one next to an idle
  loop, is never slowed. Else it is the time the debt takes to refill, capped at MAX_DELAY (the
  read asks again after it, until it gets 0).

Pure (no I/O, no asyncio): the clock is injected. Every call is O(1) amortised; keys are evicted
once inactive for `window`, and never more than `max_keys` are kept. The level is recomputed every
LEVEL_PERIOD from the sandboxes whose load is at least LEVEL_MIN_LOAD (at most about 1/LEVEL_MIN_LOAD
of them: the loads add up to about one loop), the others counted together, and at once when a
sandbox becomes one of them (each needs ~10 ms of work to), so that neither a decision nor a
recomputation grows with the number of sandboxes.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

DEFAULT_MAX_SHARE = 0.5  # of a second per second, when contended
DEFAULT_BURST = 0.05  # seconds of loop time saved up: how long a sandbox may hold a loop another one waits for
DEFAULT_WINDOW = 10.0  # seconds: a sandbox charged within it is active (an agent pauses for seconds between calls)
LOAD_WINDOW = 1.0  # seconds: the time constant of the loop's load
# A sandbox in debt refills at its fair share (1/N, at most max_share) or at what the others left
# of the loop over about the last second less this much, whichever is more: a fixed 1/N cut a
# legitimate upload to a fifth next to a neighbour whose 300 connections each trickled a byte every
# 0.3 s (~10% of the loop; review 28), the rest of the loop idle.
SPARE_HEADROOM = 0.2
OTHERS_MIN = 0.05  # of the loop: the others' work over about the last second that makes a busy loop contended
FAST_WINDOW = 0.1  # seconds: the time constant of the load that decides whether a `pressed` loop is busy,
# and of a sandbox's recent load (`load_of`)
DEFAULT_BUSY = 0.7  # the loop counts as contended once the work charged lately fills this much of it
MAX_DELAY = 0.5  # seconds one read waits at most before it asks again (`delay`)
MAX_WAIT = 5.0  # seconds one read waits at most before it reserves again (`reserve`); under `window`,
# so that a sandbox waiting for its slots stays active and keeps its debt
DEFAULT_MAX_KEYS = 65536
# The most debt a sandbox carries: what it used past its share while nobody waited is forgiven,
# not paid all at once the next time someone does (a busy uploader, 0.3 s in debt after a second
# alone, then waited for that whole debt each time a neighbour made one small request: a third to
# a half of its throughput, a fresh-eyes review). Under sustained contention each turn's cost
# still puts it back in debt, so it still gets its share.
DEFAULT_MAX_DEBT = 0.02
# Which of the loop's ready callbacks runs first (`ReadyOrder`).
# Of the loop over about the last second: a sandbox under it never yields. An ordinary client
# making a fresh HTTPS request every 0.1 s is ~0.12; at 0.1 it yielded to a flood of cheap,
# never-finished ClientHellos (lighter, ~0.05, and always ready) and waited for them: its p99 rose
# from 1.1x to 3.5x its baseline (bench/noisy.py huge_client_hello).
HEAVY = 0.25
# Under contention the line is lower: a sandbox over the max-min level (`LoopShare.heavy`) yields
# too, down to this. Four sandboxes of an attack each at ~0.2 of the loop were all under HEAVY, so
# none gave way and a neighbour making one request every 0.1 s (~0.05) waited behind all of their
# ready work: its p50 2-3x (review 34's probe, the attack spread over four sandboxes). Not lower
# than this: an ordinary client making a fresh request every 0.1 s (~0.12) would then give way to
# a flood of cheap, never-finished ClientHellos (see HEAVY).
HEAVY_FLOOR = 0.15
LIGHT_RECENT = 0.25  # seconds: a lighter sandbox whose callback ended within it is being served
HEAVY_SLICE = 0.001  # seconds of yielding work per poll for I/O, while a lighter sandbox is served
# Seconds a sandbox's callbacks may be set aside in a row (from its first wait to a run of it):
# past it its next one runs whatever is ready. A lighter sandbox with a tiny callback ready at
# every poll held a heavier one's for as long as it went on (10 s in a review's probe).
MAX_SET_ASIDE = 0.02
# The max-min level (`fill_level`) shares out the loop less the spare headroom (what a sandbox that
# becomes active finds free at once, and the loop's own work that no sandbox is charged for); a
# sandbox under LEVEL_MIN_LOAD counts with the other light ones, as one sum; recomputed every
# LEVEL_PERIOD seconds.
LEVEL_MIN_LOAD = 0.01
LEVEL_PERIOD = 0.05
_HEAVY_CAP = 1024  # sandboxes looked at for the level (past it, another counts with the light ones)
_WAITING_CAP = 4096  # sandboxes remembered as waiting (past it the memory is cleared: they may run)


def yields_to(load: float, other: float, heavy: float = HEAVY) -> bool:
    """Whether ready work of a sandbox with `load` waits while work of one with `other` is ready:
    the one that used less of the loop lately goes first (least attained service). No starvation:
    the lighter one's load grows as it runs, and once it is no longer the lighter it no longer goes
    first; the heavier one waits only for work that is ready, never for a timer."""
    return load >= heavy and other < load


def fill_level(loads: list[float], capacity: float) -> float:
    """The max-min (water-filling) level of `capacity` between sandboxes with these `loads`, sorted
    ascending: the largest f with sum(min(load, f)) <= capacity, so that each sandbox using less
    than f is left alone and the ones using more share what remains equally; math.inf when all of
    them fit (nobody needs a limit). O(len(loads))."""
    if capacity <= 0:
        return 0.0
    remaining, left = capacity, len(loads)
    for load in loads:
        if load * left > remaining:
            return max(0.0, remaining / left)
        remaining -= load
        left -= 1
    return math.inf


class ReadyOrder:
    """The order of one event loop's ready callbacks between sandboxes, a sans-I/O core that
    addons/fair_share.py drives from asyncio's callback runner.

    Turns (`LoopShare.reserve`) gave a flood its whole share whenever it was not in debt, and a
    neighbour's every callback queued behind the flood's ready ones (1.5-3 ms each), and behind all
    of them that one poll of the loop had made ready: the neighbour's p99 2.1-3.5x its baseline.
    So, while a lighter sandbox is being served (one of its callbacks ended within LIGHT_RECENT), a
    heavier sandbox's callback (`yielding`) waits (`must_wait`) while a lighter one's is ready, and
    runs at most HEAVY_SLICE of such work per poll for I/O, so that what the lighter one's sockets
    bring is seen and goes first within about a millisecond. Once one of a sandbox's callbacks
    waited, all of its callbacks wait until the next poll (`held`), so that they keep their order.
    No cycle: a sandbox waits only for a strictly lighter one, or for the next poll, so the lightest
    ready one always runs. A sandbox alone, or next to heavier ones only, never waits; nothing ever
    waits for a timer, so the loop stays work-conserving."""

    __slots__ = ("heavy", "slice", "recent", "polls", "_poll", "_spent", "_waited", "_waiting", "_light_at",
                 "_light_load", "_light_key")

    def __init__(self, heavy: float = HEAVY, slice_seconds: float = HEAVY_SLICE, recent: float = LIGHT_RECENT):
        self.heavy, self.slice, self.recent = float(heavy), float(slice_seconds), float(recent)
        self.polls = 0  # the loop's polls for I/O so far
        self._poll = -1  # the poll `_spent` and `_waited` are about
        self._spent = -1.0  # seconds of yielding work run since that poll (-1: none ran)
        self._waited: set = set()  # sandboxes one of whose callbacks waited since that poll
        self._waiting: dict = {}  # sandbox -> when its callbacks began to wait (cleared when one runs)
        self._light_at, self._light_load, self._light_key = float("-inf"), 1.0, None  # the lightest served lately

    def polled(self) -> None:
        self.polls += 1

    def _since_poll(self) -> None:
        if self._poll != self.polls:
            self._poll, self._spent = self.polls, -1.0
            self._waited.clear()

    def yielding(self, key: Hashable, load: float, now: float) -> bool:
        """Whether the sandbox's work (at `load`; negative: not known) gives way now."""
        return (load >= self.heavy and key is not None and now - self._light_at < self.recent
                and self._light_key != key and yields_to(load, self._light_load, self.heavy))

    def sliced(self) -> bool:
        """Whether the yielding work since the last poll has used its slice (waits for the next);
        the first yielding callback after a poll always may run."""
        self._since_poll()
        return self._spent >= 0 and self._spent >= self.slice

    def held(self, key: Hashable) -> bool:
        """Whether a callback of the sandbox waited since the last poll: its every later one waits
        too, yielding or not (its load, or the lighter one's, can change within a step of the
        loop), so that each sandbox's callbacks still run in the order they were made (asyncio's
        FIFO promise). Only its own: a sandbox that waited for a lighter one never holds that one
        (two heavier sandboxes held each other so, for as long as a third trickled, a review)."""
        if not self._waited:
            return False
        self._since_poll()
        return key in self._waited

    def overdue(self, key: Hashable, now: float) -> bool:
        """Whether the sandbox's callbacks have waited MAX_SET_ASIDE in a row: its next one runs."""
        since = self._waiting.get(key)
        return since is not None and now - since >= MAX_SET_ASIDE

    def waits(self, key: Hashable, now: float = 0.0) -> None:
        """A callback of the sandbox waits until the next poll."""
        self._since_poll()
        self._waited.add(key)
        if key not in self._waiting:
            if len(self._waiting) >= _WAITING_CAP:
                self._waiting.clear()
            self._waiting[key] = now

    def ran(self, key: Hashable, load: float, now: float, spent: float, yielding: bool) -> None:
        """A callback of the sandbox ended at `now` after `spent` seconds."""
        if self._waiting:
            self._waiting.pop(key, None)
        if yielding:
            self._since_poll()
            self._spent = max(self._spent, 0.0) + spent
        if load >= 0 and key is not None and (
                now - self._light_at > self.recent or load <= self._light_load or key == self._light_key):
            self._light_at, self._light_load, self._light_key = now, load, key


class _Decaying:
    """A sum of charges that decays exponentially with time constant `tau` (a load average)."""
    __slots__ = ("value", "stamp", "tau")

    def __init__(self, tau: float, now: float):
        self.value, self.stamp, self.tau = 0.0, now, tau

    def at(self, now: float) -> float:
        elapsed = now - self.stamp
        if elapsed > 0:
            self.value *= math.exp(-elapsed / self.tau)
            self.stamp = now
        return self.value

    def add(self, now: float, seconds: float) -> None:
        self.value = self.at(now) + seconds


class _Share:
    __slots__ = ("tokens", "stamp", "active", "per_read", "next_slot", "load", "fast", "noted")

    def __init__(self, tokens: float, now: float):
        self.tokens = tokens
        self.stamp = now
        self.active = now
        self.per_read = 0.0  # what one charge (one read's work) costs, on average lately
        self.next_slot = now  # the first time a read of this sandbox may be given, while in debt
        self.load = _Decaying(LOAD_WINDOW, now)  # its own work charged lately
        self.fast = _Decaying(FAST_WINDOW, now)  # the same, over a shorter time
        self.noted = -1.0  # its load at its last turn (`note_load`; -1: none yet)


class LoopShare:
    def __init__(self, max_share: float = DEFAULT_MAX_SHARE, burst: float = DEFAULT_BURST,
                 window: float = DEFAULT_WINDOW, max_keys: int = DEFAULT_MAX_KEYS, busy: float = DEFAULT_BUSY,
                 clock: Callable[[], float] = time.monotonic, max_debt: float = DEFAULT_MAX_DEBT,
                 spare_headroom: float = SPARE_HEADROOM):
        self.clock = clock
        self.spare_headroom = float(spare_headroom)  # (1.0: a sandbox in debt refills at its share only)
        self.max_debt = float(max_debt)
        self.window = float(window)
        self.busy = float(busy)
        self._load = _Decaying(LOAD_WINDOW, clock())  # all work charged lately
        self._fast = _Decaying(FAST_WINDOW, self._load.stamp)  # the same, over a shorter time
        self.max_keys = max(2, int(max_keys))
        self._shares: OrderedDict[Hashable, _Share] = OrderedDict()  # least recently active first
        self._heavy: dict[Hashable, _Share] = {}  # the sandboxes that count one by one for the level
        self._level, self._level_at = math.inf, -math.inf  # the max-min level, and when it was computed
        self.configure(max_share, burst)

    def configure(self, max_share: float, burst: float, busy: float | None = None,
                  spare_headroom: float | None = None) -> None:
        # (NaN passes no comparison: `burst < 0` let it through, every wait became asyncio.sleep(nan)
        # and the worker stopped serving anyone, review 31; inf switched the share off unsaid.)
        if not 0 <= max_share <= 1 or not 0 <= burst < math.inf or (busy is not None and not 0 <= busy <= 1) or (
                spare_headroom is not None and not 0 <= spare_headroom <= 1):
            raise ValueError("max_share, busy and the headroom must be within [0, 1], burst a finite number >= 0")
        self.max_share = float(max_share)
        self.burst = float(burst)
        if busy is not None:
            self.busy = float(busy)
        if spare_headroom is not None:
            self.spare_headroom = float(spare_headroom)

    @property
    def enabled(self) -> bool:
        return self.max_share > 0

    def active(self, now: float | None = None) -> int:
        """Sandboxes charged within the window."""
        now = self.clock() if now is None else now
        self._expire(now)
        return len(self._shares)

    def share(self, now: float | None = None) -> float:
        """The share of the loop each active sandbox may have now: the max-min level, at least 1/N
        and at most `max_share`."""
        now = self.clock() if now is None else now
        return min(self.max_share, max(1.0 / max(1, self.active(now)), self._fill(now)))

    def heavy(self) -> float:
        """The load from which a sandbox gives way to lighter ones (`ReadyOrder.heavy`): HEAVY, or
        the max-min level while that is lower, but not under HEAVY_FLOOR. (The level as last
        computed: no clock read.)"""
        return max(HEAVY_FLOOR, min(HEAVY, self._level))

    def _fill(self, now: float) -> float:
        """The max-min level, recomputed at most every LEVEL_PERIOD."""
        if now - self._level_at < LEVEL_PERIOD:
            return self._level
        self._level_at = now
        loads = []
        for key, entry in list(self._heavy.items()):
            load = entry.load.at(now) / LOAD_WINDOW
            if load < LEVEL_MIN_LOAD or self._shares.get(key) is not entry:  # light again, or forgotten
                del self._heavy[key]
            else:
                loads.append(load)
        light = max(0.0, self._load.at(now) / LOAD_WINDOW - sum(loads))
        self._level = fill_level(sorted(loads), 1.0 - self.spare_headroom - light)
        return self._level

    def _share_of(self, entry: _Share, now: float, share: float) -> float:
        """The share `entry`'s sandbox refills at: `share`, or what the others' work left of the loop
        over about the last second less the spare headroom, whichever is more (the loop stays
        work-conserving: a sandbox waits for the others' work, not for an idle loop)."""
        others = (self._load.at(now) - entry.load.at(now)) / LOAD_WINDOW
        return max(share, 1.0 - others - self.spare_headroom)

    def charge(self, key: Hashable, seconds: float) -> None:
        if not self.enabled or seconds <= 0:
            return
        now = self.clock()
        share = self.share(now)  # expires inactive entries first
        entry = self._shares.get(key)
        if entry is None:
            entry = self._shares[key] = _Share(self.burst, now)
        else:
            self._refill(entry, now, self._share_of(entry, now, share))
            self._shares.move_to_end(key)
        entry.tokens = max(entry.tokens - seconds, -self.max_debt)
        entry.per_read = seconds if not entry.per_read else 0.9 * entry.per_read + 0.1 * seconds
        entry.active = now
        entry.load.add(now, seconds)
        if entry.load.value >= LEVEL_MIN_LOAD * LOAD_WINDOW and self._heavy.get(key) is not entry and len(
                self._heavy) < _HEAVY_CAP:
            self._heavy[key] = entry
            self._level_at = -math.inf  # a sandbox that just became heavy counts at once (a flood that begins)
        entry.fast.add(now, seconds)
        self._load.add(now, seconds)
        self._fast.add(now, seconds)
        while len(self._shares) > self.max_keys:
            self._shares.popitem(last=False)

    def delay(self, key: Hashable) -> float:
        """Seconds the sandbox's next read should wait (0.0: none)."""
        now = self.clock()
        debt = self._debt(key, now)
        if debt is None:
            return 0.0
        entry, share = debt
        return min(-entry.tokens / share, MAX_DELAY)

    def reserve(self, key: Hashable, pressed: bool = False) -> float:
        """Like `delay`, for a read that will then go ahead: while the sandbox is in debt each read
        gets its own slot, the first once the debt is paid and each next one a read's cost (at its
        share) later, so that its connections resume one by one, not all at once when the debt
        is paid (a sandbox holding 150 connections resumed them as one burst). `pressed`: another
        sandbox is waiting for the loop right now (the caller saw it served), which counts as
        contended whatever the load averaged over the last second says."""
        now = self.clock()
        debt = self._debt(key, now, pressed)
        if debt is None:
            entry = self._shares.get(key)
            if entry is not None:
                entry.next_slot = now
            return 0.0
        entry, share = debt
        slot = max(now - entry.tokens / share, entry.next_slot)
        entry.next_slot = slot + entry.per_read / share
        return min(slot - now, MAX_WAIT)

    def in_debt(self, key: Hashable) -> bool:
        """Whether the sandbox has used more than its share lately (its bucket is below zero),
        contended or not."""
        if not self.enabled:
            return False
        now = self.clock()
        entry = self._shares.get(key)
        if entry is None:
            return False
        self._refill(entry, now, self._share_of(entry, now, self.share(now)))
        return entry.tokens < 0

    def _debt(self, key: Hashable, now: float, pressed: bool = False) -> tuple[_Share, float] | None:
        """The sandbox's refilled entry and the share now, when it must wait: in debt, another
        sandbox active and the loop contended; None when it need not."""
        if not self.enabled:
            return None
        share = self.share(now)
        entry = self._shares.get(key)
        if entry is None:
            return None
        share = self._share_of(entry, now, share)
        self._refill(entry, now, share)
        if entry.tokens >= 0 or not self._others_active(key, now):
            return None
        # Contended: the loop is busy and others want it. Over the last second, the others' own
        # work must be a part of it (the sandbox's own load alone made a busy uploader wait for
        # its slots next to a neighbour making one request every few seconds, the loop half idle:
        # a fresh-eyes review); or another sandbox, within its share, is being served right now.
        busy = self._load.at(now) / LOAD_WINDOW >= self.busy
        others = self.busy == 0 or (self._load.at(now) - entry.load.at(now)) / LOAD_WINDOW >= OTHERS_MIN  # 0: always
        if not ((busy and others) or (pressed and self._fast.at(now) / FAST_WINDOW >= self.busy)):
            return None
        return entry, share

    def tokens(self, key: Hashable) -> float | None:
        """The sandbox's bucket now (for tests and metrics); None if it has none."""
        now = self.clock()
        share = self.share(now)
        entry = self._shares.get(key)
        if entry is None:
            return None
        self._refill(entry, now, self._share_of(entry, now, share))
        return entry.tokens

    def load_of(self, key: Hashable) -> float:
        """The fraction of the loop the sandbox's own work charged lately fills (0.0: none): over
        about the last second, or the last FAST_WINDOW if more. Over the second alone, a flood
        that had just begun counted as light for its first ~0.3 s, and went first, 100 of its
        callbacks between a neighbour's 36 (the neighbour's p99 2.3-2.8x): so did a sandbox that
        floods for 0.2 s of every second, whose average never reaches HEAVY."""
        entry = self._shares.get(key)
        if entry is None:
            return 0.0
        now = self.clock()
        return max(entry.load.at(now) / LOAD_WINDOW, entry.fast.at(now) / FAST_WINDOW)

    def read_cost(self, key: Hashable) -> float:
        """What one charge (about one read's work) of the sandbox costs, on average lately (0.0:
        not known)."""
        entry = self._shares.get(key)
        return entry.per_read if entry is not None else 0.0

    def note_load(self, key: Hashable) -> float:
        """Note the sandbox's load now (at a turn of one of its connections): what `noted_load`
        gives until its next turn. One value per sandbox, not per connection: with each connection
        keeping its own, two sandboxes could each wait for a lighter-looking connection of the
        other, and the order between sandboxes is only free of cycles if each has one load."""
        entry = self._shares.get(key)
        if entry is None:
            return -1.0
        entry.noted = self.load_of(key)
        return entry.noted

    def noted_load(self, key: Hashable) -> float:
        """The sandbox's load at its last turn (-1.0: none yet, or forgotten); no clock read."""
        entry = self._shares.get(key)
        return entry.noted if entry is not None else -1.0

    def load(self, now: float | None = None) -> float:
        """The fraction of the loop the work charged lately fills (about the last second)."""
        return self._load.at(self.clock() if now is None else now) / LOAD_WINDOW

    def contended(self, now: float | None = None) -> bool:
        return self.load(now) >= self.busy

    # -- internals ---------------------------------------------------------------------------

    def _refill(self, entry: _Share, now: float, share: float) -> None:
        elapsed = max(0.0, now - entry.stamp)
        if elapsed:
            entry.tokens = min(self.burst, entry.tokens + elapsed * share)
            entry.stamp = now

    def _others_active(self, key: Hashable, now: float) -> bool:
        """Whether a sandbox other than `key` was charged within the window: the most recently
        active entries are at the end, so at most two are looked at."""
        for other in reversed(self._shares):
            if other == key:
                continue
            return now - self._shares[other].active <= self.window
        return False

    def _expire(self, now: float) -> None:
        """Drop the least recently active entries once they are out of the window (a debt is
        forgotten with them: a sandbox that stopped for a whole window has paid its share)."""
        while self._shares:
            key, entry = next(iter(self._shares.items()))
            if now - entry.active <= self.window:
                return
            del self._shares[key]
