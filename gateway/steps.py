"""Sans-I/O steps: a generator that yields each costly call (a decoder's) as a zero-argument
callable instead of making it, and is sent back its result, or thrown its exception. The caller
chooses where the calls run: here and now (`run_steps`), or on a pool thread while the event loop
serves others (addons/decode_pool.py `drive`). Whatever the generator does between two calls runs
on the caller's thread. Both drivers are the same loop around `resume`; only where `work()` runs
differs."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import NamedTuple


class Finished(NamedTuple):
    """The generator returned: its result (a yielded call is never a tuple, so never this)."""

    result: object


def resume(steps: Generator, value: object = None, error: Exception | None = None) -> Callable[[], object] | Finished:
    """Send the last call's result into `steps` (or throw the exception it raised): the next call
    to make, or Finished with the generator's result."""
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration as stop:
        return Finished(stop.value)


def attempt(work: Callable[[], object]) -> tuple[object, Exception | None]:
    """`work()` here: (its result, None) or (None, the exception it raised)."""
    try:
        return work(), None
    except Exception as exc:
        return None, exc


def run_steps(steps: Generator):
    """Drive a steps generator here and now: each call it yields is
    run at once, its result (or exception) sent back. Returns the generator's result."""
    work = resume(steps)
    while not isinstance(work, Finished):
        work = resume(steps, *attempt(work))
    return work.result
