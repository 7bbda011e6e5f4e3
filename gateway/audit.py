"""The audit log: one JSON object per line per decision, written and flushed as it is decided.

Keys are stable (documented in docs/audit-log.md); a key with no value is written as null rather
than left out, so that SIEM parsers see one shape. Values come from the sandbox, so they are
length-capped and only ever serialised by json.dumps (no format strings, no log injection).

Operations (all optional, see docs/audit-log.md):
- `reopen()` closes and reopens the path, for external rotation (the gateway calls it on SIGHUP);
- size-based rotation (`max_bytes`, keeping `backups` old files `PATH.1` ... `PATH.K`);
- hash chaining (`chain`): every line ends with `"prev"`, the SHA-256 (hex) of the previous line's
  exact bytes (without its newline); the first line of a fresh chain has 64 zeros. A file appended
  to continues from its own last line; a file started by rotation or reopen continues from the last
  line this process wrote. `verify_chain` checks such files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
CHAIN_KEY = "prev"  # reserved: written last on every line when chaining
GENESIS = "0" * 64  # "prev" of the first line of a chain
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TAIL_BLOCK = 64 * 1024


def _clip(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_VALUE_LENGTH:
        return value[:MAX_VALUE_LENGTH] + "…"
    return value


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
                  scrub: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        with self._lock:
            self._configure(chain, max_bytes, backups)
            if scrub is not None:
                self.scrub = scrub

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
        cannot be opened, the old file stays in use (nothing is lost) and the error is raised."""
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
        # ensure_ascii: sandbox text cannot carry raw U+2028/U+2029/U+0085, which some log
        # shippers treat as line breaks; it also makes every line pure ASCII (bytes == characters).
        line = json.dumps(entry, ensure_ascii=True, separators=(",", ":"), default=str)
        prev = self._emit(line)
        if prev is not None:
            entry[CHAIN_KEY] = prev
        return entry

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
    so decisions fail closed. Target `fd:N`."""

    def __init__(self, target: str):
        self.fd = int(target[3:])
        super().__init__(target)

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
