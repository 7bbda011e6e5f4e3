"""Bytes written to a client, or to an upstream of its connection, that the peer has not read yet,
and bytes its stream readers hold that the gateway has not taken yet, are charged to the client's
buffer budget.

A buffered response's charge (addons/http_stream.py) ends when its stream completes, but its bytes then
sit in the asyncio transport's write buffer until the client reads them: 30 tunnels of one
sandbox, each fetching a 14 MiB body it never read, held 1 GB with the ledger back at zero, and a
31st was still served. Here, after every event a client connection's handler processes
(ConnectionHandler.server_event, mitmproxy 12.3), what its transport still holds is charged to one
account of that connection (`Account.hold`: it is already held, so it is counted even past the
limits and new buffers of the sandbox find no room); a task waits for the transport to drain and
gives the charge back as the bytes go out. At most the transport's high-water mark (64 KiB) may
stay charged until the connection's next event; the connection's close releases the rest
(BufferBudget.client_disconnected drops its accounts).

The connection's upstream transports are summed in too: a WebSocket (or a streamed body) relayed
to an upstream that does not read sat in its transport uncharged (10 connections of 8 MiB
messages: RSS +207 MB, and the same sandbox's reassemblies were still admitted; review 6).

A transport closed with bytes still queued goes on sending them while its peer reads
(addons/conn_close.py aborts it once its peer stops reading): `closing` moves their charge from the
connection's account, which its close drops, to one of their own, given back as they go out and
closed with the socket. Released at the close, they were held uncounted: a sandbox whose clients
closed 8 MB WebSocket messages they never read kept a worker at 376-503 MiB against 116-121
(review 39), its next messages admitted as if its budget were free.
"""

from __future__ import annotations

import asyncio
import logging

from . import conn_close, crash_close

_state = None  # the GatewayState of the running gateway (install)
ATTR = "_egress_write_backlog"


def _writers(handler) -> list:
    """The asyncio stream writers of the connection's transports (client and upstreams) that have
    a transport to ask. Transparent and local-redirect clients are mitmproxy_rs streams: no asyncio
    transport (their writes go to mitmproxy_rs's own bounded buffers), so they are not counted."""
    found = []
    for io in list(handler.transports.values()):
        writer = getattr(io, "writer", None)
        if getattr(writer, "transport", None) is not None:
            found.append(writer)
    return found


PIECE_COST = 64  # what one queued write costs besides its bytes: the object's header, its deque slot


def _size(writer) -> int:
    """The memory the writer's transport holds: what it has still to send, each queued write's own
    cost, and the rest of the object its first queued piece is part of. asyncio keeps a partly sent
    write as a memoryview of it (`_buffer`, Python 3.12), so the whole object lives until its last
    byte is sent: with 5.2 MB of an 8 MB message left, 8 MB are held (review 39's churn held 1.5x
    what was charged). Only the first piece can be such a slice (one made at a partial send), so
    this stays O(1) beyond asyncio's own sum. Empty WebSocket messages were charged 2 bytes each for
    ~56 held (review 40)."""
    try:
        transport = writer.transport
        queued = transport.get_write_buffer_size()
        buffer = getattr(transport, "_buffer", None) if queued else None
        if buffer:
            queued += PIECE_COST * len(buffer)
            first = buffer[0]
            if isinstance(first, memoryview) and isinstance(first.obj, (bytes, bytearray)):
                queued += len(first.obj) - first.nbytes
        return queued
    except Exception:  # a transport being torn down
        return 0


READ_SIZE = 256 * 1024  # what asyncio's socket transport reads at once (its max_size), if it says nothing


def _backed_up(writer) -> bool:
    """The writer's transport holds more than its high-water mark: the handler waits for it to
    drain before it takes anything more from its other connections' readers."""
    try:
        return writer.transport.get_write_buffer_size() > writer.transport.get_write_buffer_limits()[1]
    except Exception:  # a transport being torn down
        return False


def _reader_held(io, full: bool) -> int:
    """What a stream reader holds: read from its socket and not taken yet. `full`: what it may come
    to hold while nothing takes from it (twice its limit, then one more read of the socket, before
    asyncio pauses it), since it keeps reading without an event to charge it at."""
    reader = getattr(io, "reader", None)
    buffered = getattr(reader, "_buffer", None)
    if buffered is None:
        return 0
    if not full:
        return len(buffered)
    transport = getattr(getattr(io, "writer", None), "transport", None)
    return max(len(buffered), 2 * getattr(reader, "_limit", 0) + getattr(transport, "max_size", READ_SIZE))


