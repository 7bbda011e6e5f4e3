"""What a test origin (or client) saw, kept under one condition variable so that tests wait on the
event itself (a request recorded, a connection closed), never on a sleep.

`Recorder` is a thread-safe list of entries plus named counters: the origin's threads `add()` and
`count()`; the test `wait_count(n)`, which returns as soon as the condition holds (False once
`timeout` has passed, so a test can assert on it), or `tests.support.waiting.wait_for(predicate,
cond=recorder.cond)` for any other condition."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Generic, TypeVar

from tests.support.waiting import wait_for

T = TypeVar("T")

WAIT = 10.0


class Recorder(Generic[T]):
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._entries: list[T] = []
        self._counts: Counter[str] = Counter()

    def add(self, entry: T) -> None:
        with self.cond:
            self._entries.append(entry)
            self.cond.notify_all()

    def count(self, name: str, n: int = 1) -> int:
        """Add `n` to the counter `name` (connections opened, closed, bytes); its new value."""
        with self.cond:
            self._counts[name] += n
            self.cond.notify_all()
            return self._counts[name]

    def get(self, name: str) -> int:
        with self.cond:
            return self._counts[name]

    @property
    def entries(self) -> list[T]:
        with self.cond:
            return list(self._entries)

    def __len__(self) -> int:
        with self.cond:
            return len(self._entries)

    def clear(self) -> None:
        with self.cond:
            self._entries.clear()
            self._counts.clear()
            self.cond.notify_all()

    def wait_count(self, n: int, name: str | None = None, timeout: float = WAIT) -> bool:
        """True once there are `n` entries (or the counter `name` has reached `n`), woken by each
        change; False once `timeout` has passed (for `assert origin.wait_closed(1), "why"`)."""
        if name is None:
            reached = lambda: len(self._entries) >= n  # noqa: E731
        else:
            reached = lambda: self._counts[name] >= n  # noqa: E731
        try:
            return wait_for(reached, timeout, f"{n} {name or 'entries'}", cond=self.cond)
        except AssertionError:
            return False
