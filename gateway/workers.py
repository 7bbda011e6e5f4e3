"""`run --workers N`: one supervisor process, N gateway worker processes on the same port(s).

mitmproxy runs one asyncio loop per process, so one process uses one core. The supervisor starts N
full gateways (workers) that listen on the same addresses with SO_REUSEPORT, so the kernel spreads
new connections across them. A connection lives and dies in one worker, and the gateway keeps no
state between connections, so nothing has to be shared but:

- the CA and the placeholder key in the confdir: created by the supervisor before any worker
  starts (N workers creating them at once would each make their own);
- the policy: every worker loads the same file and polls it; SIGHUP to the supervisor is passed
  on to every worker;
- the metrics: prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a fresh directory
  per supervisor); every worker serves the sum on the shared metrics port;
- the audit log: every worker writes its lines down a pipe of its own to the supervisor, the one
  writer of the file, which chains and rotates the one stream (gateway.audit.AuditLog.append_line).
  When a write fails (disk full), the supervisor keeps the line (and those behind it) in memory and
  raises a shared one-byte flag (an unlinked file every worker maps, `STATE_FD_ENV`): from then on
  every worker fails its decisions closed, as one process does. The supervisor retries every
  POLL_SECONDS; once the held lines and an `audit_log` line are written, it lowers the flag.
  The lines a worker sent before it saw the flag are not lost but late (see docs/faults.md).

A worker that dies is started again (with a back-off when it keeps dying young); the others keep
serving. SIGTERM/SIGINT drain every worker and exit 0 when all have. Workers die with the
supervisor (PR_SET_PDEATHSIG), and a worker whose audit pipe breaks fails its decisions closed.

Nothing here knows mitmproxy: a worker is a command line (`worker_command`).
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .audit import STATE_FD_ENV, AuditLog

logger = logging.getLogger("egress")

WORKER_ENV = "EGRESS_WORKER_INDEX"  # set in each worker's environment: its index (0-based)
WORKERS_ENV = "EGRESS_WORKERS"  # the default for --workers
SUPERVISOR_ENV = "EGRESS_SUPERVISOR_PID"  # set in each worker's environment
READY_FD_ENV = "EGRESS_READY_FD"  # a worker writes one byte there once it listens
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
MAX_WORKERS = 256

YOUNG_SECONDS = 10.0  # a worker that dies younger than this is restarted with a growing delay
MAX_BACKOFF_SECONDS = 30.0
POLL_SECONDS = 0.1
# Worker lines held while the audit file cannot be written: what the workers sent before they saw
# the flag (bounded by what they decide in that instant). Beyond either bound, lines are lost,
# counted (`held_dropped`, and in the `audit_log` line that ends the outage) and logged.
MAX_HELD_LINES = 100_000
MAX_HELD_BYTES = 64 * 1024 * 1024  # lines are up to 8 KiB (gateway/audit.py MAX_LINE_BYTES)


def worker_index() -> int | None:
    """This process's index when it is a worker of `run --workers N` (N > 1), else None."""
    value = os.environ.get(WORKER_ENV, "")
    return int(value) if value.isdigit() else None


def usable_cpus() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (containers:
    Kubernetes `limits.cpu` shows up as a quota, not as fewer visible cores)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def _cgroup_cpu_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "150000 100000"
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def notify_ready() -> None:
    """In a worker: tell the supervisor this worker listens (once; a no-op elsewhere)."""
    value = os.environ.pop(READY_FD_ENV, "")
    if value.isdigit():
        try:
            os.write(int(value), b"r")
            os.close(int(value))
        except OSError:
            pass


def default_workers() -> int:
    """--workers when not given: $EGRESS_WORKERS, else the usable cores."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        if not value.isdigit() or not 1 <= int(value) <= MAX_WORKERS:
            raise ValueError(f"{WORKERS_ENV}={value!r}: expected a number from 1 to {MAX_WORKERS}")
        return int(value)
    return usable_cpus()


def bind_to_supervisor(sig: int = signal.SIGTERM) -> bool:
    """In a worker: get `sig` when the supervisor dies (Linux PR_SET_PDEATHSIG), so no worker
    outlives it. False if the supervisor is already gone (the worker should exit)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    expected = os.environ.get(SUPERVISOR_ENV, "")
    return not expected.isdigit() or os.getppid() == int(expected)


