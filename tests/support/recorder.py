"""What a test origin (or client) saw, kept under one condition variable so that tests wait on the
event itself (a request recorded, a connection closed), never on a sleep.

`Recorder` is a thread-safe list of entries plus named counters: the origin's threads `add()` and
`count()`; the test `wait_for(predicate)` or `wait_count(n)`, each of which returns as soon as the
condition holds, or once `timeout` has passed (then with a falsy value, so a test can assert on it,
or check that something did not happen within a window it names)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

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

    def wait_for(self, predicate: Callable[[list[T]], R], timeout: float = WAIT) -> R:
        """predicate(entries)'s first truthy value, re-checked at every change; its last (falsy)
        value once `timeout` has passed."""
        with self.cond:
            value = predicate(self._entries)
            if not value:
                self.cond.wait_for(lambda: predicate(self._entries), timeout)
                value = predicate(self._entries)
            return value

    def wait_count(self, n: int, name: str | None = None, timeout: float = WAIT) -> bool:
        """True once there are `n` entries (or the counter `name` has reached `n`)."""
        with self.cond:
            if name is None:
                return self.cond.wait_for(lambda: len(self._entries) >= n, timeout)
            return self.cond.wait_for(lambda: self._counts[name] >= n, timeout)
