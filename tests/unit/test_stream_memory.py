"""addons/stream_memory.py: an asyncio stream protocol makes its deque of drain waiters when a writer
first waits, not in its constructor, and lets it go once no writer waits; until then it shares one
empty deque that refuses writes. A writer held back by a peer that does not read still waits, and is
released when the peer reads or when the connection is lost. A socket transport makes its deque of
unsent bytes when the socket first leaves some, every byte still arrives in order, and it lets the
deque go at a write that finds it empty. A handler's lock drops its deque of waiters when released
with none waiting, and still hands the lock over in order. The copies of Python's _drain_helper and
write are of the functions this Python has."""

from __future__ import annotations

import ast
import asyncio
import collections
import hashlib
import inspect
import socket
from asyncio import selector_events, streams

import pytest

from addons import stream_memory
from addons.stream_memory import NO_BYTES, NO_WAITERS, LeanLock

stream_memory.install()

# sha256 of Python 3.12's FlowControlMixin._drain_helper source, which stream_memory copies
PYTHON_DRAIN_HELPER = "3aaf494dc68cc7af023abd7b44a1f11872cd77f028748ac317ce62a89446e2f9"
# sha256 of Python 3.12's _SelectorSocketTransport.write source, which stream_memory copies
PYTHON_TRANSPORT_WRITE = "96f23c287e7ba63acccb59abaadf87f231e9de0c96e06f3ee9deac00ae4c85f1"
# sha256 of Python 3.12's StreamReader.read and _wait_for_data, which read_now and data_waiter split
PYTHON_READER = {"read": "07b3e362bedf72a44cf0b21d1743bfeae88f7126f27860be189e31c2cd1a6e3c",
                 "_wait_for_data": "29182a2d89ea041fbb4b148dcb4c5e9041bd50553fe4dab14af1c6e2c774e401"}


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


def _python_method(module, cls: str, name: str) -> str:
    source = inspect.getsource(module)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            found = next(f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and f.name == name)
            return ast.get_source_segment(source, found)
    raise AssertionError(cls)


def test_the_copy_is_of_this_python_s_drain_helper():
    text = _python_method(streams, "FlowControlMixin", "_drain_helper")
    assert hashlib.sha256(text.encode()).hexdigest() == PYTHON_DRAIN_HELPER, (
        "Python's FlowControlMixin._drain_helper changed: copy it into addons/stream_memory.py again, then update "
        "the hash")


def test_the_copy_is_of_this_python_s_transport_write():
    text = _python_method(selector_events, "_SelectorSocketTransport", "write")
    assert hashlib.sha256(text.encode()).hexdigest() == PYTHON_TRANSPORT_WRITE, (
        "Python's _SelectorSocketTransport.write changed: copy it into addons/stream_memory.py again, then update "
        "the hash")


# -- unsent bytes ----------------------------------------------------------------------------------------

def test_a_transport_starts_with_the_shared_deque_and_keeps_it_while_the_socket_takes_all():
    async def body(writer, reader):
        transport = writer.transport
        assert transport._buffer is NO_BYTES
        writer.write(b"hello")
        writer.writelines([])
        assert transport._buffer is NO_BYTES
        assert await reader.readexactly(5) == b"hello"

    _with_pair(body)


@pytest.mark.parametrize("how", ["write", "writelines"])
def test_bytes_the_socket_leaves_go_in_a_deque_of_its_own_and_all_arrive_in_order(how):
    async def body(writer, reader):
        transport = writer.transport
        sent = bytearray()
        piece = 0
        while not transport.get_write_buffer_size():  # until the kernel's buffer is full (the peer does not read yet)
            data = bytes([piece % 251]) * 65536
            (writer.write(data) if how == "write" else writer.writelines([data[:1000], data[1000:]]))
            sent += data
            piece += 1
        own = transport._buffer
        assert own is not NO_BYTES and type(own) is collections.deque and own
        writer.write(b"tail")
        sent += b"tail"
        assert transport._buffer is own  # (more bytes behind those left: the same deque)
        got = await reader.readexactly(len(sent))  # the peer reads: the transport sends what it kept
        assert got == bytes(sent)
        assert not own
        writer.write(b"next")  # a write that finds its deque empty lets it go
        assert transport._buffer is NO_BYTES
        assert await reader.readexactly(4) == b"next"

    _with_pair(body)


def test_a_closed_transport_with_the_shared_deque_closes_cleanly():
    async def body(writer, reader):
        writer.write(b"x")
        writer.close()
        await writer.wait_closed()
        assert await reader.read() == b"x"
        with pytest.raises(RuntimeError):
            NO_BYTES.append(b"y")

    _with_pair(body)


# -- a handler's lock ------------------------------------------------------------------------------------

def test_a_lock_drops_its_waiters_when_released_with_none_waiting_and_hands_over_in_order():
    async def main():
        lock = LeanLock()
        order = []

        async def take(name):
            async with lock:
                order.append(name)

        await lock.acquire()
        waiting = [asyncio.ensure_future(take(n)) for n in ("a", "b")]
        while not lock._waiters or len(lock._waiters) < 2:
            await asyncio.sleep(0)  # (each waiter's first step: it queues its future)
        lock.release()  # hands over to "a": "b" still waits, the deque stays
        assert lock._waiters is not None
        await asyncio.gather(*waiting)
        assert order == ["a", "b"]
        assert lock._waiters is None and not lock.locked()

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_lock_usable():
    async def main():
        lock = LeanLock()
        await lock.acquire()
        waiter = asyncio.ensure_future(lock.acquire())
        while not lock._waiters:
            await asyncio.sleep(0)  # (the waiter's first step: it queues its future)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        lock.release()
        assert lock._waiters is None
        async with lock:
            assert lock.locked()
        assert not lock.locked()

    asyncio.run(main())


