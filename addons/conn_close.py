"""Every connection's socket is closed when its handler ends, whatever ended it.

mitmproxy 12.3's `ConnectionHandler.handle_connection` closes the writer only on its normal path:
a cancellation ("closed by command", "timeout", "client disconnected") that lands while the task
waits in `server_event` (on `_server_event_lock`, e.g. for a second DataReceived queued behind the
one whose refusal closed the connection) is not caught there, so `writer.close()` and the
`transports.pop` are skipped. The socket then stayed open until the garbage collector found it
(ESTAB, then CLOSE-WAIT, ~66 s seen), after the `client disconnect` line, after
`client_disconnected` had released the connection from the per-sandbox count and outside
`tcp_timeout`: every early refusal (ClientHello too large, malformed, too many records,
non-HTTP bytes) sent in one burst with more bytes leaked a file descriptor (300 refusals: 300
fds held for > 30 s).

`install()` replaces handle_connection with the same loop in which every await may be cancelled
and the writer is closed, and the transport forgotten, in a `finally`. The writer's close flushes
what was queued (an alert, a 400) and then closes the socket; the client handler ends (and
`client_disconnected` releases the sandbox's count) only after this has run. A socket that lingers
to send what was queued stays counted (`on_linger`) until it is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from . import crash_close, stream_memory


# A closed connection's socket goes on sending what was queued while its peer reads: at least
# MIN_DRAIN_BYTES every CLOSE_DRAIN_SECONDS, else it is aborted (what the kernel already holds is
# still sent). The close waits for the transport's buffer to drain with no deadline of its own: a
# peer that never reads kept the socket (a descriptor and the queued bytes) for as long as it liked,
# uncounted (review 38: one sandbox held 246 of a worker's 256 descriptors while its count said 0).
# While it lingers, the socket stays counted against its sandbox: its descriptor (addons/limits.py)
# and its bytes (addons/write_backlog.py), each told by a listener (`on_linger`). So a peer that
# reads, however slowly, is not cut: a flat 5 s deadline cut a WebSocket client reading a 12 MB
# message at 1 MB/s at 8.2 MB (review 39), an overall one at 5 s plus the queue at 1 MiB/s one
# reading at 500 KB/s (review 40); the sandbox's budgets bound what its lingering sockets hold.
CLOSE_DRAIN_SECONDS = 5.0
MIN_DRAIN_BYTES = 64 * 1024

# name -> listener(handler, writer, gone): told that one of the handler's sockets lingers after its
# close to send what was queued; `gone` is a future done once the socket is closed or aborted.
_linger_listeners: dict[str, Callable] = {}


def on_linger(name: str, listener: Callable) -> None:
    """Register (or replace) what is told of lingering sockets."""
    _linger_listeners[name] = listener


def _lingers(handler, writer) -> None:
    """The writer was just closed: if its socket lingers with bytes queued, tell the listeners and
    abort it once its peer stops reading."""
    transport = getattr(writer, "transport", None)
    if transport is None or not transport.get_write_buffer_size():
        return  # (closed at once)
    gone = asyncio.ensure_future(writer.wait_closed())
    gone.add_done_callback(lambda done: done.cancelled() or done.exception())  # (a reset: retrieved)
    for name, listener in list(_linger_listeners.items()):
        try:
            listener(handler, writer, gone)
        except Exception:
            logging.getLogger("egress").exception("egress gateway: %s could not count a lingering socket", name)
    _abort_if_still_draining(writer)


def _abort_if_still_draining(writer) -> None:
    transport = getattr(writer, "transport", None)
    queued = transport.get_write_buffer_size() if transport is not None else 0
    if not queued:
        return  # (closed at once)
    loop = asyncio.get_running_loop()

    def check(before: int) -> None:
        left = transport.get_write_buffer_size()
        if not left:
            return
        if before - left < MIN_DRAIN_BYTES:
            transport.abort()
        else:
            loop.call_later(CLOSE_DRAIN_SECONDS, check, left)

    loop.call_later(CLOSE_DRAIN_SECONDS, check, queued)


def install() -> None:
    from mitmproxy.connection import ConnectionState
    from mitmproxy.proxy import events, server

    if getattr(server.ConnectionHandler.handle_connection, "_egress_closes", False):
        return

    async def handle_connection(self, connection) -> None:
        """mitmproxy's handle_connection (12.3), with the close in a finally."""
        cancelled: BaseException | None = None
        try:
            reader = self.transports[connection].reader
            assert reader
            # (flags, not the bound methods: a coroutine's locals are kept while it waits)
            sized = hasattr(self, "egress_read_size")  # how much one read may take (addons/fair_share.py)
            turns = hasattr(self, "egress_turn")  # its sandbox's turn on the loop (addons/fair_share.py)
            lean = type(reader) is asyncio.StreamReader  # waited on here (addons/stream_memory.py)
            while True:
                try:
                    size = self.egress_read_size() if sized else 65535
                    if lean:
                        data = stream_memory.read_now(reader, size)
                        if data is None:
                            waiter = stream_memory.data_waiter(reader)
                            try:
                                await waiter
                            finally:
                                reader._waiter = None
                            data = stream_memory.buffered(reader, size)
                    else:  # (mitmproxy_rs streams: transparent and local-redirect clients, UDP)
                        data = await reader.read(size)
                    if not data:
                        raise OSError("Connection closed by peer.")
                except OSError:
                    break
                except asyncio.CancelledError as e:
                    cancelled = e
                    break
                except Exception as exc:  # a bug in the read (its size, the reader): fails closed (review 50)
                    crash_close.fail(self, exc)
                    break
                try:
                    if turns:
                        await self.egress_turn()
                    await self.server_event(events.DataReceived(connection, data))
                    await self.drain_writers()
                except asyncio.CancelledError as e:  # mitmproxy lets this one escape the close
                    cancelled = e
                    break
                except Exception as exc:  # a bug in the turn or a drain: the connection fails closed
                    crash_close.fail(self, exc)
                    break

            if cancelled is None and connection.transport_protocol == "tcp":
                connection.state &= ~ConnectionState.CAN_READ  # half-closed by the peer
            else:
                connection.state = ConnectionState.CLOSED
            delivery = asyncio.ensure_future(self.server_event(events.ConnectionClosed(connection)))
            try:
                await asyncio.shield(delivery)
                if connection.state is ConnectionState.CAN_WRITE:
                    # the peer closed its side; we may still send until cancelled
                    await asyncio.Event().wait()
            except asyncio.CancelledError as e:
                cancelled = cancelled or e
                if not delivery.done():
                    # A cancel that came while the close waited for the connection's lock does not
                    # drop it: an upstream reset while a layer still parsed what it had read, a
                    # drain of its writer then failed and cancelled this reader, and the layer never
                    # learnt that its connection had ended (review 34: the client's stream hung
                    # until its 120 s body timeout).
                    try:
                        await delivery
                    except asyncio.CancelledError:
                        pass
        finally:
            connection.state = ConnectionState.CLOSED
            io = self.transports.pop(connection, None)
            writer = io.writer if io is not None else None
            if writer is not None:
                try:
                    writer.close()
                except (OSError, RuntimeError):
                    transport = getattr(writer, "transport", None)
                    if transport is not None:
                        transport.abort()
                else:
                    _lingers(self, writer)
        if cancelled is not None:
            raise cancelled

    handle_connection._egress_closes = True
    server.ConnectionHandler.handle_connection = handle_connection
