"""Back-pressure from HTTP/2 clients to upstreams.

mitmproxy stops reading while a socket's write buffer is full (ConnectionHandler.drain_writers),
which throttles an upstream to the speed of an HTTP/1 client. An HTTP/2 client throttles by flow
control instead: what its window does not admit, mitmproxy's h2 connection buffers, and nothing
stops the upstream, so a client that reads slowly, or never sends WINDOW_UPDATE, made the gateway
hold a whole download in memory (a sandbox could exhaust a worker with one request).

Here the gateway's HTTP/2 server (addons/http2_server.py) keeps one gate per client connection: closed
while more than HIGH_WATER bytes wait for the client's window, open again below LOW_WATER. After
each read, a task that reads an *upstream* socket of that client waits for the gate; the task that
reads the client's own socket never waits (it must keep receiving WINDOW_UPDATE). Memory per
client connection stays near HIGH_WATER plus one read; an idle wait ends at tcp_timeout.

The same bytes are also summed per sandbox: a sandbox with many slow HTTP/2 connections could
otherwise make the gateway hold HIGH_WATER for each (250 connections: 1 GiB). While a sandbox's
total is over `sandbox_high_water` (option egress_h2_max_unread_bytes_per_sandbox, 16 MiB), the
gates of all its connections close; they open again once it is under half of it (and each
connection is under its own LOW_WATER). A connection's gate closes at its own next event, so
each may overshoot by one read. Only that sandbox's own downloads wait.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import Counter

from gateway.options import DEFAULT_SANDBOX_HIGH_WATER

HIGH_WATER = 4 * 1024 * 1024
LOW_WATER = 1 * 1024 * 1024


_gates: "weakref.WeakKeyDictionary[object, asyncio.Event]" = weakref.WeakKeyDictionary()
_unread: "weakref.WeakKeyDictionary[object, tuple[str | None, int]]" = weakref.WeakKeyDictionary()
_sandbox_unread: Counter[str] = Counter()
_members: "dict[str, weakref.WeakSet]" = {}
_gated: set[str] = set()  # sandboxes whose total closed gates: the only ones _reopen has work for
sandbox_high_water = DEFAULT_SANDBOX_HIGH_WATER  # set from the option (addons/h2_limits.py)


def _sandbox_over(sandbox: str | None) -> bool:
    return bool(sandbox_high_water) and sandbox is not None and _sandbox_unread[sandbox] > sandbox_high_water


def _sandbox_under(sandbox: str | None) -> bool:
    return not sandbox_high_water or sandbox is None or _sandbox_unread[sandbox] <= sandbox_high_water // 2


def _account(client, unread: int, sandbox: str | None) -> None:
    old_sandbox, old = _unread.pop(client, (None, 0))
    if old_sandbox is not None:
        _sandbox_unread[old_sandbox] -= old
        if _sandbox_unread[old_sandbox] <= 0:
            del _sandbox_unread[old_sandbox]
    if sandbox is not None:
        _unread[client] = (sandbox, unread)
        if unread:
            _sandbox_unread[sandbox] += unread
        _members.setdefault(sandbox, weakref.WeakSet()).add(client)


def _reopen(sandbox: str | None) -> None:
    """The sandbox is under its low water again: open the gates its total alone kept closed."""
    if sandbox is None or sandbox not in _gated or not _sandbox_under(sandbox):
        return
    _gated.discard(sandbox)
    for member in list(_members.get(sandbox, ())):
        gate = _gates.get(member)
        if gate is not None and not gate.is_set() and _unread.get(member, (None, 0))[1] <= LOW_WATER:
            gate.set()
    if not _members.get(sandbox, True):
        _members.pop(sandbox, None)


def update(client, unread: int, sandbox: str | None = None) -> None:
    """Called by the HTTP/2 server after every event with the bytes waiting for the client
    (`sandbox`: the key its per-sandbox total is summed under; None: not summed)."""
    _account(client, unread, sandbox)
    gate = _gates.get(client)
    if gate is None:
        if unread <= HIGH_WATER and not _sandbox_over(sandbox):
            _reopen(sandbox)
            return
        gate = _gates[client] = asyncio.Event()
        gate.set()
    if unread > HIGH_WATER or _sandbox_over(sandbox):
        gate.clear()
        if _sandbox_over(sandbox):
            _gated.add(sandbox)
    elif unread <= LOW_WATER and _sandbox_under(sandbox):
        gate.set()
    _reopen(sandbox)


def release(client) -> None:
    """The client connection is gone: nothing waits for it any more."""
    sandbox = _unread.get(client, (None, 0))[0]
    _account(client, 0, None)
    if sandbox is not None and sandbox in _members:
        _members[sandbox].discard(client)
    gate = _gates.pop(client, None)
    if gate is not None:
        gate.set()
    _reopen(sandbox)


def held(sandbox: str) -> int:
    """Bytes waiting for the windows of the sandbox's HTTP/2 clients (for tests and metrics)."""
    return _sandbox_unread[sandbox]


