"""What a connection may read ahead while one of its layers waits for a hook.

mitmproxy's layers pause while a blocking hook runs (`websocket_message` for each WebSocket
message, `tcp_message` for each read of a raw TCP connection) and queue whatever arrives meanwhile
(`Layer._paused_event_queue`), while the connection's readers go on reading: they only wait for
full write buffers (ConnectionHandler.drain_writers), and nothing is written while the layer is
paused. A client sending 1-byte WebSocket messages, one hook each, had 123 MiB read ahead and
queued in 3 s, charged to no budget.

Here such a layer calls `settle(layer)` after each event it handled: while its queue holds more
than `READ_AHEAD_BYTES` of data, the connection's gate closes and every reader of the connection
(client and upstream) waits before its next read, until the layer has worked the queue down to
half. That is TCP back-pressure, not a refusal: the sender's window fills and it slows down. A
hook always completes without new bytes (none of the gateway's hooks waits for the network), so
the queue always drains. HTTP streams charge what they queue to the buffer budget instead
(addons/http_stream.py `GatewayHttpStream`).
"""

from __future__ import annotations

import asyncio

from mitmproxy.proxy import events

READ_AHEAD_BYTES = 256 * 1024  # per connection; a hook takes microseconds, so real clients queue far less

_gates: dict[object, asyncio.Event] = {}  # client connection -> gate, only while closed
_held: dict[object, dict[int, int]] = {}  # client connection -> id of what holds its gate closed -> bytes


def queued_bytes(layer) -> int:
    """Data waiting in the layer's queue (a few entries of up to 64 KiB each while bounded)."""
    if layer._paused is None:
        return 0
    return sum(len(e.data) for e in layer._paused_event_queue if isinstance(e, events.DataReceived))


def settle(layer) -> None:
    """After the layer handled an event: close or open its connection's gate."""
    settle_bytes(layer.context.client, layer, queued_bytes(layer))


def settle_bytes(client, source, queued: int) -> None:
    """`source` (a layer of the client's connection) holds `queued` bytes it has not worked off yet
    (its paused queue; an upstream body whose parse was cut at its slice, addons/http1.py): the
    gate closes while any source holds more than READ_AHEAD_BYTES, and opens once every one that
    did is down to half."""
    held = _held.get(client)
    if queued > READ_AHEAD_BYTES:
        if held is None:
            held = _held[client] = {}
        held[id(source)] = queued
        if client not in _gates:
            _gates[client] = asyncio.Event()
    elif held is not None and id(source) in held:
        if queued > READ_AHEAD_BYTES // 2:
            held[id(source)] = queued
            return
        del held[id(source)]
        if not held:
            release(client)


def release(client) -> None:
    _held.pop(client, None)
    gate = _gates.pop(client, None)
    if gate is not None:
        gate.set()


def closed(client) -> bool:
    """Whether the client's readers are held (for tests)."""
    return client in _gates


def install() -> None:
    """Wrap ConnectionHandler.drain_writers (awaited after every read of every connection of a
    client, mitmproxy 12.3) so that readers wait at a closed gate."""
    from mitmproxy.proxy import server

    original = server.ConnectionHandler.drain_writers
    if getattr(original, "_egress_read_ahead", False):
        return

    async def drain_writers(self) -> None:
        await original(self)
        gate = _gates.get(self.client)
        if gate is not None:
            await gate.wait()

    drain_writers._egress_read_ahead = True
    server.ConnectionHandler.drain_writers = drain_writers
