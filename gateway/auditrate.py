"""Aggregating repeated refusals, so that a flood of refusals cannot fill the disk or drown the log.

Pure logic (no I/O, injectable clock); gateway.audit.AuditLog writes what it returns.

Every refusal (an audit entry with `decision: "deny"`) belongs to a *source*: its sandbox id, or
the client's IP address when no sandbox entry covers it. Per source, per window of `window`
seconds (starting at the source's first refusal), the first `per_source` refusal lines are written
verbatim, and of those at most `per_key` per key (event, reason, rule, host). The refusals after
that are only counted, per key; when the window ends (noticed on the next record, or on the audit
log's one-second maintenance tick) each key with a count becomes ONE summary line,
`event: "suppressed"`, carrying `count` and the window. Allows and `would_deny` lines are never
aggregated: every request that left keeps its own line.

Memory is bounded: at most `max_sources` sources have a window open (more share one overflow
source, `*`), at most `max_keys` keys per source are counted apart (more are counted per (event,
reason), then all together), and summaries that could not be written are kept up to
`max_unwritten` (the oldest beyond that are dropped, and counted in `lost`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

WINDOW_SECONDS = 1.0
DEFAULT_PER_SOURCE = 50  # refusal lines per second per sandbox (or client address) written verbatim
DEFAULT_PER_KEY = 10  # of which per (event, reason, rule, host)
MAX_SOURCES = 1024
MAX_KEYS = 32
MAX_UNWRITTEN = 4096
OVERFLOW_SOURCE = "*"
SUPPRESSED_EVENT = "suppressed"

Key = tuple[Any, Any, Any, Any]  # (event, reason, rule, host)


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def source_of(entry: dict[str, Any]) -> str:
    """The sandbox id, else the client's address without its port ('?' when unknown)."""
    sandbox = entry.get("sandbox")
    if isinstance(sandbox, str) and sandbox:
        return "sandbox:" + sandbox
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


@dataclass
class _Source:
    start: float
    written: int = 0
    per_key: dict[Key, int] = field(default_factory=dict)
    counts: dict[Key, _Count] = field(default_factory=dict)


_SAMPLED = ("client", "sandbox", "mode", "status", "port")


class RefusalAggregator:
    def __init__(self, per_source: int = DEFAULT_PER_SOURCE, per_key: int = DEFAULT_PER_KEY, *,
                 window: float = WINDOW_SECONDS, clock: Callable[[], float] = time.time,
                 max_sources: int = MAX_SOURCES, max_keys: int = MAX_KEYS, max_unwritten: int = MAX_UNWRITTEN):
        if per_source < 1 or per_key < 1 or window <= 0:
            raise ValueError("per_source and per_key must be >= 1, window > 0")
        self.per_source, self.per_key, self.window = per_source, per_key, window
        self.clock = clock
        self.max_sources, self.max_keys, self.max_unwritten = max_sources, max_keys, max_unwritten
        self._sources: dict[str, _Source] = {}  # insertion order == window start order
        self._unwritten: list[dict[str, Any]] = []  # summaries a write failed for: first out next time
        self._lock = threading.Lock()
        self.suppressed = 0  # refusal lines not written verbatim (counted in summaries)
        self.lost = 0  # suppressed refusals whose summary was dropped (max_unwritten)

    def configure(self, per_source: int, per_key: int) -> None:
        if per_source < 1 or per_key < 1:
            raise ValueError("per_source and per_key must be >= 1")
        self.per_source, self.per_key = per_source, per_key

    @property
    def sources(self) -> int:
        return len(self._sources)

    def admit(self, entry: dict[str, Any]) -> bool:
        """True: write this entry as it is. False: it is a refusal over its source's budget, counted
        in a summary instead. Call `due()` first (it closes the windows that ended)."""
        if entry.get("decision") != "deny":
            return True
        now = self.clock()
        with self._lock:
            name = source_of(entry)
            source = self._sources.get(name)
            if source is not None and not (source.start <= now < source.start + self.window):
                self._close(name, source, now)
                source = None
            if source is None:
                if len(self._sources) >= self.max_sources:
                    name = OVERFLOW_SOURCE
                    source = self._sources.get(name)
                if source is None:
                    source = self._sources[name] = _Source(now)
            key: Key = (entry.get("event"), entry.get("reason"), entry.get("rule"), entry.get("host"))
            if source.written < self.per_source and source.per_key.get(key, 0) < self.per_key:
                source.written += 1
                source.per_key[key] = source.per_key.get(key, 0) + 1
                return True
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
            self.suppressed += 1
            return False

    def due(self) -> list[dict[str, Any]]:
        """The summaries to write now: any left unwritten, then those of every window that ended."""
        now = self.clock()
        with self._lock:
            while self._sources:
                name, source = next(iter(self._sources.items()))
                if source.start <= now < source.start + self.window:
                    break
                self._close(name, source, now)
            return self._take()

    def drain(self) -> list[dict[str, Any]]:
        """Every pending summary now, windows still open included (shutdown, reopen, rotation); the
        windows stay open, so what is over budget stays suppressed until they end."""
        now = self.clock()
        with self._lock:
            for name, source in self._sources.items():
                if source.counts:
                    self._unwritten.extend(self._summaries(name, source, source.start, now))
                    source.counts = {}
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

    def _close(self, name: str, source: _Source, now: float) -> None:
        del self._sources[name]
        if source.counts:
            self._unwritten.extend(self._summaries(name, source, source.start, min(now, source.start + self.window)))

    def _summaries(self, name: str, source: _Source, start: float, end: float) -> list[dict[str, Any]]:
        out = []
        for (event, reason, rule, host), count in source.counts.items():
            who = "every other source (too many at once)" if name == OVERFLOW_SOURCE else \
                f"sandbox {count.sample.get('sandbox')}" if name.startswith("sandbox:") else f"client {name[7:]}"
            what = f"{event} refusals ({reason})" if event else "refusals"
            where = f" to {host}" if host else ""
            out.append({
                "time": rfc3339(end), "event": SUPPRESSED_EVENT,
                "client": None if name == OVERFLOW_SOURCE or name.startswith("sandbox:") else name[7:],
                "sandbox": count.sample.get("sandbox"), "mode": count.sample.get("mode"), "decision": "deny",
                "reason": reason, "status": count.sample.get("status"), "rule": rule, "host": host,
                "port": count.sample.get("port") if host else None,
                "message": f"{count.count} more {what} from {who}{where} were not written one by one "
                           f"(over {self.per_source} refusal lines per second per source, {self.per_key} per kind)",
                "suppressed_event": event, "count": count.count,
                "window_start": rfc3339(start), "window_end": rfc3339(end),
                "first": rfc3339(count.first), "last": rfc3339(count.last),
            })
        return out
