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
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from . import fair_share

THREADS = 2
_pool: ThreadPoolExecutor | None = None
_locks: dict[object, list] = {}  # sandbox key -> [asyncio.Lock, holders and waiters]
_DONE = object()


M_ARENA_MAX = -8  # glibc's mallopt parameter


def _one_arena() -> None:
    """Threads made from now on allocate from the arenas that exist: glibc gives each new thread
    an arena of its own, which keeps what a decode freed (measured: ~21 MiB more RSS per pool
    thread after one bomb, 124 MiB against 103 on the loop)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass  # not glibc


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _one_arena()
        _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="egress-decode")
    return _pool


def _step(pieces: Iterator[bytes]):
    """One piece, computed on a pool thread: (piece or _DONE, exception or None, CPU seconds)."""
    started = time.thread_time()
    try:
        piece = next(pieces, _DONE)
        return piece, None, time.thread_time() - started
    except BaseException as exc:  # handed back to the loop, raised there
        return None, exc, time.thread_time() - started


async def _one_step(key, pieces: Iterator[bytes]):
    entry = _locks.setdefault(key, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        async with entry[0]:
            return await asyncio.get_running_loop().run_in_executor(_executor(), _step, pieces)
    finally:
        entry[1] -= 1
        if not entry[1]:
            del _locks[key]


async def pieces(pieces: Iterator[bytes]):
    """The pieces of a decode (gateway/decompress.py, a generator that decodes as it is asked),
    each computed on the pool; between two, the sandbox's turn on the loop."""
    key = fair_share.current_key()
    while True:
        piece, error, spent = await _one_step(key, pieces)
        fair_share.charge_current(spent)
        if error is not None:
            try:
                raise error
            finally:  # (else error -> its traceback -> this frame -> error: a cycle that kept the
                error = None  # decode's buffer alive until the next full collection)
        if piece is _DONE:
            return
        yield piece
        await fair_share.current_turn()


def shutdown() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None
