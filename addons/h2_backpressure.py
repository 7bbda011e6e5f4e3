"""Back-pressure from HTTP/2 clients to upstreams.

mitmproxy stops reading while a socket's write buffer is full (ConnectionHandler.drain_writers),
which throttles an upstream to the speed of an HTTP/1 client. An HTTP/2 client throttles by flow
control instead: what its window does not admit, mitmproxy's h2 connection buffers, and nothing
stops the upstream, so a client that reads slowly, or never sends WINDOW_UPDATE, made the gateway
hold a whole download in memory (a sandbox could exhaust a worker with one request).

Here the gateway's HTTP/2 server (addons/layers.py) keeps one gate per client connection: closed
while more than HIGH_WATER bytes wait for the client's window, open again below LOW_WATER. After
each read, a task that reads an *upstream* socket of that client waits for the gate; the task that
reads the client's own socket never waits (it must keep receiving WINDOW_UPDATE). Memory per
client connection stays near HIGH_WATER plus one read; an idle wait ends at tcp_timeout.
"""

from __future__ import annotations

import asyncio
import weakref

HIGH_WATER = 4 * 1024 * 1024
LOW_WATER = 1 * 1024 * 1024

_gates: "weakref.WeakKeyDictionary[object, asyncio.Event]" = weakref.WeakKeyDictionary()


def update(client, unread: int) -> None:
    """Called by the HTTP/2 server after every event with the bytes waiting for the client."""
    gate = _gates.get(client)
    if gate is None:
        if unread <= HIGH_WATER:
            return
        gate = _gates[client] = asyncio.Event()
        gate.set()
    if unread > HIGH_WATER:
        gate.clear()
    elif unread <= LOW_WATER:
        gate.set()


def release(client) -> None:
    """The client connection is gone: nothing waits for it any more."""
    gate = _gates.pop(client, None)
    if gate is not None:
        gate.set()


def install() -> None:
    """Wrap ConnectionHandler.drain_writers (mitmproxy 12.3: awaited after every read of every
    connection of a client) so that upstream readers also wait for the client's gate."""
    from mitmproxy.proxy import server

    original = server.ConnectionHandler.drain_writers
    if getattr(original, "_egress_backpressure", False):
        return

    async def drain_writers(self) -> None:
        await original(self)
        gate = _gates.get(self.client)
        if gate is None or gate.is_set():
            return
        client_io = self.transports.get(self.client)
        if client_io is not None and asyncio.current_task() is client_io.handler:
            return  # the client's own reader: it brings the WINDOW_UPDATEs that open the gate
        await gate.wait()

    drain_writers._egress_backpressure = True
    server.ConnectionHandler.drain_writers = drain_writers
