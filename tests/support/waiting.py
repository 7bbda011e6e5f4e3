"""The one `wait_for` of the suites: poll an observable condition (an audit line, a metric, a file)
until it holds. It synchronises on the event itself; the timeout only bounds a failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 5.0, what: str = "condition", interval: float = 0.05,
             detail: Callable[[], str] | None = None) -> T:
    """predicate()'s first truthy value; AssertionError after `timeout` seconds, naming `what` (and
    `detail()`, e.g. the gateway's log, computed only then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)
