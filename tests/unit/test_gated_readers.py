"""An upstream reader waiting for its HTTP/2 client's gate (addons/h2_backpressure.py): its
transport stops reading while it waits, and what its StreamReader already holds is charged to the
client's sandbox until the gate opens (review 7: 2,000 gated readers held 340 MB uncharged). A
sandbox whose buffers hold its whole budget gets 503 buffer_budget for new requests
(addons/budget.py), and no other sandbox does."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from addons import h2_backpressure
from gateway.budget import Ledger


def test_a_gated_reader_is_paused_and_charged_until_its_gate_opens():
    async def scenario():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        theirs.sendall(b"x" * 50_000)
        while len(reader._buffer) < 50_000:
            await asyncio.sleep(0)  # the loop's read callbacks fill the StreamReader
        ledger = Ledger(per_connection=None, per_sandbox=40_000)
        client = SimpleNamespace(id="c1")
        original = h2_backpressure.ledger_account
        h2_backpressure.ledger_account = lambda c: ledger.account(c.id, "sandbox:a")
        try:
            undo = h2_backpressure._hold_while_gated(client, SimpleNamespace(reader=reader, writer=writer))
            assert not writer.transport.is_reading()
            assert ledger.held(sandbox="sandbox:a") == 50_000 and ledger.room("c2", "sandbox:a") == 0
            assert ledger.room("c3", "sandbox:b") == 40_000  # another sandbox is not charged
            undo()
            assert writer.transport.is_reading() and ledger.held(sandbox="sandbox:a") == 0
        finally:
            h2_backpressure.ledger_account = original
            writer.close()
            theirs.close()

    asyncio.run(scenario())


def test_a_reader_already_paused_by_its_stream_reader_is_left_to_it():
    async def scenario():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours, limit=1024)
        theirs.sendall(b"x" * 10_000)
        while not reader._paused:
            await asyncio.sleep(0)
        undo = h2_backpressure._hold_while_gated(SimpleNamespace(id="c1"), SimpleNamespace(reader=reader, writer=writer))
        undo()
        assert not writer.transport.is_reading()  # its own read() resumes it, not the gate
        await reader.read(100_000)
        assert writer.transport.is_reading()
        writer.close()
        theirs.close()

    asyncio.run(scenario())


def test_a_sandbox_holding_its_whole_budget_gets_no_new_request():
    from addons.budget import BufferBudget
    from addons.state import GatewayState
    from gateway.decision import Decision

    state = GatewayState()
    state.buffers = Ledger(per_connection=None, per_sandbox=1000)
    budget = BufferBudget(state)
    allowed = Decision.allow("r", "allowed")
    ours = state.connection("c1", ("10.0.0.2", 5000))
    state.connection("c2", ("10.0.0.3", 5000))
    flow = SimpleNamespace(client_conn=SimpleNamespace(id="c1"))
    other = SimpleNamespace(client_conn=SimpleNamespace(id="c2"))
    held = state.buffers.account("c1", state.sandbox_key(ours))
    held.hold(999)
    assert budget.sandbox_full(flow, allowed) is None
    held.hold(1)  # (charges that cannot be refused: unread writes, gated readers)
    refusal = budget.sandbox_full(flow, allowed)
    assert (refusal.reason, refusal.status, refusal.rule) == ("buffer_budget", 503, "r")
    assert budget.sandbox_full(other, allowed) is None  # another sandbox (client address) is served
    held.release(1)
    assert budget.sandbox_full(flow, allowed) is None
