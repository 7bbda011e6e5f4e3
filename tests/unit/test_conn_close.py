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
