"""`run --workers N` with a control API: the supervisor owns the API and the registry, and every
worker holds a copy, kept equal by applying the same ops in the same order.

Each worker has a socketpair to the supervisor (its end's fd in `CONTROL_FD_ENV`). The supervisor
sends one JSON line per message: first a snapshot (`{"snapshot": ...}`, everything registered,
as ops: gateway/registry.py `snapshot`), then one line per change (`{"seq": N, "ops": [...]}`);
the worker answers each with its sequence number once the ops are in force (and the open
connections they touched were judged again). `Fanout.publish` returns when every worker has
answered, so a change is in force everywhere when the API call returns:

- a worker that has served before and does not answer within `ACK_TIMEOUT` is killed (its
  connections are reset) and restarted by the supervisor with a fresh snapshot: no worker goes on
  deciding by a registry that is behind;
- a worker still starting is not waited for beyond the timeout (it is reported as pending): it
  reads the snapshot and then every queued op, in order, before it judges anything.

A worker started again gets the snapshot of the moment it is started, and every op after it.
Nothing here knows mitmproxy; the worker's side is `WorkerLink`, used by addons/control.py.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

from .registry import Registry

logger = logging.getLogger("egress")

CONTROL_FD_ENV = "EGRESS_CONTROL_FD"  # a worker's end of its control socketpair
CONTROL_LISTEN_ENV = "EGRESS_CONTROL_LISTEN"  # the supervisor's TCP control address (workers guard it)
ACK_TIMEOUT = 10.0


class _Link:
    """The supervisor's end of one worker's socketpair: a sender thread (a slow reader never
    blocks the API thread), a reader thread for the acknowledgements."""

    def __init__(self, index: int, sock: socket.socket, first: bytes, seq: int):
        self.index = index
        self.sock = sock
        self.acked = -1
        self.snapshot_seq = seq
        self.alive = True
        self.cond = threading.Condition()
        self.out: queue.Queue[bytes | None] = queue.Queue()
        self.out.put(first)
        self.sender = threading.Thread(target=self._send, name=f"egress-control-out-{index}", daemon=True)
        self.reader = threading.Thread(target=self._read, name=f"egress-control-in-{index}", daemon=True)
        self.sender.start()
        self.reader.start()

    def _send(self) -> None:
        while (data := self.out.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError:
                self._dead()
                return

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._dead()
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            if lines:
                with self.cond:
                    self.acked = max([self.acked] + [int(line) for line in lines if line.strip().isdigit()])
                    self.cond.notify_all()

    def _dead(self) -> None:
        with self.cond:
            self.alive = False
            self.cond.notify_all()

    def wait(self, seq: int, deadline: float) -> bool:
        with self.cond:
            while self.alive and self.acked < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return self.acked >= seq

    def close(self) -> None:
        self.out.put(None)
        self._dead()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Fanout:
    """The supervisor's side: `attach` a worker being started, `publish` ops to all, `detach` one
    that exited. `lock` must be the control service's (a start and a change never interleave)."""

    def __init__(self, registry: Registry, lock, served: Callable[[int], bool], kill: Callable[[int], None],
                 timeout: float = ACK_TIMEOUT):
        self.registry = registry
        self.lock = lock
        self.served = served  # has worker `index` ever listened (a late answer then means it is stuck)
        self.kill = kill
        self.timeout = timeout
        self.links: dict[int, _Link] = {}
        self.wake = threading.Event()  # the expiry timer: a change may have brought a deadline nearer

    def attach(self, index: int) -> int:
        """A socketpair for worker `index` (about to be started); the fd to pass to it. Its first
        message is the snapshot of this moment."""
        with self.lock:
            self.detach(index)
            ours, theirs = socket.socketpair()
            snapshot = self.registry.snapshot()
            first = json.dumps({"snapshot": snapshot}, separators=(",", ":")).encode() + b"\n"
            self.links[index] = _Link(index, ours, first, snapshot["seq"])
            os.set_inheritable(theirs.fileno(), True)
            fd = os.dup(theirs.fileno())
            theirs.close()
            os.set_inheritable(fd, True)
            return fd

    def detach(self, index: int) -> None:
        link = self.links.pop(index, None)
        if link is not None:
            link.close()

    def publish(self, ops: list[dict]) -> int:
        """Apply `ops` here, send them to every worker, wait for each to have them in force. The
        number of workers that confirmed."""
        for op in ops:
            self.registry.apply(op)
        seq = self.registry.seq
        line = json.dumps({"seq": seq, "ops": ops}, separators=(",", ":")).encode() + b"\n"
        links = list(self.links.values())
        for link in links:
            link.out.put(line)
        self.wake.set()
        deadline = time.monotonic() + self.timeout
        confirmed = 0
        for link in links:
            if link.wait(seq, deadline):
                confirmed += 1
            elif link.alive and self.served(link.index):
                logger.error("egress gateway: worker %d did not apply control change %d within %.0fs; killing it "
                             "(it is restarted with the current registrations)", link.index, seq, self.timeout)
                self.kill(link.index)
        return confirmed


class ExpiryTimer:
    """The supervisor's timer: at each deadline, `expire()` (the control service's) ends what ran
    out and publishes it like any change. `wake` (set by every publish) brings the next look forward."""

    def __init__(self, expire: Callable[[], float | None], wake: threading.Event, clock=time.monotonic):
        self.expire = expire
        self.wake = wake
        self.clock = clock
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="egress-control-expiry", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def _run(self) -> None:
        while not self.stopping:
            try:
                deadline = self.expire()
            except Exception:
                logger.exception("egress gateway: ending expired registrations failed")
                deadline = self.clock() + 1.0
            self.wake.clear()
            wait = 60.0 if deadline is None else max(0.0, deadline - self.clock())
            self.wake.wait(min(wait, 60.0))


class WorkerLink:
    """The worker's end: the snapshot (blocking, once), then batches of ops as they arrive."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.fd = fd
        self._buffer = b""

    def read_snapshot(self) -> dict:
        self.sock.setblocking(True)
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise OSError("the supervisor closed the control link")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.sock.setblocking(False)
        return json.loads(line)["snapshot"]

    def read_batches(self) -> list[tuple[int, list[dict]]] | None:
        """Every whole message readable now; None when the supervisor closed the link."""
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                return None
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        out = []
        for line in lines:
            if line.strip():
                message = json.loads(line)
                out.append((int(message["seq"]), message["ops"]))
        return out

    def ack(self, seq: int) -> None:
        self.sock.setblocking(True)
        try:
            self.sock.sendall(f"{seq}\n".encode())
        finally:
            self.sock.setblocking(False)
