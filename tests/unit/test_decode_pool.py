"""addons/decode_pool.py: a buffered decode's steps run on pool threads, one step per sandbox at a
time, their CPU time charged to the sandbox's loop share. The steps here are made to wait for an
event only the event loop can set: run on the loop itself, they would never see it."""

from __future__ import annotations

import asyncio
import threading
import time

import brotli
import pytest

from addons import decode_pool, fair_share
from gateway.decompress import DecodedTooLarge, decode_pieces
from gateway.fairshare import LoopShare

WAIT = 10.0


def _waiting_pieces(gate: threading.Event, started: threading.Event | None = None, count: int = 1):
    """`count` pieces, the first made only once `gate` is set (False if it never is)."""
    if started is not None:
        started.set()
    yield b"x" if gate.wait(WAIT) else b"stuck"
    for _ in range(count - 1):
        yield b"y"


async def _collect(pieces) -> list[bytes]:
    return [piece async for piece in decode_pool.pieces(pieces)]


async def _until(event: threading.Event) -> None:
    """Wait for a pool thread's event without holding the loop (it may be what sets it)."""
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, WAIT)


def test_a_step_runs_off_the_event_loop():
    async def main():
        gate = threading.Event()
        started = threading.Event()
        task = asyncio.ensure_future(_collect(_waiting_pieces(gate, started, count=3)))
        await _until(started)  # the step began on a pool thread while the loop went on
        gate.set()
        return await task

    assert asyncio.run(main()) == [b"x", b"y", b"y"]


def test_a_sandbox_has_one_step_in_the_pool_at_a_time_and_others_are_not_queued_behind_it():
    class Handler:
        def __init__(self, key):
            setattr(self, fair_share.ATTR, key)

    async def decode(handler, pieces):
        fair_share.serve(handler)  # this task serves one sandbox's connection
        return await _collect(pieces)

    async def main():
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)  # a task runs to its first wait at once
        first_gate, first_started = threading.Event(), threading.Event()
        second_gate, second_started = threading.Event(), threading.Event()
        other_gate, other_started = threading.Event(), threading.Event()
        a = Handler("sandbox:pool-a")
        first = asyncio.ensure_future(decode(a, _waiting_pieces(first_gate, first_started)))
        second = asyncio.ensure_future(decode(a, _waiting_pieces(second_gate, second_started)))
        other = asyncio.ensure_future(decode(Handler("sandbox:pool-b"), _waiting_pieces(other_gate, other_started)))
        await _until(first_started)
        await _until(other_started)  # the other sandbox's step runs next to A's first one
        assert decode_pool._locks["sandbox:pool-a"][1] == 2  # A's second decode is at its sandbox's lock
        assert not second_started.is_set()  # and waits there for A's first step
        other_gate.set()
        assert await other == [b"x"]
        first_gate.set()
        second_gate.set()  # (the steps of A's two decodes take turns: the second's may come before the first's last)
        assert await first == [b"x"] and await second == [b"x"]

    asyncio.run(main())
    assert not decode_pool._locks  # nothing kept per sandbox once its decodes are done


def test_the_step_s_cpu_time_is_charged_to_the_sandbox():
    key = "sandbox:pool-cpu"

    class Handler:
        pass

    handler = Handler()
    setattr(handler, fair_share.ATTR, key)

    def burning():
        started = time.thread_time()
        while time.thread_time() - started < 0.2:  # more than the burst: the sandbox goes into debt
            pass
        yield b"done"

    async def main():
        fair_share.serve(handler)
        assert not fair_share._share.in_debt(key)
        assert await _collect(burning()) == [b"done"]

    asyncio.run(main())
    assert fair_share._share.in_debt(key)


def test_a_decode_error_on_the_pool_is_raised_to_the_caller():
    bomb = brotli.compress(bytes(64 << 20), quality=5, lgwin=24)

    with pytest.raises(DecodedTooLarge):
        asyncio.run(_collect(decode_pieces("br", bomb, 64 << 20)))


