"""The audit log: one JSON object per line per decision, flushed as it is written.

Keys are stable (documented in docs/audit-log.md); a key with no value is written as null rather
than left out, so that SIEM parsers see one shape. Values come from the sandbox, so they are
length-capped and only ever serialised by json.dumps (no format strings, no log injection).
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import UTC, datetime
from typing import IO, Any

FIELDS = (
    "time",
    "event",
    "client",
    "sandbox",
    "mode",
    "decision",
    "reason",
    "status",
    "rule",
    "host",
    "port",
    "address",
    "original_destination",
    "sni",
    "host_header",
    "method",
    "scheme",
    "path",
    "message",
)
MAX_VALUE_LENGTH = 2048


def _clip(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_VALUE_LENGTH:
        return value[:MAX_VALUE_LENGTH] + "…"
    return value


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AuditLog:
    """Writes decisions to a file (appending) or to stdout ("-"); None disables it."""

    def __init__(self, target: str | None):
        self.target = target
        self._lock = threading.Lock()
        self._stream: IO[str] | None = None
        self.lines_written = 0
        self.open()

    def open(self) -> None:
        if self.target is None:
            self._stream = None
        elif self.target == "-":
            self._stream = sys.stdout
        else:
            self._stream = open(self.target, "a", encoding="utf-8", buffering=1)

    def reopen(self) -> None:
        """For log rotation: close and reopen the same path."""
        with self._lock:
            if self._stream is not None and self._stream is not sys.stdout:
                self._stream.close()
            self.open()

    def close(self) -> None:
        with self._lock:
            if self._stream is not None and self._stream is not sys.stdout:
                self._stream.close()
            self._stream = None

    def record(self, **values: Any) -> dict[str, Any]:
        entry = {key: _clip(values.get(key)) for key in FIELDS}
        entry["time"] = values.get("time") or now_rfc3339()
        for key, value in values.items():
            if key not in entry:
                entry[key] = _clip(value)
        if self._stream is not None:
            # ensure_ascii: sandbox text cannot carry raw U+2028/U+2029/U+0085, which some log
            # shippers treat as line breaks.
            line = json.dumps(entry, ensure_ascii=True, separators=(",", ":"), default=str)
            with self._lock:
                self._stream.write(line + "\n")
                self._stream.flush()
                self.lines_written += 1
        return entry
