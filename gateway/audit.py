"""The audit log: one JSON object per line per decision, written and flushed as it is decided.

Keys are stable (documented in docs/audit-log.md); a key with no value is written as null rather
than left out, so that SIEM parsers see one shape. Values come from the sandbox, so they are
length-capped and only ever serialised by json.dumps (no format strings, no log injection).

Operations (all optional, see docs/audit-log.md):
- `reopen()` closes and reopens the path, for external rotation (the gateway calls it on SIGHUP);
- size-based rotation (`max_bytes`, keeping `backups` old files `PATH.1` ... `PATH.K`);
- refusal aggregation (`refusals`, gateway.auditrate): past a per-sandbox budget of refusal lines
  per second, repeated refusals are counted and written as one `suppressed` summary line;
- writability (`writable`, `failing_since`): a failed write is remembered until a write succeeds
  again; the first line after an outage is an `audit_log` line saying how many writes failed
  (`recover()`, also tried by `maintain()` every second, so a quiet gateway notices it too);
- hash chaining (`chain`): every line ends with `"prev"`, the SHA-256 (hex) of the previous line's
  exact bytes (without its newline); the first line of a fresh chain has 64 zeros. A file appended
  to continues from its own last line; a file started by rotation or reopen continues from the last
  line this process wrote. `verify_chain` checks such files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from .auditrate import RefusalAggregator, rfc3339

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
MAX_ITEMS = 32  # entries of a list (or keys of a dict) in a value; then one "+N more" entry
MAX_DEPTH = 4  # nesting kept in a value; deeper is written as "[nested]"
# No line a client can shape is larger than this (bytes, with "prev" and without the newline): the
# longest client-controlled values are shortened further and named in "truncated".
MAX_LINE_BYTES = 8 * 1024
TRUNCATED_KEY = "truncated"
_CHAIN_ROOM = len(',"prev":""') + 64
# Never shortened: the gateway's own words about the decision (short, and what a SIEM keys on).
_KEPT = frozenset(("time", "event", "decision", "reason", "status", "rule", "port", "count", "prev", TRUNCATED_KEY))
_MIN_KEPT = 32  # encoded bytes a shortened value keeps at least
CHAIN_KEY = "prev"  # reserved: written last on every line when chaining
GENESIS = "0" * 64  # "prev" of the first line of a chain
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TAIL_BLOCK = 64 * 1024
DEFAULT_MAX_BYTES = 100 * 1024 * 1024  # rotation is on by default for files: 100 MiB x 5 backups
DEFAULT_BACKUPS = 5
# `run --workers N`: the fd of the supervisor's one-byte state, mapped by each worker: 0 while the
# audit file is writable, else the errno of the supervisor's failed write (workers then fail closed).
STATE_FD_ENV = "EGRESS_AUDIT_STATE_FD"
RECOVERED_EVENT = "audit_log"

logger = logging.getLogger("egress")


class AuditWriteError(OSError):
    """The audit log could not be written (or is known unwritable): the decision fails closed.
    Expected while a disk is full, so callers log it without a traceback (addons/failclosed.py)."""


def _clip(value: Any, depth: int = 0) -> Any:
    """Cap a value: strings at MAX_VALUE_LENGTH characters, lists and dicts at MAX_ITEMS entries
    (then "+N more"), nesting at MAX_DEPTH. The line as a whole is capped by `_fit`."""
    if isinstance(value, str):
        return value[:MAX_VALUE_LENGTH] + "…" if len(value) > MAX_VALUE_LENGTH else value
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth >= MAX_DEPTH:
            return "[nested]"
        if isinstance(value, dict):
            out = {}
            for i, (k, v) in enumerate(value.items()):
                if i == MAX_ITEMS:
                    out["+more"] = f"+{len(value) - MAX_ITEMS} more"
                    break
                out[_clip(str(k))] = _clip(v, depth + 1)
            return out
        items = list(value) if not isinstance(value, (list, tuple)) else value
        out_list = [_clip(v, depth + 1) for v in items[:MAX_ITEMS]]
        if len(items) > MAX_ITEMS:
            out_list.append(f"+{len(items) - MAX_ITEMS} more")
        return out_list
    return value


def _dumps(value: Any) -> str:
    # ensure_ascii: sandbox text cannot carry raw U+2028/U+2029/U+0085, which some log
    # shippers treat as line breaks; it also makes every line pure ASCII (bytes == characters).
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), default=str)


def _shorten(value: Any, budget: int) -> Any:
    """`value` cut to about `budget` encoded bytes: a string keeps its start (and ends in "…"), a
    list its first entries (then "+N more"); anything else becomes its shortened JSON text."""
    budget = max(_MIN_KEPT, budget)
    if isinstance(value, list):
        out: list[Any] = []
        used = 2
        for i, item in enumerate(value):
            size = len(_dumps(item)) + 1
            if used + size + 12 > budget:
                out.append(f"+{len(value) - i} more")
                return out
            out.append(item)
            used += size
        return out
    text = value if isinstance(value, str) else _dumps(value)
    if len(_dumps(text)) <= budget:
        return text
    cut = text[:budget]
    while cut and len(_dumps(cut)) + 8 > budget:  # \uXXXX escapes: up to 6 bytes a character
        cut = cut[:max(0, len(cut) * budget // len(_dumps(cut)) - 8)]
    return cut + "…"


def _fit(entry: dict[str, Any], line: str, limit: int = MAX_LINE_BYTES) -> str:
    """The line, within `limit` bytes (with room for "prev"): past it, the longest values (client
    text: path, host_header, method_override, ...) are shortened, longest first, and named in
    `truncated`; `entry` is changed to match what is written."""
    room = limit - _CHAIN_ROOM
    if len(line) <= room:
        return line
    cut: list[str] = list(entry.get(TRUNCATED_KEY) or []) if isinstance(entry.get(TRUNCATED_KEY), list) else []
    for _ in range(4):
        # room for the "truncated" key itself, naming at most every field
        excess = len(line) - room + len(',"truncated":') + len(_dumps(cut + [k for k in entry if k not in cut]))
        sizes = sorted(((len(_dumps(v)), k) for k, v in entry.items() if k not in _KEPT and v is not None),
                       reverse=True)
        for size, key in sizes:
            if excess <= 0:
                break
            if size <= _MIN_KEPT + 8:
                continue
            entry[key] = _shorten(entry[key], size - excess)
            excess -= size - len(_dumps(entry[key]))
            if key not in cut:
                cut.append(key)
        entry[TRUNCATED_KEY] = cut
        line = _dumps(entry)
        if len(line) <= room:
            return line
    for key in list(entry):  # last resort (cannot happen with the value caps): only the verdict stays
        if key not in _KEPT:
            entry[key] = None
    entry[TRUNCATED_KEY] = ["*"]
    return _dumps(entry)


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def line_hash(line: bytes) -> str:
    """The chain hash of one line: SHA-256 hex of its exact bytes, without the newline."""
    return hashlib.sha256(line).hexdigest()


def last_line(path: str) -> bytes | None:
    """The last line of a file (without its newline; a partial last line as it is), None if empty."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return None
            pos = end
            tail = b""
            while pos > 0:
                step = min(_TAIL_BLOCK, pos)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
                body = tail[:-1] if tail.endswith(b"\n") else tail
                cut = body.rfind(b"\n")
                if cut >= 0:
                    return body[cut + 1:]
            return tail[:-1] if tail.endswith(b"\n") else tail
    except FileNotFoundError:
        return None


