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
