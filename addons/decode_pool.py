"""Buffered decodes run off the event loop, on a small pool of threads.

A decoder's step is one C call the loop cannot interrupt, and its cost is not the output asked
for: brotli fills its whole ring buffer (the window the *sender* chose, up to 16 MiB) before it
hands out the first byte, so 52 bytes of `br` at lgwin 24 held the loop for ~50 ms per step, and
every other sandbox's callbacks waited behind it (bench/noisy.py, decompression_bomb). zlib,
brotli and zstd all release the interpreter lock while they decode, so on a thread the loop keeps
serving the others meanwhile.

Bounded and fair: a few threads per worker; each sandbox has at most one step in the pool at a
time (its other decodes wait their turn here, so a sandbox with many bombs does not queue ahead of
a neighbour's one decode); each step's CPU time is charged to the sandbox's loop share
(addons/fair_share.py), and its next step waits for its turn, like a read would.

Two users: a bound response decoded whole (addons/body_redaction.py, `pieces`), and a compressed
request body's method-override scan (addons/method_body.py) and a bound response's streamed
redaction (addons/body_redaction.py): their stream (addons/http_stream.py) starts the `egress_decode_steps`
hook, mitmproxy holds the stream's later events until the hook completes, and `DecodePool` drives
the steps (`drive`): decoder calls on the pool, the scanning or redaction of what they return on
the loop, a turn between two. Only the C decoders go to threads: they release the
interpreter lock; the scan is Python, and on a thread it held the lock while the loop waited for it
at each of its system calls (tried: another sandbox's p99 no better than with it all on the loop).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mitmproxy.proxy import commands

from gateway.steps import Finished, resume

from . import fair_share

THREADS = 2
_pool: ThreadPoolExecutor | None = None
_locks: dict[object, list] = {}  # sandbox key -> [asyncio.Lock, holders and waiters]
_DONE = object()  # a decode's end


M_ARENA_MAX = -8  # glibc's mallopt parameter


def _one_arena() -> None:
    """Threads made from now on allocate from the arenas that exist: glibc gives each new thread
    an arena of its own, which keeps what a decode freed (measured: ~21 MiB more RSS per pool
    thread after one bomb, 124 MiB against 103 on the loop)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass  # not glibc


# The pool threads' nice value (Linux: per thread). A decode is work for one sandbox, charged to
# it; at the loop's own priority it took half of a busy CPU from the loop (the kernel shares a CPU
# evenly between runnable threads), and every other sandbox's callbacks ran at half speed while
# one sandbox's bodies decoded: a neighbour's own callbacks 9 -> 18 ms per request (p90,
# bench/noisy.py request_body_bomb). At 19 the decodes run on what the loop leaves of the CPU.
POOL_NICE = 19


def _background() -> None:
    """A pool thread's start: its nice value raised to POOL_NICE (lowering one's own priority
    needs no privilege; where threads have no nice value of their own, nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POOL_NICE)
    except (OSError, AttributeError):
        pass


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _one_arena()
        _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="egress-decode", initializer=_background)
    return _pool


def _timed(work: Callable[[], object]):
    """`work()` on a pool thread: (its result, exception or None, CPU seconds)."""
    started = time.thread_time()
    try:
        return work(), None, time.thread_time() - started
    except BaseException as exc:  # handed back to the loop, raised there
        return None, exc, time.thread_time() - started


async def _one_step(key, work: Callable[[], object]):
    """`work` on the pool once the sandbox's previous step is done; (result, exception). A step
    whose caller is cancelled still runs to its end on its thread: its sandbox's next step waits
    for that, and its CPU time is charged all the same (both from the step's own completion)."""
    entry = _locks.setdefault(key, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        await entry[0].acquire()
    except BaseException:
        _leave(key, entry)
        raise
    try:
        future = asyncio.get_running_loop().run_in_executor(_executor(), _timed, work)
    except BaseException:  # (a pool shut down): the sandbox's next step must not wait for ever
        entry[0].release()
        _leave(key, entry)
        raise

    def finished(done: asyncio.Future) -> None:
        entry[0].release()
        _leave(key, entry)
        if not done.cancelled() and key is not None:
            fair_share.charge_key(key, done.result()[2])

    future.add_done_callback(finished)
    result, error, _ = await asyncio.shield(future)
    return result, error


def _leave(key, entry: list) -> None:
    entry[1] -= 1
    if not entry[1] and _locks.get(key) is entry:
        del _locks[key]


async def run(work: Callable[[], object]):
    """`work()` on the pool, its CPU time charged to the running task's sandbox; its result, or
    the exception it raised."""
    result, error = await _one_step(fair_share.current_key(), work)
    if error is not None:
        try:
            raise error
        finally:  # (else error -> its traceback -> this frame -> error: a cycle that kept the
            error = None  # decode's buffer alive until the next full collection)
    return result


async def pieces(pieces: Iterator[bytes]):
    """The pieces of a decode (gateway/decompress.py, a generator that decodes as it is asked),
    each computed on the pool; between two, the sandbox's turn on the loop."""
    while (piece := await run(lambda: next(pieces, _DONE))) is not _DONE:
        yield piece
        await fair_share.current_turn()


async def drive(steps: Generator):
    """Run a sans-I/O steps generator (gateway/methods/scanner.py `BodyScanner.feed_steps`): each call it
    yields on the pool, its result (or exception) sent back, the sandbox's turn after each; its
    result. (gateway/steps.py `run_steps` is the same loop, inline.)"""
    work = resume(steps)
    while not isinstance(work, Finished):
        value, error = None, None
        try:  # (also a step the pool could not take: the generator fails closed on it, as on any)
            value = await run(work)
        except Exception as exc:
            error = exc
        await fair_share.current_turn()
        work = resume(steps, value, error)
        value = error = None  # (nothing of the step kept while the next one runs)
    return work.result


class DecodeSteps:
    """A sans-I/O steps generator for the hook to drive (a body check's scan, addons/method_body.py;
    a streamed bound response's decode, addons/body_redaction.py), and its result once driven (None:
    no addon drove it; the stream then fails closed)."""

    __slots__ = ("steps", "result")

    def __init__(self, steps: Generator):
        self.steps, self.result = steps, None


@dataclass
class EgressDecodeStepsHook(commands.StartHook):
    """Started by a stream (addons/http_stream.py) for a step of a body it must decode (a request body's
    check, a bound response's streamed redaction); the stream waits for it, and mitmproxy holds the
    stream's later events meanwhile."""

    step: DecodeSteps


class DecodePool:
    """Drives the streams' decode steps (decoder calls on the pool); stops the pool with the gateway."""

    async def egress_decode_steps(self, step: DecodeSteps) -> None:
        step.result = await drive(step.steps)

    def done(self) -> None:
        shutdown()


def shutdown() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None