def test_a_connection_handler_s_locks_are_lean():
    from mitmproxy import connection, options
    from mitmproxy.proxy import context, server

    class Bare(server.ConnectionHandler):
        async def handle_hook(self, hook) -> None:
            pass

        def log(self, message, level=None) -> None:
            pass

    client = connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2))
    handler = Bare(context.Context(client, options.Options()))
    assert type(handler._server_event_lock) is LeanLock and type(handler._drain_lock) is LeanLock
    limit = handler.max_conns[("127.0.0.1", 443)]
    assert isinstance(limit, asyncio.Semaphore) and limit._value == 5  # mitmproxy's five at once, per address
    assert handler.max_conns.default_factory is stream_memory._five_at_once


# -- a reader's wait ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PYTHON_READER))
def test_the_split_read_is_of_this_python_s_stream_reader(name):
    text = _python_method(streams, "StreamReader", name)
    assert hashlib.sha256(text.encode()).hexdigest() == PYTHON_READER[name], (
        f"Python's StreamReader.{name} changed: carry it into addons/stream_memory.py's read_now and "
        "data_waiter, then update the hash")


async def _lean_read(reader, n: int) -> bytes:
    """How addons/conn_close.py reads."""
    data = stream_memory.read_now(reader, n)
    if data is None:
        waiter = stream_memory.data_waiter(reader)
        try:
            await waiter
        finally:
            reader._waiter = None
        data = stream_memory.buffered(reader, n)
    return data


def _waiting(read) -> asyncio.Task:
    """`read` started at once and run to its wait, if it must wait (an eager task): no loop step to
    wait for."""
    return asyncio.eager_task_factory(asyncio.get_running_loop(), read)


def test_bytes_that_came_with_a_reset_are_read_before_it():
    """Review 51: fed bytes and then an error while the reader waited, read gives the bytes (the
    error at the next read); the split read raised at once and lost them."""
    async def main():
        results = []
        for read in (_lean_read, lambda r, n: r.read(n)):
            reader = asyncio.StreamReader()
            waiting = _waiting(read(reader, 100))
            assert reader._waiter is not None
            reader.feed_data(b"GET / HTTP/1.1\r\n\r\n")
            reader.set_exception(ConnectionResetError("reset"))
            results.append(await waiting)
            with pytest.raises(ConnectionResetError):
                await read(reader, 100)
        assert results == [b"GET / HTTP/1.1\r\n\r\n"] * 2

    asyncio.run(main())


def test_a_second_waiter_is_refused_and_leaves_the_first_one_s_future():
    async def main():
        reader = asyncio.StreamReader()
        first = _waiting(_lean_read(reader, 10))
        waiting_on = reader._waiter
        assert waiting_on is not None
        with pytest.raises(RuntimeError):
            await _lean_read(reader, 10)
        assert reader._waiter is waiting_on
        reader.feed_data(b"x")
        assert await first == b"x"

    asyncio.run(main())


def test_the_split_read_gives_what_read_gives():
    """Bytes in pieces of at most n, the end as b"", an error raised, a paused reader resumed: the
    same as StreamReader.read on a twin reader fed the same."""
    async def main():
        loop = asyncio.get_running_loop()
        ours, theirs = asyncio.StreamReader(limit=8), asyncio.StreamReader(limit=8)
        for reader in (ours, theirs):
            reader.feed_data(b"0123456789abcdef")
        assert await _lean_read(ours, 5) == await theirs.read(5) == b"01234"
        assert await _lean_read(ours, 100) == await theirs.read(100) == b"56789abcdef"
        # waiting: bytes fed later wake both
        waiting = [_waiting(_lean_read(ours, 3)), _waiting(theirs.read(3))]
        assert ours._waiter is not None and theirs._waiter is not None
        for reader in (ours, theirs):
            reader.feed_data(b"xyz!")
        assert [await w for w in waiting] == [b"xyz", b"xyz"]
        assert ours._waiter is None
        # the end (after what is left)
        waiting = [_waiting(_lean_read(ours, 9)), _waiting(theirs.read(9))]
        for reader in (ours, theirs):
            reader.feed_eof()
        assert [await w for w in waiting] == [b"!", b"!"]
        assert await _lean_read(ours, 9) == await theirs.read(9) == b""
        # an error
        ours, theirs = asyncio.StreamReader(), asyncio.StreamReader()
        for reader in (ours, theirs):
            reader.set_exception(ConnectionResetError("reset"))
        for read in (_lean_read(ours, 1), theirs.read(1)):
            with pytest.raises(ConnectionResetError):
                await read
        # cancelled while waiting: the reader can be waited on again
        ours = asyncio.StreamReader()
        waiting = _waiting(_lean_read(ours, 1))
        assert ours._waiter is not None
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert ours._waiter is None
        ours.feed_data(b"q")
        assert await _lean_read(ours, 1) == b"q"
        assert loop is asyncio.get_running_loop()

    asyncio.run(main())


def test_a_paused_reader_is_resumed_when_waited_on():
    def body(writer, reader):
        async def run():
            reader._paused = True  # (as after a full buffer)
            resumed = []
            transport = reader._transport
            original = transport.resume_reading
            transport.resume_reading = lambda: (resumed.append(True), original())
            waiting = _waiting(_lean_read(reader, 4))
            assert resumed == [True] and not reader._paused
            writer.write(b"ping")
            assert await waiting == b"ping"
        return run()

    _with_pair(body)