class AuditLog:
    """Writes decisions to a file (appending) or to stdout ("-"); None disables it.

    `chain`, `max_bytes` and `backups` may also be set later with `configure` (the gateway's
    options are applied after the log is opened)."""

    def __init__(self, target: str | None, *, chain: bool = False, max_bytes: int = 0, backups: int = 5):
        self.target = target
        self._lock = threading.Lock()
        self._stream: IO[Any] | None = None
        self._binary = False  # files are written as bytes (exact sizes for rotation and hashing)
        self._size = 0
        self.chain = False
        self.max_bytes = 0
        self.backups = 5
        self._prev: str | None = None  # hash of the last line of the chain, when chaining
        # Called with every record's values before they are written (and returned): returns them with
        # secret values replaced. Defence in depth: no caller should hand a secret to record() at all.
        self.scrub: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.lines_written = 0
        self.rotations = 0
        self._broken_line = False  # a write was cut short mid-line (e.g. disk full)
        # Refusal aggregation (None: every refusal gets its line); see gateway.auditrate.
        self.refusals: RefusalAggregator | None = None
        self.write_failures = 0  # writes that failed (each failed a decision closed, or held a line)
        self.failing_since: float | None = None  # wall time of the first failed write of an outage
        self._outage_failures = 0
        self.suppressed = 0  # refusals counted in a summary line instead of a line each
        self.max_line_bytes = MAX_LINE_BYTES
        self._refusals_total = 0  # see configure
        # The policy has a sandboxes section: refusals of clients no sandbox covers share one
        # aggregation source, as they share one rate limit (set by the gateway per record).
        self.sandboxed = False
        with self._lock:
            self._open()
            self._configure(chain, max_bytes, backups)

    # --- opening, closing, rotating ------------------------------------------------------------

    def open(self) -> None:
        with self._lock:
            self._open()

    def _open(self) -> None:
        self._binary = False
        if self.target is None:
            self._stream = None
        elif self.target == "-":
            self._stream = sys.stdout
        else:
            stream = open(self.target, "ab", buffering=0)
            size = os.fstat(stream.fileno()).st_size
            if size:
                with open(self.target, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        # A previous writer was cut short mid-line: end that line, so the next
                        # record starts on its own line (the partial line stays, as evidence).
                        stream.write(b"\n")
                        size += 1
            self._stream, self._binary, self._size = stream, True, size
            if self.chain:
                self._continue_chain()

    def _continue_chain(self) -> None:
        """prev for the next line: the file's own last line if it has one, else the last line this
        process wrote (a file started by rotation or reopen), else the start of a chain."""
        tail = last_line(self.target) if self._binary and self.target else None
        if tail is not None:
            self._prev = line_hash(tail)
        elif self._prev is None:
            self._prev = GENESIS

    def configure(self, *, chain: bool | None = None, max_bytes: int | None = None, backups: int | None = None,
                  scrub: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                  refusals_per_second: int | None = None, refusals_per_key: int | None = None,
                  refusals_total: int | None = None) -> None:
        """`refusals_per_second` (per sandbox or client address; 0: no aggregation),
        `refusals_per_key` (per event, reason, rule and host) and `refusals_total` (every source
        together; 0: no such budget) bound the refusal lines written."""
        with self._lock:
            self._configure(chain, max_bytes, backups)
            if scrub is not None:
                self.scrub = scrub
        if refusals_total is not None:
            if refusals_total < 0:
                raise ValueError("refusal line budgets must be >= 0")
            self._refusals_total = refusals_total
        if refusals_per_second is not None or refusals_per_key is not None or refusals_total is not None:
            per_source = refusals_per_second if refusals_per_second is not None else \
                (self.refusals.per_source if self.refusals else 0)
            per_key = refusals_per_key if refusals_per_key is not None else \
                (self.refusals.per_key if self.refusals else per_source)
            if per_source < 0 or per_key < 0:
                raise ValueError("refusal line budgets must be >= 0")
            if per_source == 0:
                if self.refusals is not None:
                    self._write_summaries(self.refusals.drain(), quiet=True)
                self.refusals = None
            elif self.refusals is None:
                self.refusals = RefusalAggregator(per_source, per_key or per_source, total=self._refusals_total)
            else:
                self.refusals.configure(per_source, per_key or per_source, self._refusals_total)

    def _configure(self, chain: bool | None, max_bytes: int | None, backups: int | None) -> None:
        if max_bytes is not None:
            if max_bytes < 0:
                raise ValueError("max_bytes must be >= 0")
            self.max_bytes = max_bytes
        if backups is not None:
            if backups < 1:
                raise ValueError("backups must be >= 1")
            self.backups = backups
        if chain is not None and chain != self.chain:
            self.chain = chain
            if chain:
                self._continue_chain()

    def reopen(self) -> None:
        """For log rotation: reopen the same path (a moved file is left to its mover). If the path
        cannot be opened, the old file stays in use (nothing is lost) and the error is raised.
        Pending refusal summaries go to the old file first."""
        if self.refusals is not None:
            self._write_summaries(self.refusals.drain(), quiet=True)
        with self._lock:
            old, old_binary, old_size = self._stream, self._binary, self._size
            self._stream = None
            try:
                self._open()
            except OSError:
                self._stream, self._binary, self._size = old, old_binary, old_size
                raise
            if old is not None and old is not sys.stdout and old is not self._stream:
                old.close()

    def close(self) -> None:
        """Pending refusal summaries are written first (shutdown)."""
        if self.refusals is not None and self._stream is not None:
            self._write_summaries(self.refusals.drain(), quiet=True)
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._stream is not None and self._stream is not sys.stdout:
            self._stream.close()
        self._stream = None

    def _rotate(self) -> None:
        """PATH -> PATH.1 -> ... -> PATH.K (the oldest is dropped), then a fresh PATH."""
        self._close()
        base = self.target
        assert base is not None
        for i in range(self.backups - 1, 0, -1):
            if os.path.exists(f"{base}.{i}"):
                os.replace(f"{base}.{i}", f"{base}.{i + 1}")
        try:
            os.replace(base, f"{base}.1")
        except FileNotFoundError:  # moved away by someone else already
            pass
        self.rotations += 1
        self._open()

    @property
    def head(self) -> str | None:
        """The hash of the last line of the chain (None when not chaining): record it elsewhere to
        detect lines removed from the end of the log."""
        return self._prev if self.chain else None

    # --- writing -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Is an audit log configured? (Without one, nothing needs building per decision.) A
        configured log that is not open right now still counts: record() then fails closed."""
        return self.target is not None

    def record(self, **values: Any) -> dict[str, Any]:
        if self.scrub is not None:
            try:
                values = self.scrub(values)
            except Exception:  # never write what could not be checked
                values = {k: v if k in ("time", "event") or not isinstance(v, (str, list, tuple)) else "[withheld]"
                          for k, v in values.items()}
        entry = {key: _clip(values.get(key)) for key in FIELDS}
        entry["time"] = values.get("time") or now_rfc3339()
        for key, value in values.items():
            if key not in entry:
                entry[key] = _clip(value)
        if self.target is None:
            return entry
        if self.chain:
            entry.pop(CHAIN_KEY, None)
        if self.failing_since is not None:
            self.recover()  # raises while the log is still unwritable: the decision fails closed
        refusals = self.refusals
        if refusals is not None:
            self._write_summaries(refusals.due())
            if not refusals.admit(entry, self.sandboxed):
                self.suppressed += 1
                return entry  # a refusal over its source's budget: counted in a summary line
        line = _fit(entry, _dumps(entry), self.max_line_bytes)
        prev = self._emit(line)
        if prev is not None:
            entry[CHAIN_KEY] = prev
        return entry

    def _serialise(self, values: dict[str, Any]) -> str:
        entry = {key: _clip(values.get(key)) for key in FIELDS}
        for key, value in values.items():
            if key not in entry and key != CHAIN_KEY:
                entry[key] = _clip(value)
        return _fit(entry, _dumps(entry), self.max_line_bytes)

    def _write_summaries(self, summaries: list[dict[str, Any]], quiet: bool = False) -> None:
        """Write refusal summaries (chained like any line); on a failed write the rest are kept for
        next time, and the error is raised (or logged, when `quiet`: shutdown, reopen)."""
        for i, summary in enumerate(summaries):
            try:
                self._emit(self._serialise(summary))
            except OSError as exc:
                if self.refusals is not None:
                    self.refusals.restore(summaries[i:])
                if not quiet:
                    raise
                logger.error("egress gateway: audit log: %d refusal summary line(s) not written: %s",
                             len(summaries) - i, exc.strerror)
                return

    def maintain(self) -> None:
        """Called about once a second: write the summaries of refusal windows that ended, and try
        the log again if it was failing (so that /readyz recovers without traffic)."""
        if self.target is None:
            return
        try:
            if self.failing_since is not None:
                self.recover()
            if self.refusals is not None:
                self._write_summaries(self.refusals.due())
        except OSError:
            pass  # still failing: counted, and said by `writable`

    @property
    def writable(self) -> bool:
        """False from a failed write until a write succeeds again."""
        return self.failing_since is None

    def recover(self, **extra: Any) -> None:
        """After failed writes: write the `audit_log` line that ends the outage (raises if it
        still cannot be written), and count the log as writable again."""
        since = self.failing_since
        if since is None:
            return
        failed = self._outage_failures
        values = {
            "time": now_rfc3339(), "event": RECOVERED_EVENT, "reason": "audit_writable",
            "message": f"the audit log is writable again: {failed} write(s) failed since {rfc3339(since)} (retries "
                       "included); every decision meanwhile was refused (500 internal_error), none went unrecorded",
            "failed_writes": failed, "failing_since": rfc3339(since),
        } | extra
        self._emit(self._serialise(values))
        self.failing_since = None
        self._outage_failures = 0
        logger.warning("egress gateway: audit log %s is writable again (%d write(s) failed)", self.target, failed)

    def _failed(self) -> None:
        self.write_failures += 1
        self._outage_failures += 1
        if self.failing_since is None:
            self.failing_since = time.time()

    def append_line(self, line: str) -> None:
        """Write a line another process built with record() (`--workers`: the workers' lines reach
        the supervisor's log through pipes). It must be one JSON object, nothing else; chaining and
        rotation happen here, so the one stream stays one chain."""
        if self.target is None:
            return
        try:
            value = json.loads(line)
        except ValueError:
            raise ValueError("not a JSON audit line") from None
        if not isinstance(value, dict) or not line.isascii() or "\n" in line:
            raise ValueError("not a JSON audit line")
        if CHAIN_KEY in value:
            raise ValueError("an audit line from a worker cannot carry its own chain")
        self._emit(line)

    def _emit(self, line: str) -> str | None:
        """Chain (if chaining), rotate (if due) and write one serialised line; returns its prev."""
        try:
            return self._emit_locked(line)
        except AuditWriteError:
            self._failed()
            raise
        except OSError as exc:
            self._failed()
            raise AuditWriteError(exc.errno, exc.strerror) from None

    def _emit_locked(self, line: str) -> str | None:
        prev = None
        with self._lock:
            if self._stream is None:
                # Configured but closed (shut down, or a failed open): open again, or raise, so
                # that the decision fails closed instead of going unrecorded.
                self._open()
            if self.chain:
                prev = self._prev or GENESIS
                line = f'{line[:-1]},"{CHAIN_KEY}":"{prev}"}}'
            if not self._binary:
                self._stream.write(line + "\n")
                self._stream.flush()
            else:
                data = line.encode("ascii") + b"\n"
                if self.max_bytes and self._size and self._size + len(data) > self.max_bytes:
                    self._rotate()
                if self._broken_line:
                    # The last write was cut short (disk full): end that line first, so this
                    # record parses on its own line.
                    data = b"\n" + data
                view = memoryview(data)
                try:
                    while view:  # unbuffered: each write goes straight to the kernel
                        written = self._stream.write(view)
                        view = view[written:]
                except OSError:
                    if len(view) != len(data):  # part of the line is on disk: take it back
                        try:
                            os.ftruncate(self._stream.fileno(), self._size)
                        except OSError:
                            self._broken_line = True
                    raise
                self._broken_line = False
                self._size += len(data)
            if self.chain:
                self._prev = line_hash(line.encode("ascii"))
            self.lines_written += 1
        return prev


class PipeAuditLog(AuditLog):
    """A worker's audit log (`--workers`): lines go down a pipe to the supervisor, which chains,
    rotates and writes them (AuditLog.append_line). A broken pipe (the supervisor is gone) raises,
    so decisions fail closed. Target `fd:N`.

    The supervisor cannot write a line it has not been sent yet, so it says whether its file is
    writable in a shared byte (`STATE_FD_ENV`, mapped here): while it is not 0 (the errno of the
    supervisor's failed write), every line raises before it is sent, and decisions fail closed
    just as they do without workers. One byte read per line; no round trip."""

    def __init__(self, target: str, state_fd: int | None = None):
        self.fd = int(target[3:])
        self._state: mmap.mmap | None = None
        if state_fd is None:
            value = os.environ.get(STATE_FD_ENV, "")
            state_fd = int(value) if value.isdigit() else None
        if state_fd is not None:
            self._state = mmap.mmap(state_fd, 1, mmap.MAP_SHARED, mmap.PROT_READ)
        super().__init__(target)

    @property
    def supervisor_errno(self) -> int:
        """0 while the supervisor can write the audit file, else the errno of its failed write."""
        return self._state[0] if self._state is not None else 0

    @property
    def writable(self) -> bool:
        return self.supervisor_errno == 0 and self.failing_since is None

    def _emit_locked(self, line: str) -> str | None:
        code = self.supervisor_errno
        if code:
            raise AuditWriteError(code, f"{os.strerror(code)} (the supervisor cannot write the audit log)")
        return super()._emit_locked(line)

    def recover(self, **extra: Any) -> None:
        """The supervisor writes the line that ends an outage: here the state only clears."""
        if self.failing_since is not None:
            code = self.supervisor_errno
            if code:
                raise AuditWriteError(code, f"{os.strerror(code)} (the supervisor cannot write the audit log)")
            self.failing_since = None
            self._outage_failures = 0

    def _open(self) -> None:
        if self._stream is None:
            self._stream = open(self.fd, "wb", buffering=0, closefd=False)
        self._binary, self._size = True, 0

    def _configure(self, chain: bool | None, max_bytes: int | None, backups: int | None) -> None:
        pass  # the supervisor chains and rotates the one stream

    def _rotate(self) -> None:
        pass

    def reopen(self) -> None:
        pass  # SIGHUP reopens the supervisor's file; the pipe stays

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
            self._stream = None


def open_audit_log(target: str | None) -> AuditLog:
    """The audit log for a target: a path, '-' (stdout), 'fd:N' (a worker's pipe) or None."""
    if target is not None and target.startswith("fd:") and target[3:].isdigit():
        return PipeAuditLog(target)
    return AuditLog(target)


# --- verification ------------------------------------------------------------------------------


@dataclass
class ChainReport:
    ok: bool
    lines: int  # lines checked (all of them when ok)
    head: str | None  # hash of the last good line
    path: str | None = None  # where the first problem is
    line: int | None = None  # its 1-based line number in that file
    problem: str | None = None

    def describe(self) -> str:
        if self.ok:
            return f"ok: {self.lines} lines" + (f", chain head {self.head}" if self.head else "")
        return f"{self.path}:{self.line}: {self.problem}"


def verify_chain(paths: Iterable[str], *, partial: bool = False, expect_head: str | None = None) -> ChainReport:
    """Check hash-chained audit files, given oldest first (`PATH.2 PATH.1 PATH`), as one chain.

    Reports the first bad line: a line that is not a JSON object, has no `prev`, or whose `prev` is
    not the hash of the line before it (that line was edited, or lines were dropped, inserted or
    reordered there); the first line must start a chain (64 zeros) unless `partial`; a last line
    without its newline is reported as truncated. Removing whole lines from the end is visible only
    against a head recorded elsewhere (`expect_head`)."""
    expected: str | None = None if partial else GENESIS
    count = 0
    head: str | None = expected  # an empty chain's head is where it starts
    path = None
    number = 0

    def bad(where: str, at: int, problem: str) -> ChainReport:
        return ChainReport(False, count, head, where, at, problem)

    for path in paths:
        number = 0
        with open(path, "rb") as f:
            for raw in f:
                number += 1
                if not raw.endswith(b"\n"):
                    return bad(path, number, "the last line is incomplete (no newline): the file was truncated "
                                             "or its last write was cut short")
                line = raw[:-1]
                try:
                    record = json.loads(line)
                except ValueError:
                    return bad(path, number, "not a JSON object (edited, or a write cut short by a crash)")
                if not isinstance(record, dict):
                    return bad(path, number, "not a JSON object")
                prev = record.get(CHAIN_KEY)
                if not isinstance(prev, str) or not _HEX64.match(prev):
                    return bad(path, number, f'no "{CHAIN_KEY}" hash: this line is not chained '
                                             "(written without --audit-chain, or edited)")
                if expected is not None and prev != expected:
                    if count == 0:
                        return bad(path, number, "the chain does not start here (prev is not 64 zeros): lines before "
                                                 "it were removed, or this file continues a rotated one (verify the "
                                                 "older files first, oldest first, or pass --partial)")
                    before = f"line {number - 1}" if number > 1 else "the last line of the previous file"
                    return bad(path, number, f"prev does not match the hash of {before}: that line was edited, or "
                                             "lines were removed, inserted or reordered here")
                expected = head = line_hash(line)
                count += 1
    if expect_head is not None and head != expect_head.lower():
        return bad(path or "-", number, f"the chain head is {head}, not the expected {expect_head}: lines at the end "
                                        "were removed or rewritten")
    return ChainReport(True, count, head)