def _backlog(handler) -> int | None:
    """What the connection's writers hold (`_size` of each with a transport) and its stream readers
    hold or may come to hold; None if no transport has a writer to ask.

    An upstream's reader fills while the client's writer is backed up (and the client's while an
    upstream's is), with no event to charge it at: 990 tunnels of one sandbox, each a download it
    never read, held ~430 KiB each while ~100 KiB was charged (review 32: RSS 83 -> 501 MiB past a
    128 MiB sandbox budget). So while the writer they feed is backed up, readers are charged what
    they may come to hold (`_reader_held`). One walk over the transports for the writers, one for
    the readers: this runs after every event of every connection (synchronous, so the transports
    cannot change under it)."""
    transports = handler.transports
    client_io = transports.get(handler.client)
    size, any_writer, client_backed, upstream_backed = 0, False, False, False
    for io in transports.values():
        writer = getattr(io, "writer", None)
        transport = getattr(writer, "transport", None)
        if transport is None:
            continue
        any_writer = True
        size += _size(writer)
        if _backed_up(writer):
            if io is client_io:
                client_backed = True
            else:
                upstream_backed = True
    if not any_writer:
        return None
    for io in transports.values():
        size += _reader_held(io, upstream_backed if io is client_io else client_backed)
    return size


def settle(handler) -> None:
    """Charge (or give back) what the client's transport holds now; start a drain watcher if any.
    What is given back is not counted as freed (`freed=False`): transports and readers hold bytes,
    freed by reference counting, and part of a reader's charge is an estimate, never memory at all;
    counted, it drove thaws of the collector (addons/gc_freeze.py) that found nothing (review 33)."""
    state = _state
    if state is None:
        return
    size = _backlog(handler)
    account = getattr(handler, ATTR, None)
    if size is None:
        return
    if account is None or account.closed:
        if size == 0:
            return
        client = handler.client
        account = state.buffers.account(client.id, state.sandbox_key(state.connections.get(client.id)))
        setattr(handler, ATTR, account)
    if size > account.held:
        account.hold(size - account.held)
    elif size < account.held:
        account.release(account.held - size, freed=False)
    if account.held and getattr(handler, ATTR + "_task", None) is None:
        setattr(handler, ATTR + "_task", asyncio.ensure_future(_drained(handler, account)))


async def _drained(handler, account) -> None:
    try:
        while account.held and not account.closed:
            waiting = [w for w in _writers(handler) if _size(w) and not w.is_closing()]
            if not waiting:
                break
            for writer in waiting:
                await writer.drain()  # below the transport's high-water mark
            size = _backlog(handler)
            if size is None:
                break
            account.release(max(account.held - size, 0), freed=False)
            if size and size <= 64 * 1024:
                break  # a small remainder: corrected at the connection's next event
            if size:
                await asyncio.sleep(0.05)
    except Exception:  # the connection went away: its close releases the account
        pass
    finally:
        setattr(handler, ATTR + "_task", None)


CLOSING_UPDATE_SECONDS = 0.5  # how often a lingering socket's charge follows what it still holds
_closing_tasks: set[asyncio.Task] = set()  # (the loop keeps only weak references to tasks)


def closing(handler, writer, gone: asyncio.Future) -> None:
    """`writer`, one of the handler's transports, was closed with bytes queued (addons/conn_close.py
    tells, `on_linger`): they stay charged to the client's sandbox until the socket is `gone`."""
    state = _state
    queued = _size(writer)
    if state is None or not queued:
        return
    backlog = getattr(handler, ATTR, None)
    if backlog is not None and not backlog.closed:
        backlog.release(min(queued, backlog.held), freed=False)  # (now charged here instead)
        sandbox = backlog.sandbox
    else:
        sandbox = state.sandbox_key(state.connections.get(handler.client.id))
    account = state.buffers.account(f"{handler.client.id}/closing", sandbox)
    account.hold(queued)
    task = asyncio.ensure_future(_closing_drained(writer, account, gone))
    _closing_tasks.add(task)
    task.add_done_callback(_closing_tasks.discard)


async def _closing_drained(writer, account, gone: asyncio.Future) -> None:
    """Follow what the lingering socket still holds until it is gone."""
    try:
        while not gone.done():
            await asyncio.wait({gone}, timeout=CLOSING_UPDATE_SECONDS)
            account.release(max(account.held - _size(writer), 0), freed=False)
    finally:
        account.release(freed=False)  # (freed by reference counting: no collection needed)
        account.close()


def install(state) -> None:
    """Wrap ConnectionHandler.server_event once; `state` is the gateway whose ledger is charged."""
    global _state
    _state = state
    crash_close.install(state)  # the server_event wrapped below: an event that raises fails its connection closed
    conn_close.on_linger("buffer budget", closing)
    from mitmproxy.proxy import server

    original = server.ConnectionHandler.server_event
    if getattr(original, "_egress_backlog", False):
        return

    async def server_event(self, event) -> None:
        await original(self, event)
        try:
            settle(self)
        except Exception:
            logging.getLogger("egress").exception("egress gateway: could not charge a client's write backlog")

    server_event._egress_backlog = True
    server_event.__wrapped__ = original
    server.ConnectionHandler.server_event = server_event