@dataclass
class Worker:
    index: int
    process: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = 0.0
    restart_at: float | None = None
    reader: threading.Thread | None = None
    exits: list[int] = field(default_factory=list)
    ready_fd: int | None = None  # read end of the readiness pipe, until the worker said it listens
    ever_ready: bool = False  # it has listened at least once: a later death is not a start-up failure
    serving: bool = False  # its current process has listened (a restarted one: not yet, until it says so)


class Supervisor:
    """Starts, watches and restarts the workers; owns the audit file and the metrics directory.

    `worker_command(index, audit_fd)` returns the argv of worker `index`; `audit_fd` is the write
    end of its audit pipe (None without an audit log)."""

    def __init__(self, count: int, worker_command: Callable[[int, int | None], list[str]], *,
                 audit: AuditLog | None = None, drain_timeout: float = 10.0, env: dict[str, str] | None = None,
                 control=None):
        self.count = count
        # The control API's fan-out (gateway/control_fanout.py Fanout), when there is one: every
        # worker started gets a link to it (`attach`), every worker that exits loses it (`detach`).
        self.control = control
        self.worker_command = worker_command
        self.audit = audit
        self.drain_timeout = drain_timeout
        self.env = dict(os.environ if env is None else env)
        self.workers = [Worker(i) for i in range(count)]
        self.metrics_dir = tempfile.mkdtemp(prefix="egress-metrics-")
        self.env[MULTIPROC_ENV] = self.metrics_dir
        self.stopping = False
        self.audit_errors = 0  # worker lines lost (malformed, or beyond MAX_HELD_LINES): logged
        self._signals: list[int] = []
        self.on_sighup: list = []  # called on SIGHUP, before it is passed on (the control API's policy view)
        self._audit_lock = threading.Lock()
        self.held: list[str] = []  # worker lines not written yet: the audit file is failing
        self.max_held_lines, self.max_held_bytes = MAX_HELD_LINES, MAX_HELD_BYTES
        self.held_total = 0  # lines ever held (written late)
        self.held_bytes = 0  # bytes of the lines in `held`
        self.held_dropped = 0  # lines lost past MAX_HELD_LINES or MAX_HELD_BYTES during this outage
        self._held_since = 0.0
        self._state_file = None
        self._state: mmap.mmap | None = None  # the flag workers read: 0 writable, else an errno
        if audit is not None and audit.target is not None:
            self._state_file = tempfile.TemporaryFile(prefix="egress-audit-state-")
            self._state_file.write(b"\0")
            self._state_file.flush()
            self._state = mmap.mmap(self._state_file.fileno(), 1, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    # --- running -----------------------------------------------------------------------------------

    def run(self) -> int:
        """Until SIGTERM/SIGINT (exit 0 when every worker drained) or a start-up failure (exit 1)."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        if hasattr(signal, "SIGPIPE"):
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        try:
            for worker in self.workers:
                self._start(worker)
            logger.info("egress gateway: supervisor (pid %d) running %d workers", os.getpid(), self.count)
            while not self.stopping:
                self._handle_signals()
                if self.stopping:
                    break
                self._check_ready()
                failed = self._reap()
                if failed is not None:
                    logger.error("egress gateway: worker %d failed at start-up (exit %s); stopping",
                                 failed.index, failed.exits[-1])
                    self._stop_all()
                    return 1
                self._restart_due()
                self._retry_audit()
                time.sleep(POLL_SECONDS)
            return self._stop_all()
        finally:
            self._cleanup()

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGHUP:
                self._reopen_audit()
                for listener in self.on_sighup:
                    try:
                        listener()
                    except Exception:
                        logger.exception("egress gateway: a SIGHUP listener failed")
                self._send_all(signal.SIGHUP)
            else:
                logger.info("egress gateway: %s: stopping %d workers", signal.Signals(signum).name, self.count)
                self.stopping = True

    def _reopen_audit(self) -> None:
        if self.audit is None or self.audit.target in (None, "-"):
            return
        try:
            with self._audit_lock:
                self.audit.reopen()
            logger.info("egress gateway: audit log %s reopened", self.audit.target)
        except OSError as exc:
            logger.error("egress gateway: cannot reopen audit log %s: %s", self.audit.target, exc.strerror)

    # --- workers -----------------------------------------------------------------------------------

    def _start(self, worker: Worker) -> None:
        worker.serving = False
        read_fd = write_fd = None
        if self.audit is not None and self.audit.target is not None:
            read_fd, write_fd = os.pipe()
        ready_read, ready_write = os.pipe()
        os.set_blocking(ready_read, False)
        env = dict(self.env, **{WORKER_ENV: str(worker.index), SUPERVISOR_ENV: str(os.getpid()),
                               READY_FD_ENV: str(ready_write)})
        state_fd = self._state_file.fileno() if self._state_file is not None and write_fd is not None else None
        if state_fd is not None:
            env[STATE_FD_ENV] = str(state_fd)
        control_fd = None
        if self.control is not None:
            from .control_fanout import CONTROL_FD_ENV

            control_fd = self.control.attach(worker.index)
            env[CONTROL_FD_ENV] = str(control_fd)
        try:
            worker.process = subprocess.Popen(
                self.worker_command(worker.index, write_fd), env=env,
                pass_fds=tuple(fd for fd in (write_fd, ready_write, state_fd, control_fd) if fd is not None),
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            for fd in (write_fd, ready_write, control_fd):  # the worker holds the only other ends
                if fd is not None:
                    os.close(fd)
        worker.ready_fd = ready_read
        worker.started = time.monotonic()
        worker.restart_at = None
        if read_fd is not None:
            worker.reader = threading.Thread(target=self._read_audit, args=(worker.index, read_fd),
                                             name=f"egress-audit-{worker.index}", daemon=True)
            worker.reader.start()
        logger.info("egress gateway: worker %d started (pid %d)", worker.index, worker.process.pid)

    def _read_audit(self, index: int, fd: int) -> None:
        """One worker's audit lines, into the one stream, whole lines only."""
        with open(fd, "rb") as pipe:
            for raw in pipe:
                if not raw.endswith(b"\n"):
                    logger.error("egress gateway: worker %d: partial audit line dropped", index)
                    continue
                try:
                    line = raw[:-1].decode("ascii")
                except UnicodeDecodeError:
                    line = None
                try:
                    if line is None:
                        raise ValueError("not ASCII")
                    self.append(line)
                except ValueError:
                    self.audit_errors += 1
                    logger.error("egress gateway: worker %d: malformed audit line dropped", index)

    def append(self, line: str) -> None:
        """One worker line into the file; if the file cannot be written, held (in order) and the
        workers told to fail closed. ValueError for a line that is not an audit line."""
        with self._audit_lock:
            if not self.audit_writable:  # failing: keep the order, the retry writes them all
                self._hold(line)
                return
            try:
                self.audit.append_line(line)
            except OSError as exc:
                self._set_state(exc.errno or errno.EIO)
                self._held_since = time.time()
                self._hold(line)
                logger.error("egress gateway: audit log write failed: %s; every worker now refuses its decisions "
                             "(500 internal_error) until it can be written again (the line is held, not lost)",
                             exc.strerror)

    def _hold(self, line: str) -> None:
        if len(self.held) >= self.max_held_lines or self.held_bytes + len(line) > self.max_held_bytes:
            self.audit_errors += 1
            self.held_dropped += 1
            if self.held_dropped == 1 or self.held_dropped % 1000 == 0:
                logger.error("egress gateway: audit log still failing: %d held lines (%d bytes) already; a "
                             "worker's line is lost (%d so far)", len(self.held), self.held_bytes, self.held_dropped)
            return
        self.held.append(line)
        self.held_bytes += len(line)
        self.held_total += 1

    def _set_state(self, code: int) -> None:
        if self._state is not None:
            self._state[0] = min(max(code, 1), 255) if code else 0

    @property
    def audit_writable(self) -> bool:
        return self._state is None or self._state[0] == 0

    def _retry_audit(self) -> None:
        """While the audit file is failing: write the held lines, then the line that ends the
        outage, then let the workers decide again. A write that fails leaves the rest held."""
        if self.audit is None or self.audit_writable:
            return
        with self._audit_lock:
            written = 0
            try:
                for line in self.held:
                    self.audit.append_line(line)
                    written += 1
                late = written
                dropped = self.held_dropped
                self.audit.recover(late_lines=late, dropped_lines=dropped, message=(
                    f"the audit log is writable again: {self.audit._outage_failures} write(s) failed since "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self._held_since))}; the {late} line(s) "
                    "above were held by the supervisor and written late (decided before the workers knew); "
                    "every other decision meanwhile was refused (500 internal_error)"
                    + (f"; {dropped} held line(s) were lost past the supervisor's bound" if dropped else "")))
            except OSError:
                return
            finally:
                self.held_bytes -= sum(len(line) for line in self.held[:written])
                del self.held[:written]
            self.held_dropped = 0
            self._set_state(0)
            logger.warning("egress gateway: audit log %s is writable again; %d held line(s) written, workers "
                           "decide again", self.audit.target, late)

    def _check_ready(self) -> None:
        for worker in self.workers:
            if worker.ready_fd is None:
                continue
            try:
                said = os.read(worker.ready_fd, 1)
            except BlockingIOError:
                continue
            os.close(worker.ready_fd)
            worker.ready_fd = None
            if said:
                worker.ever_ready = worker.serving = True
                if worker.restarts:
                    logger.info("egress gateway: worker %d (pid %d) is serving again", worker.index,
                                worker.process.pid if worker.process else -1)

    def _reap(self) -> Worker | None:
        """Notice workers that exited; schedule their restart. Returns a worker of the first
        generation that died before it ever listened (a port in use, a bad option: restarting
        would not help, so the supervisor stops)."""
        for worker in self.workers:
            process = worker.process
            if process is None or process.poll() is None:
                continue
            self._check_ready()
            code = process.returncode
            worker.exits.append(code)
            worker.process = None
            if worker.ready_fd is not None:
                os.close(worker.ready_fd)
                worker.ready_fd = None
            starting = not worker.ever_ready and worker.restarts == 0
            self._forget_metrics(process.pid)
            if self.control is not None:
                self.control.detach(worker.index)
            if worker.reader is not None:
                worker.reader.join(timeout=2)
                worker.reader = None
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.Signals._value2member_map_ \
                else f"status {code}"
            if starting:
                return worker
            lifetime = time.monotonic() - worker.started
            worker.backoff = min(MAX_BACKOFF_SECONDS, max(0.5, worker.backoff * 2)) if lifetime < YOUNG_SECONDS else 0.0
            worker.restart_at = time.monotonic() + worker.backoff
            worker.restarts += 1
            logger.warning("egress gateway: worker %d (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                           worker.index, process.pid, how, lifetime, worker.backoff)
        return None

    def _restart_due(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.process is None and worker.restart_at is not None and now >= worker.restart_at:
                try:
                    self._start(worker)
                except OSError as exc:
                    worker.backoff = min(MAX_BACKOFF_SECONDS, max(0.5, worker.backoff * 2))
                    worker.restart_at = now + worker.backoff
                    logger.error("egress gateway: cannot start worker %d: %s", worker.index, exc)

    def _forget_metrics(self, pid: int) -> None:
        """A dead worker's live gauges (open connections) must not count any more; its counters do."""
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.metrics_dir)
        except Exception:  # noqa: BLE001  (metrics are best effort; serving goes on)
            logger.debug("egress gateway: could not clear metrics of pid %d", pid, exc_info=True)

    def record(self, **fields) -> None:
        """A line of the supervisor's own (the control API's `event: control`), into the one stream."""
        if self.audit is None or self.audit.target is None:
            return
        import json

        entry = AuditLog(None).record(**fields)
        self.append(json.dumps(entry, ensure_ascii=True, separators=(",", ":"), default=str))

    def served(self, index: int) -> bool:
        """Whether worker `index`'s current process listens: one still starting (a first start or a
        restart, loading its snapshot) is waited for, not killed as stuck (review 24)."""
        return self.workers[index].serving

    def kill(self, index: int) -> None:
        process = self.workers[index].process
        if process is not None and process.poll() is None:
            process.kill()

    def _send_all(self, sig: int) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                try:
                    worker.process.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _stop_all(self) -> int:
        """SIGTERM every worker (each drains), wait, then kill what is left. 0 if all exited 0."""
        self._send_all(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout + 5.0
        status = 0
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("egress gateway: worker %d did not stop in time; killing it", worker.index)
                process.kill()
                process.wait(5)
            if process.returncode != 0:
                status = 1
            if worker.reader is not None:
                worker.reader.join(timeout=5)
        logger.info("egress gateway: all workers stopped")
        return status

    def _cleanup(self) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.kill()
        if self.audit is not None:
            self._retry_audit()
            if self.held:
                logger.error("egress gateway: audit log %s still not writable: %d held worker line(s) lost",
                             self.audit.target, len(self.held))
            self.audit.close()
        if self._state is not None:
            self._state.close()
            self._state_file.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def log_to_stderr(quiet: bool) -> None:
    """The supervisor's own log lines, in the workers' format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s.%(msecs)03d] %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.INFO)
