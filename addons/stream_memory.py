"""asyncio's queues of a connection are made when first used: drain waiters, unsent bytes, lock waiters.

Each of these is a `collections.deque()`, 760 bytes however empty, and nearly always empty
(bench/tunnel_memory.py --details; docs/performance.md, "Memory per open SSE stream"):

- **Drain waiters.** mitmproxy serves every TCP connection, the sandbox's and the upstream's,
  through an asyncio StreamReaderProtocol, whose FlowControlMixin made a deque in its constructor
  for the writers waiting in `drain()` while the transport's buffer is over its high-water mark:
  two per tunnel, empty unless a peer stops reading.
- **Unsent bytes.** Each of those connections' socket transport made a deque in its constructor
  for what the socket did not take at once: two per tunnel, empty unless the kernel's buffer is
  full.
- **Lock waiters.** A connection handler's `_server_event_lock` makes its deque the first time two
  events meet (a hook's completion while a read's event is handled: every stream) and keeps it for
  the connection's life.

Besides the queues, a connection's reader (addons/conn_close.py) waits for its next bytes through
`read_now`, `data_waiter` and `buffered` (Python 3.12's `StreamReader.read` and `_wait_for_data`,
split where they wait): the reader's own coroutine awaits the StreamReader's Future, where `reader.read` kept two more
coroutines suspended for as long as the connection is quiet (~1 KB per open stream, two readers).

Each starts with a shared empty deque that refuses writes (addons/empty_deque.py): a protocol gets a
deque of its own where `_drain_helper` first waits and lets it go once no writer waits; a transport
where `write` or `writelines` must keep bytes, and goes back to the shared one at a write that finds
its own empty; a handler's lock (`LeanLock`) drops its deque when it is released with no one
waiting (asyncio's Lock knows a lock with no deque). The code that only iterates or clears these
queues (`resume_writing`, `connection_lost`, the transport's sends and close) sees the shared one as
the empty deque it used to be.

Wrappers, tabled in addons/patches.py: `FlowControlMixin.__init__` and `_SelectorSocketTransport.__init__`
(asyncio's, then the shared deque in place of the new one), `FlowControlMixin._drain_helper` and
`_SelectorSocketTransport.write` (Python 3.12's, with the deque made where the first item is put
in; nothing else in them changed), `_SelectorSocketTransport.writelines` (its own deque first), and
`ConnectionHandler.__init__` (mitmproxy's, then LeanLocks in place of its two asyncio Locks, and
its per-address semaphores made by one shared function instead of a lambda of each handler's).
"""

from __future__ import annotations

import asyncio
import collections
from asyncio import constants, selector_events, streams
from asyncio.log import logger as _asyncio_logger  # (as in the copied write)

from mitmproxy.proxy import server

from .empty_deque import SharedEmptyDeque

NO_WAITERS = SharedEmptyDeque()  # the drain waiters of every protocol no writer waits on
NO_BYTES = SharedEmptyDeque()  # the unsent bytes of every transport whose socket took all


class LeanLock(asyncio.Lock):
    """asyncio.Lock that lets its deque of waiters go when it is released with none waiting."""

    def release(self) -> None:
        super().release()
        if self._waiters is not None and not self._waiters:
            self._waiters = None


def _five_at_once() -> asyncio.Semaphore:
    """mitmproxy's limit of connections a handler opens to one address at a time (12.3's lambda)."""
    return asyncio.Semaphore(5)


