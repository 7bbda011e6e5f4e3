"""Sans-I/O steps: a generator that yields each costly call (a decoder's) as a zero-argument
callable instead of making it, and is sent back its result, or thrown its exception. The caller
chooses where the calls run: here and now (`run_steps`), or on a pool thread while the event loop
serves others (addons/decode_pool.py `drive`). Whatever the generator does between two calls runs
on the caller's thread."""

from __future__ import annotations

from collections.abc import Generator


def run_steps(steps: Generator):
    """Drive a steps generator here and now: each call it yields is
    run at once, its result (or exception) sent back. Returns the generator's result."""
    value, error = None, None
    while True:
        try:
            work = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            value = work()
        except Exception as exc:
            error = exc
