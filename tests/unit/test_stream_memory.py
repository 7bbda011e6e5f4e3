"""addons/stream_memory.py: an asyncio stream protocol makes its deque of drain waiters when a writer
first waits, not in its constructor, and lets it go once no writer waits; until then it shares one
empty deque that refuses writes. A writer held back by a peer that does not read still waits, and is
released when the peer reads or when the connection is lost. The copy of Python's
_drain_helper is of the function this Python has."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
import socket
from asyncio import streams

import pytest

from addons import stream_memory
from addons.stream_memory import NO_WAITERS

stream_memory.install()

# sha256 of Python 3.12's FlowControlMixin._drain_helper source, which stream_memory copies
PYTHON_DRAIN_HELPER = "3aaf494dc68cc7af023abd7b44a1f11872cd77f028748ac317ce62a89446e2f9"


def _with_pair(body) -> None:
    """Run `body(writer, reader)` on two connected asyncio streams (a socket pair: the writer of one
    end, the reader of the other), then close both ends."""
    async def main():
        a, b = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=a)
        reader, peer = await asyncio.open_connection(sock=b)
        try:
            await body(writer, reader)
        finally:
            writer.close()
            peer.close()

    asyncio.run(main())


async def _held_back(writer: asyncio.StreamWriter) -> asyncio.Future:
    """A drain() that waits: the transport's buffer over its (lowered) high-water mark."""
    writer.transport.set_write_buffer_limits(high=1)
    while not writer.transport.get_write_buffer_size():  # the kernel's buffer takes what it can first
        writer.write(b"x" * 65536)
    drain = asyncio.ensure_future(writer.drain())
    while not writer._protocol._drain_waiters:
        await asyncio.sleep(0)  # (the drain task's first step: it appends its waiter)
    return drain


def test_a_new_protocol_shares_the_empty_deque_which_refuses_writes():
    async def body(writer, _):
        assert writer._protocol._drain_waiters is NO_WAITERS
        await writer.drain()  # not paused: returns at once, nothing made
        assert writer._protocol._drain_waiters is NO_WAITERS
        with pytest.raises(RuntimeError):
            NO_WAITERS.append(1)

    _with_pair(body)


def test_a_waiting_writer_gets_a_deque_which_goes_when_the_peer_reads():
    async def body(writer, reader):
        drain = await _held_back(writer)
        waiters = writer._protocol._drain_waiters
        assert waiters is not NO_WAITERS and len(waiters) == 1 and not drain.done()
        while not drain.done():  # the peer reads: the buffer drains, the writer resumes
            await reader.read(1 << 20)
        await drain
        assert writer._protocol._drain_waiters is NO_WAITERS

    _with_pair(body)


def test_a_waiting_writer_is_released_when_the_connection_is_lost():
    async def body(writer, _):
        drain = await _held_back(writer)
        writer.transport.abort()  # connection_lost: the waiter is woken (asyncio's, unchanged)
        await drain
        assert writer._protocol._drain_waiters is NO_WAITERS
        with pytest.raises(ConnectionResetError):  # and a later drain() says why
            await writer.drain()

    _with_pair(body)


def test_the_copy_is_of_this_python_s_drain_helper():
    source = inspect.getsource(streams)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "FlowControlMixin":
            found = next(f for f in node.body if isinstance(f, ast.AsyncFunctionDef) and f.name == "_drain_helper")
            text = ast.get_source_segment(source, found)
    assert hashlib.sha256(text.encode()).hexdigest() == PYTHON_DRAIN_HELPER, (
        "Python's FlowControlMixin._drain_helper changed: copy it into addons/stream_memory.py again, then update "
        "the hash")