def _write(self, data):
    """Python 3.12's _SelectorSocketTransport.write; only where the unsent bytes are kept differs."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f'data argument must be a bytes-like object, '
                        f'not {type(data).__name__!r}')
    if self._eof:
        raise RuntimeError('Cannot call write() after write_eof()')
    if self._empty_waiter is not None:
        raise RuntimeError('unable to write; sendfile is in progress')
    if not data:
        return

    if self._conn_lost:
        if self._conn_lost >= constants.LOG_THRESHOLD_FOR_CONNLOST_WRITES:
            _asyncio_logger.warning('socket.send() raised exception.')
        self._conn_lost += 1
        return

    if not self._buffer:
        self._buffer = NO_BYTES  # (its own, emptied since: let go)
        # Optimization: try to send now.
        try:
            n = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            pass
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, 'Fatal write error on socket transport')
            return
        else:
            data = memoryview(data)[n:]
            if not data:
                return
        # Not all was written; register write handler.
        self._loop._add_writer(self._sock_fd, self._write_ready)

    # Add it to the buffer.
    if self._buffer is NO_BYTES:
        self._buffer = collections.deque()
    self._buffer.append(data)
    self._maybe_pause_protocol()


def read_now(reader: streams.StreamReader, n: int) -> bytes | None:
    """What `reader.read(n)` (Python 3.12, n > 0) returns when it need not wait: the next bytes, or
    b"" at the end; None when it must wait (`data_waiter`, then `buffered`); the reader's error raised."""
    if reader._exception is not None:
        raise reader._exception
    if not reader._buffer and not reader._eof:
        return None
    return buffered(reader, n)


def buffered(reader: streams.StreamReader, n: int) -> bytes:
    """The rest of `read(n)` once its wait is over: up to n bytes of what is buffered (b"" when the
    wait ended with none), before any error: bytes that came with a reset are read first, as
    Python's read gives them (review 51)."""
    data = bytes(memoryview(reader._buffer)[:n])
    del reader._buffer[:n]
    reader._maybe_resume_transport()
    return data


def data_waiter(reader: streams.StreamReader) -> asyncio.Future:
    """The Future `reader._wait_for_data` (Python 3.12) awaits, set on the reader, for the caller to
    await and then clear (`reader._waiter = None`, in a finally around the await only, as it does:
    a refusal here leaves another waiter's Future alone): done when bytes, the end or an error come."""
    if reader._waiter is not None:
        raise RuntimeError("read() called while another coroutine is already waiting for incoming data")
    assert not reader._eof, "_wait_for_data after EOF"
    if reader._paused:  # (waiting while paused would never end)
        reader._paused = False
        reader._transport.resume_reading()
    reader._waiter = reader._loop.create_future()
    return reader._waiter


def install() -> None:
    FlowControlMixin = streams.FlowControlMixin
    if getattr(FlowControlMixin._drain_helper, "_egress_lazy_waiters", False):
        return
    init = FlowControlMixin.__init__

    def __init__(self, loop=None) -> None:
        init(self, loop)
        self._drain_waiters = NO_WAITERS

    async def _drain_helper(self):
        """Python 3.12's FlowControlMixin._drain_helper; only where the waiter is kept differs."""
        if self._connection_lost:
            raise ConnectionResetError('Connection lost')
        if not self._paused:
            return
        waiter = self._loop.create_future()
        waiters = self._drain_waiters
        if waiters is NO_WAITERS:
            waiters = self._drain_waiters = collections.deque()
        waiters.append(waiter)
        try:
            await waiter
        finally:
            waiters.remove(waiter)
            if not waiters and self._drain_waiters is waiters:
                self._drain_waiters = NO_WAITERS

    _drain_helper._egress_lazy_waiters = True
    FlowControlMixin.__init__ = __init__
    FlowControlMixin._drain_helper = _drain_helper

    Transport = selector_events._SelectorSocketTransport
    transport_init, writelines = Transport.__init__, Transport.writelines

    def transport_init_(self, *args, **kwargs) -> None:
        transport_init(self, *args, **kwargs)
        self._buffer = NO_BYTES

    def writelines_(self, list_of_data):
        if self._buffer is NO_BYTES and list_of_data:
            self._buffer = collections.deque()
        return writelines(self, list_of_data)

    Transport.__init__ = transport_init_
    Transport.write = _write
    Transport.writelines = writelines_

    handler_init = server.ConnectionHandler.__init__

    def handler_init_(self, *args, **kwargs) -> None:
        handler_init(self, *args, **kwargs)
        self._server_event_lock = LeanLock()
        self._drain_lock = LeanLock()
        self.max_conns = collections.defaultdict(_five_at_once)  # (a function shared, not a lambda each)

    server.ConnectionHandler.__init__ = handler_init_
