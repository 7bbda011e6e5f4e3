"""The connection reader's end (addons/conn_close.py): the close is delivered to the layers even
when the reader is cancelled while that delivery waits for the connection's event lock (review 34:
an upstream reset while the layer still parsed what it had read; a drain of the reset writer
cancelled the reader, the close was dropped, and the client's stream hung for 120 s)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import events, server

from addons import conn_close


class _Handler:
    """What handle_connection reads of mitmproxy's ConnectionHandler; its events wait for `lock`
    (held by the test: another event of the connection being handled)."""

    def __init__(self, connection, reader) -> None:
        self.transports = {connection: SimpleNamespace(reader=reader, writer=None, handler=None)}
        self.lock = asyncio.Lock()
        self.waiting = asyncio.Event()
        self.delivered: list = []

    async def server_event(self, event) -> None:
        self.waiting.set()
        async with self.lock:
            self.delivered.append(type(event).__name__)

    async def drain_writers(self) -> None:
        pass


@pytest.mark.parametrize("ending", ["reset", "eof"])
def test_a_close_whose_delivery_waits_is_delivered_though_the_reader_is_cancelled(monkeypatch, ending):
    monkeypatch.setattr(server.ConnectionHandler, "handle_connection", server.ConnectionHandler.handle_connection)
    conn_close.install()

    async def main():
        connection = Server(address=("origin.test", 443))
        connection.state = ConnectionState.OPEN
        reader = asyncio.StreamReader()
        if ending == "reset":
            reader.set_exception(ConnectionResetError("reset by peer"))
        else:
            reader.feed_eof()
        handler = _Handler(connection, reader)
        await handler.lock.acquire()  # another event of the connection is being handled
        task = asyncio.ensure_future(server.ConnectionHandler.handle_connection(handler, connection))
        await handler.waiting.wait()  # the close waits for the lock
        task.cancel("Error sending data: reset")  # (mitmproxy's drain_writers on the reset writer)
        handler.lock.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        return handler.delivered, connection.state

    delivered, state = asyncio.run(main())
    assert delivered == ["ConnectionClosed"] and state is ConnectionState.CLOSED


class _Transport:
    """A closed transport's send buffer, drained by its peer at `rate` bytes a second (of the loop's
    clock) from the close on, until `stop_after` seconds."""

    def __init__(self, queued: int, rate: float, stop_after: float = float("inf")) -> None:
        self.start_queued, self.rate, self.stop_after, self.aborted = queued, rate, stop_after, False
        self.closed_at = asyncio.get_running_loop().time()
        self.ended = asyncio.Event()  # seen empty by the check, or aborted

    def get_write_buffer_size(self) -> int:
        elapsed = min(asyncio.get_running_loop().time() - self.closed_at, self.stop_after)
        left = max(0, int(self.start_queued - self.rate * elapsed))
        if not left:
            self.ended.set()
        return left

    def abort(self) -> None:
        self.aborted = True
        self.ended.set()


def _closing(queued: int, rate: float, stop_after: float = float("inf")) -> bool:
    """The drain check on a transport closed with `queued` bytes; whether it was aborted (waits
    until the buffer is empty or it is)."""
    async def main():
        transport = _Transport(queued, rate, stop_after)
        conn_close._abort_if_still_draining(SimpleNamespace(transport=transport))
        await asyncio.wait_for(transport.ended.wait(), 30)
        return transport.aborted

    return asyncio.run(main())


def test_a_closed_connection_whose_peer_reads_keeps_its_socket_until_drained(monkeypatch):
    """A WebSocket client reading a 12 MB message at 1 MB/s after the gateway closed its side was
    cut at 8.2 MB by a flat 5 s deadline (review 39): while the peer reads, the socket stays."""
    monkeypatch.setattr(conn_close, "CLOSE_DRAIN_SECONDS", 0.02)
    per_period = conn_close.MIN_DRAIN_BYTES * 4
    assert not _closing(per_period * 10, per_period / 0.02)  # ten periods' worth, read all along


def test_a_closed_connection_whose_peer_stops_reading_is_aborted(monkeypatch):
    """A peer that never reads (or stops, or trickles) kept the socket, uncounted, for as long as it
    liked (review 38): a period without MIN_DRAIN_BYTES taken aborts it."""
    monkeypatch.setattr(conn_close, "CLOSE_DRAIN_SECONDS", 0.02)
    per_period = conn_close.MIN_DRAIN_BYTES * 4
    assert _closing(10 << 20, 0)
    assert _closing(10 << 20, per_period / 0.02, stop_after=0.05)  # read a while, then stopped
    assert _closing(10 << 20, conn_close.MIN_DRAIN_BYTES / 0.02 / 100)  # a trickle


def test_a_closed_connection_whose_peer_reads_slowly_is_not_cut(monkeypatch):
    """An overall deadline (5 s plus the queue at 1 MiB/s) cut a WebSocket client reading a 12 MB
    message at 500 KB/s (review 40). A lingering socket stays counted against its sandbox (its
    descriptor and its bytes), so a peer that keeps reading keeps it: here 40 periods' worth, read
    at twice the least a period."""
    monkeypatch.setattr(conn_close, "CLOSE_DRAIN_SECONDS", 0.01)
    per_period = conn_close.MIN_DRAIN_BYTES * 2
    assert not _closing(per_period * 40, per_period / 0.01)


def test_a_closed_connection_with_nothing_queued_is_left_alone(monkeypatch):
    async def main():
        transport = _Transport(0, 0)
        conn_close._abort_if_still_draining(SimpleNamespace(transport=transport))
        return transport

    assert not asyncio.run(main()).aborted


class _Writer:
    """A stream writer closed with `queued` bytes: its socket is gone once `end()` is called."""

    def __init__(self, queued: int) -> None:
        self.transport = _Transport(queued, 0)
        self._gone = asyncio.get_running_loop().create_future()

    async def wait_closed(self) -> None:
        await self._gone

    def end(self) -> None:
        self._gone.set_result(None)


def test_a_lingering_socket_is_told_to_every_listener_until_it_is_gone(monkeypatch):
    """The buffer budget and the socket budget each keep counting a closed socket that lingers to
    send what was queued (review 39, review 40), until it is gone; a socket with nothing queued is
    not theirs to count, and a listener that fails does not keep the others from being told."""
    monkeypatch.setattr(conn_close, "_linger_listeners", {})
    told: list[tuple[str, asyncio.Future]] = []

    def broken(handler, writer, gone):
        raise RuntimeError("a listener's bug")

    conn_close.on_linger("first", lambda handler, writer, gone: told.append(("first", gone)))
    conn_close.on_linger("broken", broken)
    conn_close.on_linger("last", lambda handler, writer, gone: told.append(("last", gone)))

    async def main():
        conn_close._lingers(object(), _Writer(0))
        assert told == []
        writer = _Writer(1 << 20)
        conn_close._lingers(object(), writer)
        assert [name for name, _ in told] == ["first", "last"] and not told[0][1].done()
        writer.end()
        await asyncio.wait_for(told[0][1], 5)
        return [gone.done() for _, gone in told]

    assert asyncio.run(main()) == [True, True]
