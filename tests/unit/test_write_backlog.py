"""What a connection's transports hold unread is charged to its client's sandbox (addons/write_backlog.py
`settle`): the client's transport and, since review 6, its upstreams' too (a WebSocket relayed to an
upstream that does not read sat there uncharged, and the sandbox's next reassemblies were admitted).
Driven with the real ledger and stand-in transports that report their write-buffer size."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from addons import write_backlog
from gateway.budget import Ledger


class _Writer:
    def __init__(self, size: int | None):
        self.transport = None if size is None else SimpleNamespace(get_write_buffer_size=lambda: self.size)
        self.size = size or 0

    def is_closing(self) -> bool:
        return False


class _Conn:
    def __init__(self, id_: str):
        self.id = id_


def _handler(client_size, upstream_sizes):
    client = _Conn("c1")
    transports = {client: SimpleNamespace(writer=_Writer(client_size))}
    for n, size in enumerate(upstream_sizes):
        transports[_Conn(f"s{n}")] = SimpleNamespace(writer=_Writer(size))
    return SimpleNamespace(client=client, transports=transports)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # (patched the same each time)
@given(st.one_of(st.none(), st.integers(min_value=0, max_value=1 << 24)),
       st.lists(st.integers(min_value=0, max_value=1 << 24), max_size=3))
def test_every_transport_s_backlog_is_charged_to_the_client(monkeypatch, client_size, upstream_sizes):
    ledger = Ledger(per_connection=1 << 20, per_sandbox=1 << 20)
    state = SimpleNamespace(buffers=ledger, connections={}, sandbox_key=lambda conn: "sandbox:a")
    monkeypatch.setattr(write_backlog, "_state", state)
    monkeypatch.setattr(write_backlog.asyncio, "ensure_future", lambda coroutine: coroutine.close())
    handler = _handler(client_size, upstream_sizes)
    write_backlog.settle(handler)
    expected = (client_size or 0) + sum(upstream_sizes)
    assert ledger.held(sandbox="sandbox:a") == expected  # past the limits too: it is already held
    assert (ledger.room("c1", "sandbox:a") == 0) == (expected >= 1 << 20)
    for writer in (io.writer for io in handler.transports.values()):
        writer.size = 0  # drained
    write_backlog.settle(handler)
    assert ledger.held(sandbox="sandbox:a") == 0
    assert ledger.released == 0  # (bytes a transport let go: no collection is owed for them)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=0, max_value=1 << 18), min_size=1, max_size=3))
def test_what_the_stream_readers_hold_is_charged_too(monkeypatch, read_ahead):
    """Review 32: an upstream's reader fills (up to twice its 64 KiB limit) while the client's
    writer is full; 990 downloads nobody read held ~430 KiB each, ~100 KiB charged."""
    import asyncio

    ledger = Ledger(per_connection=1 << 20, per_sandbox=1 << 20)
    state = SimpleNamespace(buffers=ledger, connections={}, sandbox_key=lambda conn: "sandbox:a")
    monkeypatch.setattr(write_backlog, "_state", state)
    monkeypatch.setattr(write_backlog.asyncio, "ensure_future", lambda coroutine: coroutine.close())
    handler = _handler(100, [0] * len(read_ahead))
    readers = []
    loop = asyncio.new_event_loop()  # (asyncio's own reader, so that the attribute read is its own)
    for io, held in zip([io for conn, io in handler.transports.items() if conn.id != "c1"], read_ahead):
        io.reader = asyncio.StreamReader(loop=loop)
        io.reader.feed_data(b"x" * held)
        readers.append(io.reader)
    write_backlog.settle(handler)
    assert ledger.held(sandbox="sandbox:a") == 100 + sum(read_ahead)
    for reader, held in zip(readers, read_ahead):
        reader._buffer.clear()  # (taken by the handler's read loop)
    write_backlog.settle(handler)
    assert ledger.held(sandbox="sandbox:a") == 100
    loop.close()


def test_readers_feeding_a_backed_up_writer_are_charged_what_they_may_come_to_hold(monkeypatch):
    """An upstream's reader keeps reading while the client's writer is backed up, and no event comes
    to charge what it takes in: it is charged twice its limit and one read of the socket at once;
    the client's own reader is not (it feeds the upstreams, whose writers are not backed up)."""
    import asyncio

    ledger = Ledger(per_connection=1 << 24, per_sandbox=1 << 24)
    state = SimpleNamespace(buffers=ledger, connections={}, sandbox_key=lambda conn: "sandbox:a")
    monkeypatch.setattr(write_backlog, "_state", state)
    monkeypatch.setattr(write_backlog.asyncio, "ensure_future", lambda coroutine: coroutine.close())
    handler = _handler(200_000, [0])
    loop = asyncio.new_event_loop()
    for conn, io in handler.transports.items():
        io.reader = asyncio.StreamReader(limit=1 << 16, loop=loop)
        io.writer.transport.get_write_buffer_limits = lambda: (16384, 65536)
        io.writer.transport.max_size = 1 << 18
    upstream_reader = next(io.reader for conn, io in handler.transports.items() if conn.id != "c1")
    upstream_reader.feed_data(b"x" * 1000)
    write_backlog.settle(handler)
    assert ledger.held(sandbox="sandbox:a") == 200_000 + 2 * (1 << 16) + (1 << 18)
    next(io.writer for conn, io in handler.transports.items() if conn.id == "c1").size = 0  # drained
    write_backlog.settle(handler)
    assert ledger.held(sandbox="sandbox:a") == 1000  # what the reader holds now
    assert ledger.released == 0  # (the estimate was never memory)
    loop.close()
