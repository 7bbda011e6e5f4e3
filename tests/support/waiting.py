"""The one `wait_for` of the suites: wait until an observable condition (an audit line, a metric, a
file, a request an origin recorded) holds. It synchronises on the event itself; the timeout only
bounds a failure, so a slow machine makes a test slower, never wrong.

Two ways to learn of the event, one function:
- polling (the default): `predicate()` is re-evaluated every `interval` seconds, for state another
  process owns (the gateway's audit log, its metrics, a socket's peer);
- a condition (`cond=`, a `threading.Condition` the producer notifies at every change, e.g. a
  `Recorder`'s): `predicate()` is evaluated with the condition's lock held, at start and after each
  notification, so the wait ends at the change itself and nothing polls."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 5.0, what: str = "condition", interval: float = 0.05,
             detail: Callable[[], str] | None = None, cond: threading.Condition | None = None) -> T:
    """predicate()'s first truthy value; AssertionError after `timeout` seconds, naming `what` (and
    `detail()`, e.g. the gateway's log, computed only then). With `cond`, woken by its notifications
    instead of every `interval` (see the module's docstring)."""
    deadline = time.monotonic() + timeout
    if cond is not None:
        with cond:
            while not (value := predicate()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                cond.wait(remaining)
            else:
                return value
    else:
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                break
            time.sleep(interval)  # the polling interval, not synchronisation: the predicate is re-read
    extra = f"\n{detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")


def value_when(read: Callable[[], T], done: Callable[[T], object], timeout: float = 5.0,
               interval: float = 0.05) -> T:
    """read()'s value once done(value) holds, or its last value after `timeout` seconds, for callers
    whose own assertion on the value says best what is missing (a count, a metric, a status)."""
    last: list[T] = []

    def reached():
        last[:] = [read()]
        return (last[0],) if done(last[0]) else None

    try:
        return wait_for(reached, timeout, interval=interval)[0]
    except AssertionError:
        return last[0]


def unacknowledged(sock: socket.socket) -> int:
    """Bytes of `sock`'s send queue the peer has not acknowledged yet (Linux's TIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def wait_until_sent(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once every byte written to `sock` has reached the peer's kernel, what a close or a
    reset that follows must not overtake (a reset drops what is still queued); False after
    `timeout` (a peer that stopped reading), for the caller to assert on or to go on regardless."""
    return value_when(lambda: unacknowledged(sock), lambda queued: queued == 0, timeout, interval=0.01) == 0