def test_a_step_the_pool_cannot_take_is_thrown_into_the_steps_like_a_step_that_failed(monkeypatch):
    """Review 43: a pool that cannot start a thread raises while the step is scheduled. The steps
    generator must see that exception (and refuse with its own reason), not have `drive` raise past it."""
    def refuse(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(decode_pool, "_executor", lambda: type("Full", (), {"submit": refuse})())

    def steps():
        try:
            yield lambda: b"never"
        except RuntimeError as exc:
            return f"refused: {exc}"
        return "ran"

    assert asyncio.run(decode_pool.drive(steps())) == "refused: can't start new thread"


def test_a_buffered_body_redacted_in_slices_equals_its_redaction_whole():
    """addons/body_redaction.py redacts a large buffered body a slice at a time, with a turn between:
    a secret across a slice boundary (and one at either end) is still redacted, as whole."""
    from addons import body_redaction
    from gateway.redact import Redactor

    secret = "sk-live-0123456789abcdef"
    redactor = Redactor({"key": secret})
    edge = body_redaction.REDACT_SLICE
    body = bytearray(b"line\n" * (3 * edge // 5))
    for at in (0, edge - 7, 2 * edge - 1, len(body) - len(secret)):
        body[at:at + len(secret)] = secret.encode()
    body = bytes(body)
    sliced = asyncio.run(body_redaction.redact_buffered(body, redactor))
    assert sliced == redactor.redact(body)
    assert secret.encode() not in sliced[0] and len(sliced[1]) == 4


def test_a_cancelled_step_still_holds_its_sandbox_s_turn_and_is_charged(monkeypatch):
    """A fresh-eyes review: cancelling the task that awaited a step let go of the sandbox's lock at
    once (its next decode then ran beside the first) and its CPU time was never charged."""
    key = "sandbox:pool-cancel"
    # A share whose clock stands still: the charge is not refilled while the test goes on (under a
    # loaded CI run the rest of the test took long enough for the debt to be paid back).
    monkeypatch.setattr(fair_share, "_share", LoopShare(clock=lambda: 1000.0))

    class Handler:
        pass

    handler = Handler()
    setattr(handler, fair_share.ATTR, key)
    gate, first_started, second_started = threading.Event(), threading.Event(), threading.Event()

    def burning_then_waiting():
        first_started.set()
        started = time.thread_time()
        while time.thread_time() - started < 0.2:
            pass
        gate.wait(WAIT)
        yield b"first"

    async def decode(pieces):
        fair_share.serve(handler)
        return await _collect(pieces)

    async def main():
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)  # a task runs to its first wait at once
        first = asyncio.ensure_future(decode(burning_then_waiting()))
        await _until(first_started)
        first.cancel()
        second_gate = threading.Event()
        second = asyncio.ensure_future(decode(_waiting_pieces(second_gate, second_started)))
        assert decode_pool._locks[key][1] == 2  # the next step is at its sandbox's lock
        assert not second_started.is_set()  # the cancelled step is still running: the next one waits
        gate.set()
        second_gate.set()
        assert await second == [b"x"]
        return first

    first = asyncio.run(main())
    assert first.cancelled()
    assert fair_share._share.in_debt(key)  # the cancelled step's 0.2 s were charged
    assert not decode_pool._locks


def test_pool_threads_run_at_the_lowest_priority_so_the_loop_keeps_its_cpu():
    """A decode at the loop's own priority took half of a busy CPU from the loop: every other
    sandbox's callbacks ran at half speed while one sandbox's bodies decoded."""
    import os

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main():
        return await decode_pool.run(niceness)

    decode_pool.shutdown()  # (a pool made by an earlier test is made again, with its initializer)
    try:
        assert asyncio.run(main()) == max(decode_pool.POOL_NICE, os.nice(0))
        assert niceness() == os.nice(0)  # the loop's own thread: unchanged
    finally:
        decode_pool.shutdown()
