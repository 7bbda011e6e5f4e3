"""Aggregating repeated refusals, so that a flood of refusals cannot fill the disk or drown the log.

Pure logic (no I/O, injectable clock); gateway.audit.AuditLog writes what it returns.

Every refusal (an audit entry with `decision: "deny"`) belongs to a *source*, the key the rate
limiter uses (addons/rate_limits.py): its sandbox id; with a `sandboxes` section, every client no
sandbox covers shares ONE source (`unscoped`, so cycling source addresses buys no new budget);
without one, the client's IP address. Each source has a token bucket of refusal
lines (`per_source` a second, bursts of `BURST_SECONDS` times that), and within it each key (event,
reason, rule, host) one of its own (`per_key` a second, same burst): a refusal with a token in both
is written verbatim. One without is only counted, per key; the first such refusal opens a summary
window of `window` seconds, and when it ends (noticed on the next record, or on the audit log's
one-second maintenance tick) each key with a count becomes ONE summary line,
`event: "suppressed"`, carrying `count` and the window. Allows and `would_deny` lines are never
aggregated: every request that left keeps its own line. A gateway serving ordinary traffic never
reaches the budget; a flood writes a burst, then at most `per_source` lines a second plus one
summary per key a second. Above them all, a gateway-wide bucket (`total` lines a second, same burst,
0: none) bounds the refusal lines of every source together: a refusal its source could write but
the gateway-wide budget cannot is counted under the source `*` (one summary per key a second), so
many sources refused at once (cycling client addresses without a sandboxes section) write at most
`total` lines a second and their summaries.

Memory is bounded: at most `max_sources` sources are tracked (idle ones, whose buckets are full
again, are forgotten first; beyond that, new sources share one overflow source `*`), at most
`max_keys` keys per source have a bucket (a new key past that has only its source's), at most
`max_keys` keys per source are counted apart in a window (more are counted per (event, reason),
then all together), and summaries that could not be written are kept up to `max_unwritten` (the
oldest beyond that are dropped and counted in `lost`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

WINDOW_SECONDS = 1.0
BURST_SECONDS = 4.0  # a bucket holds this many seconds' worth of lines
DEFAULT_PER_SOURCE = 50  # refusal lines per second per sandbox (or client address) written verbatim
DEFAULT_PER_KEY = 10  # of which per (event, reason, rule, host)
DEFAULT_TOTAL = 10 * DEFAULT_PER_SOURCE  # refusal lines per second written verbatim, every source together
MAX_SOURCES = 1024
MAX_KEYS = 32
MAX_UNWRITTEN = 4096
OVERFLOW_SOURCE = "*"
UNSCOPED_SOURCE = "unscoped"  # with a sandboxes section: every client no sandbox covers
SUPPRESSED_EVENT = "suppressed"

Key = tuple[Any, Any, Any, Any]  # (event, reason, rule, host)


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def source_of(entry: dict[str, Any], sandboxed: bool = False) -> str:
    """The sandbox id; else, with a sandboxes section (`sandboxed`), the one source of every client no
    sandbox covers (as the rate limiter keys them); else the client's address without its port ('?'
    when unknown)."""
    sandbox = entry.get("sandbox")
    if isinstance(sandbox, str) and sandbox:
        return "sandbox:" + sandbox
    if sandboxed:
        return UNSCOPED_SOURCE
    client = entry.get("client")
    if isinstance(client, str) and client:  # "ip:port" (IPv6 unbracketed, as the gateway writes it)
        return "client:" + (client.rsplit(":", 1)[0] if ":" in client else client)
    return "client:?"


@dataclass
class _Count:
    count: int = 0
    first: float = 0.0
    last: float = 0.0
    sample: dict[str, Any] = field(default_factory=dict)  # the first suppressed entry's identifying fields


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, now: float):
        self.tokens, self.updated = tokens, now

    def refill(self, now: float, rate: float, burst: float) -> None:
        if now > self.updated:
            self.tokens = min(burst, self.tokens + (now - self.updated) * rate)
        self.updated = now

    def idle(self, now: float, rate: float, burst: float) -> bool:
        return self.tokens + max(0.0, now - self.updated) * rate >= burst


@dataclass
class _Source:
    bucket: _Bucket
    keys: dict[Key, _Bucket] = field(default_factory=dict)
    counts: dict[Key, _Count] = field(default_factory=dict)
    window: float | None = None  # start of the open summary window


_SAMPLED = ("client", "sandbox", "mode", "status", "port")


class RefusalAggregator:
    def __init__(self, per_source: int = DEFAULT_PER_SOURCE, per_key: int = DEFAULT_PER_KEY, *, total: int = 0,
                 window: float = WINDOW_SECONDS, burst_seconds: float = BURST_SECONDS,
                 clock: Callable[[], float] = time.time, max_sources: int = MAX_SOURCES, max_keys: int = MAX_KEYS,
                 max_unwritten: int = MAX_UNWRITTEN):
        if window <= 0 or burst_seconds < 1:
            raise ValueError("window must be > 0, burst_seconds >= 1")
        self.window, self.burst_seconds = window, burst_seconds
        self.clock = clock
        self._total: _Bucket | None = None
        self.configure(per_source, per_key, total)
        self.max_sources, self.max_keys, self.max_unwritten = max_sources, max_keys, max_unwritten
        self._sources: dict[str, _Source] = {}
        self._windows: dict[str, float] = {}  # sources with an open summary window, oldest first
        self._unwritten: list[dict[str, Any]] = []  # summaries a write failed for: first out next time
        self._lock = threading.Lock()
        self._swept = float("-inf")
        self.suppressed = 0  # refusal lines not written verbatim (counted in summaries)
        self.lost = 0  # suppressed refusals whose summary was dropped (max_unwritten)

    def configure(self, per_source: int, per_key: int, total: int | None = None) -> None:
        """`total`: refusal lines a second of every source together (0: no such budget; None: as it was)."""
        if per_source < 1 or per_key < 1 or (total is not None and total < 0):
            raise ValueError("per_source and per_key must be >= 1, total >= 0")
        self.per_source, self.per_key = per_source, per_key
        self._source_burst = per_source * self.burst_seconds
        self._key_burst = per_key * self.burst_seconds
        if total is not None:
            self.total = total
            self._total_burst = total * self.burst_seconds
            self._total = _Bucket(self._total_burst, self.clock()) if total else None

    @property
    def sources(self) -> int:
        return len(self._sources)

    def admit(self, entry: dict[str, Any], sandboxed: bool = False) -> bool:
        """True: write this entry as it is. False: it is a refusal over its source's budget (or the
        gateway-wide one), counted in a summary instead. Call `due()` first (it closes the windows
        that ended). `sandboxed`: the policy has a sandboxes section (see source_of)."""
        if entry.get("decision") != "deny":
            return True
        now = self.clock()
        with self._lock:
            name = source_of(entry, sandboxed)
            source = self._sources.get(name)
            if source is None:
                if len(self._sources) >= self.max_sources and not (self._swept <= now < self._swept + 0.1):
                    self._swept = now  # at most ten sweeps a second, however many sources knock
                    self._forget_idle(now)
                if len(self._sources) >= self.max_sources:
                    name = OVERFLOW_SOURCE
                    source = self._sources.get(name)
                if source is None:
                    source = self._sources[name] = _Source(_Bucket(self._source_burst, now))
            key: Key = (entry.get("event"), entry.get("reason"), entry.get("rule"), entry.get("host"))
            source.bucket.refill(now, self.per_source, self._source_burst)
            bucket = source.keys.get(key)
            if bucket is None and len(source.keys) < self.max_keys:
                bucket = source.keys[key] = _Bucket(self._key_burst, now)
            if bucket is not None:
                bucket.refill(now, self.per_key, self._key_burst)
            if source.bucket.tokens >= 1 and (bucket is None or bucket.tokens >= 1):
                total = self._total
                if total is not None:
                    total.refill(now, self.total, self._total_burst)
                if total is None or total.tokens >= 1:
                    source.bucket.tokens -= 1
                    if bucket is not None:
                        bucket.tokens -= 1
                    if total is not None:
                        total.tokens -= 1
                    return True
                # Its source could write it, the gateway cannot: counted with every such refusal,
                # so that however many sources there are, their summaries are few.
                name = OVERFLOW_SOURCE
                source = self._sources.get(name)
                if source is None:
                    source = self._sources[name] = _Source(_Bucket(self._source_burst, now))
            if key not in source.counts and len(source.counts) >= self.max_keys:
                key = (entry.get("event"), entry.get("reason"), None, None)
                if key not in source.counts and len(source.counts) >= 2 * self.max_keys:
                    key = (None, None, None, None)
            count = source.counts.get(key)
            if count is None:
                count = source.counts[key] = _Count(first=now, sample={k: entry.get(k) for k in _SAMPLED})
                if name == OVERFLOW_SOURCE:
                    count.sample.update(client=None, sandbox=None)
            count.count += 1
            count.last = now
            if source.window is None:
                source.window = now
                self._windows[name] = now
            self.suppressed += 1
            return False

    def due(self) -> list[dict[str, Any]]:
        """The summaries to write now: any left unwritten, then those of every window that ended."""
        if not self._windows and not self._unwritten:
            return []  # the hot path: no flood under way (a racing admit is seen next time)
        now = self.clock()
        with self._lock:
            while self._windows:
                name, start = next(iter(self._windows.items()))
                if start <= now < start + self.window:
                    break
                del self._windows[name]
                source = self._sources[name]
                self._unwritten.extend(self._summaries(name, source, start, min(now, start + self.window)))
                source.counts, source.window = {}, None
            return self._take()

    def drain(self) -> list[dict[str, Any]]:
        """Every pending summary now, open windows included (shutdown, reopen): those windows end
        here, and the buckets stay as they are (what is over budget stays suppressed)."""
        now = self.clock()
        with self._lock:
            for name, start in self._windows.items():
                source = self._sources[name]
                self._unwritten.extend(self._summaries(name, source, start, max(now, start)))
                source.counts, source.window = {}, None
            self._windows.clear()
            return self._take()

    def restore(self, summaries: list[dict[str, Any]]) -> None:
        """Summaries a write failed for: they go out first next time (bounded)."""
        with self._lock:
            self._unwritten[:0] = summaries
            excess = len(self._unwritten) - self.max_unwritten
            if excess > 0:
                self.lost += sum(s["count"] for s in self._unwritten[:excess])
                del self._unwritten[:excess]

    @property
    def pending(self) -> int:
        """Suppressed refusals not yet in a written summary."""
        with self._lock:
            return sum(s["count"] for s in self._unwritten) + sum(
                c.count for source in self._sources.values() for c in source.counts.values())

    # --- inside the lock -------------------------------------------------------------------------

    def _take(self) -> list[dict[str, Any]]:
        out, self._unwritten = self._unwritten, []
        return out

    def _forget_idle(self, now: float) -> None:
        """Drop the sources whose buckets are full again and that have nothing pending."""
        for name in [n for n, s in self._sources.items() if s.window is None
                     and s.bucket.idle(now, self.per_source, self._source_burst)
                     and all(b.idle(now, self.per_key, self._key_burst) for b in s.keys.values())]:
            del self._sources[name]

    def _summaries(self, name: str, source: _Source, start: float, end: float) -> list[dict[str, Any]]:
        out = []
        for (event, reason, rule, host), count in source.counts.items():
            who = "many sources (too many at once, or over the gateway-wide budget)" if name == OVERFLOW_SOURCE else \
                "clients no sandbox covers" if name == UNSCOPED_SOURCE else \
                f"sandbox {count.sample.get('sandbox')}" if name.startswith("sandbox:") else f"client {name[7:]}"
            what = f"{event} refusals ({reason})" if event else "refusals"
            where = f" to {host}" if host else ""
            out.append({
                "time": rfc3339(end), "event": SUPPRESSED_EVENT,
                "client": name[7:] if name.startswith("client:") else None,
                "sandbox": count.sample.get("sandbox"), "mode": count.sample.get("mode"), "decision": "deny",
                "reason": reason, "status": count.sample.get("status"), "rule": rule, "host": host,
                "port": count.sample.get("port") if host else None,
                "message": f"{count.count} more {what} from {who}{where} were not written one by one "
                           f"(over {self.per_source} refusal lines a second per source, {self.per_key} per kind"
                           + (f", {self.total} for the whole gateway)" if self.total else ")"),
                "suppressed_event": event, "count": count.count,
                "window_start": rfc3339(start), "window_end": rfc3339(end),
                "first": rfc3339(count.first), "last": rfc3339(count.last),
            })
        return out