# Per client connection: [seconds its reader spent waiting for writers, when the current wait began,
# how deep the current wait is nested].
_not_reading: "weakref.WeakKeyDictionary[object, list]" = weakref.WeakKeyDictionary()


def _upstream_backed_up(handler, client_io) -> bool:
    """Whether an upstream's write buffer is over its high-water mark: what the client's reader
    would wait for, if it waits, is then (also) an upstream that does not read."""
    for io in list(handler.transports.values()):
        transport = getattr(getattr(io, "writer", None), "transport", None)
        if io is client_io or transport is None:
            continue
        try:
            if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
                return True
        except Exception:  # a transport being torn down
            continue
    return False


def reading_clock(client):
    """A clock that stops while the gateway is not reading this client (its reader waits for an
    upstream to take what the client sent): a deadline on what the client sends (an HTTP/2 frame
    that must arrive whole) counts only time the client could have sent in (review 9: an upload
    whose upstream stalled for 30 s lost its connection to the frame deadline)."""
    def clock() -> float:
        now = time.monotonic()
        entry = _not_reading.get(client)
        if entry is None:
            return now
        waited, since = entry[0], entry[1]
        return now - waited - (now - since if since is not None else 0.0)

    return clock


# Makes a buffer-ledger account for a client connection (set by addons/budget.py): what a gated
# upstream reader holds is charged to the client's sandbox while it waits.
ledger_account = None


def _hold_while_gated(client, io):
    """An upstream reader waits for its client's gate: its transport stops reading (nothing more
    piles up in its StreamReader meanwhile), and what the StreamReader already holds is charged to
    the client's sandbox, whose new requests find no room past its budget (review 7: 2,000 gated
    readers held ~170 KB each, 340 MB of one sandbox, uncharged). Returns the undo."""
    reader = getattr(io, "reader", None)
    transport = getattr(getattr(io, "writer", None), "transport", None)
    paused = None
    if (transport is not None and hasattr(transport, "pause_reading") and not transport.is_closing()
            and not getattr(reader, "_paused", True) and transport.is_reading()):
        transport.pause_reading()
        paused = transport
    account = None
    buffered = len(getattr(reader, "_buffer", b""))
    if buffered and ledger_account is not None:
        account = ledger_account(client)
        account.hold(buffered)

    def undo() -> None:
        if paused is not None and not paused.is_closing():
            paused.resume_reading()
        if account is not None:
            account.close()

    return undo


def install() -> None:
    """Wrap ConnectionHandler.drain_writers (mitmproxy 12.3: awaited after every read of every
    connection of a client) so that upstream readers also wait for the client's gate."""
    from mitmproxy.proxy import server

    original = server.ConnectionHandler.drain_writers
    if getattr(original, "_egress_backpressure", False):
        return

    async def drain_writers(self) -> None:
        task = asyncio.current_task()
        client_io = self.transports.get(self.client)
        if client_io is not None and task is client_io.handler:
            # The client's own reader: it waits only for writers, never for the gate (it brings the
            # WINDOW_UPDATEs that open it). A wait for an upstream that does not read the client's
            # upload is not the client's time; a wait for the client's own socket (it does not read
            # its download) is (review 10: counting that let a client stop its own clock).
            if not _upstream_backed_up(self, client_io):
                await original(self)
                return
            entry = _not_reading.get(self.client)
            if entry is None:
                entry = _not_reading[self.client] = [0.0, None, 0]
            if not entry[2]:  # (the wait may be entered again from within: the outermost one counts)
                entry[1] = time.monotonic()
            entry[2] += 1
            try:
                await original(self)
            finally:
                entry[2] -= 1
                if not entry[2] and entry[1] is not None:
                    entry[0] += time.monotonic() - entry[1]
                    entry[1] = None
            return
        await original(self)
        gate = _gates.get(self.client)
        if gate is None or gate.is_set():
            return
        upstream_io = next((io for io in list(self.transports.values()) if io.handler is task), None)
        held = _hold_while_gated(self.client, upstream_io)
        try:
            await gate.wait()
        finally:
            held()

    drain_writers._egress_backpressure = True
    server.ConnectionHandler.drain_writers = drain_writers
