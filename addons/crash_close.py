"""A connection whose event handling raised is reset and audited, not left running on a broken layer.

mitmproxy 12.3's `ConnectionHandler.server_event` catches every exception raised while the layers
handle an event (or while their commands are carried out), logs "mitmproxy has crashed!" and goes
on. The event is lost, the layer stack is left halfway through it, and the next event (the next
bytes, a hook completed, a wakeup) is fed to that stack. For an egress gateway that fails open:
- a check that raised let an HTTP/2 GET's unexpected body go upstream unrefused (review 47);
- an audit line that could not be written inside the HTTP layer left the connection hanging until
  `tcp_timeout`;
- a stream that waited for a hook when its connection crashed was resumed by the hook and sent its
  request head upstream (review 48).

Wrapping one layer, or one stream, was tried and reverted (e4fb4fd). A stream cannot tell a
finished exchange from a live one, and it cannot tell a paused stream from one that will resume.
A fix in one layer also leaves every other layer open to the same failure. So the fix sits where
every layer's exception lands, in the handler. `server_event` here is mitmproxy's own code, pinned
by hash in tests/unit/test_crash_close.py, with a different `except` branch. When handling an
event raises:

- **The connection fails closed.** Every socket of the handler is aborted: the sandbox's socket,
  each upstream socket, and an upstream still connecting. The sandbox's socket is reset (RST), not
  closed with a FIN. A response read until the connection closes must not look complete when it
  was cut short.
- **No later event reaches the layers.** An upstream's close, a hook's completion, a wakeup or
  bytes already read all go to the failed handler and are dropped there. A paused stream is never
  resumed, and nothing more is sent.
- **The connection's own tasks too.** An upstream's connect and reader, a hook's task and a wakeup
  run outside `server_event`; each is watched (`watch`), and the client's reader (addons/conn_close.py)
  catches what its turn and drains raise. Left alone, such a task's error was logged only when the
  task was collected, and the layer waiting for it held the client until `tcp_timeout`, then gave it
  a clean end (review 49).
- **It is said.** There is one `connection` audit line with reason `internal_error` (counted in
  metrics like any refusal). The log keeps mitmproxy's "mitmproxy has crashed!" line with the
  traceback (at most one a second for each place that raises; the others get the line with the
  place, and the next traceback counts them), unless the error is the audit log being unwritable. That error is expected, and it is
  counted once a second instead (addons/failclosed.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import struct
import time

from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands
from mitmproxy.proxy.server import ConnectionIO
from mitmproxy.utils import asyncio_utils

from gateway.decision import Decision, verdict_fields

from .audit_fields import connection_fields
from .failclosed import is_audit_failure, unwritable

FAILED_ATTR = "_egress_failed"  # on a ConnectionHandler: its handling raised (class default False)
CRASHED = Decision.deny("internal_error", "the gateway failed while handling this connection's traffic; "
                        "every socket of the connection was reset")
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST and drops what is queued

_state = None  # the GatewayState of the running gateway (install)
_mitmproxys = None  # mitmproxy's server_event, once replaced


async def server_event(self, event) -> None:
    """mitmproxy's ConnectionHandler.server_event (12.3): an event for a failed handler is dropped,
    and an exception fails the connection closed (`fail`) instead of being logged and passed over."""
    async with self._server_event_lock:
        # No `await` beyond this point.
        if self._egress_failed:
            return
        self.timeout_watchdog.register_activity()
        try:
            layer_commands = self.layer.handle_event(event)
            for command in layer_commands:
                if isinstance(command, commands.OpenConnection):
                    assert command.connection not in self.transports
                    handler = asyncio_utils.create_task(
                        self.open_connection(command),
                        name=f"server connection handler {command.connection.address}",
                        keep_ref=False,
                        client=self.client.peername,
                    )
                    self.transports[command.connection] = ConnectionIO(handler=handler)
                    watch(self, handler)
                elif isinstance(command, commands.RequestWakeup):
                    task = asyncio_utils.create_task(
                        self.wakeup(command),
                        name=f"wakeup timer ({command.delay:.1f}s)",
                        keep_ref=False,
                        client=self.client.peername,
                    )
                    assert task is not None
                    self.wakeup_timer.add(task)
                    watch(self, task)
                elif (
                    isinstance(command, commands.ConnectionCommand)
                    and command.connection not in self.transports
                ):
                    pass  # The connection has already been closed.
                elif isinstance(command, commands.SendData):
                    writer = self.transports[command.connection].writer
                    assert writer
                    if not writer.is_closing():
                        writer.write(command.data)
                elif isinstance(command, commands.CloseTcpConnection):
                    self.close_connection(command.connection, command.half_close)
                elif isinstance(command, commands.CloseConnection):
                    self.close_connection(command.connection, False)
                elif isinstance(command, commands.StartHook):
                    task = asyncio_utils.create_task(
                        self.hook_task(command),
                        name=f"handle_hook({command.name})",
                        keep_ref=True,
                        client=self.client.peername,
                    )
                    watch(self, task)
                elif isinstance(command, commands.Log):
                    self.log(command.message, command.level)
                else:
                    raise RuntimeError(f"Unexpected command: {command}")
        except Exception as exc:
            fail(self, exc)


def watch(handler, task) -> None:
    """A task the handler started (an upstream's connect and reader, a hook's, a wakeup's) fails the
    connection closed if it ends by raising: mitmproxy only logged it when the task was collected,
    and the layer waiting for it hung until `tcp_timeout` (review 49)."""
    task.add_done_callback(functools.partial(_task_ended, handler))


def _task_ended(handler, task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        fail(handler, exc)  # (after a failure: nothing more, the connection is already reset)


def fail(handler, exc: BaseException) -> None:
    """Fail the handler's connection closed: mark it, reset its sockets, audit and log why. Each
    step on its own: one that raises does not keep the next from running. Once per handler."""
    if getattr(handler, FAILED_ATTR):
        return
    setattr(handler, FAILED_ATTR, True)
    try:
        _reset_all(handler)
    finally:
        _say(handler, exc)


def _reset_all(handler) -> None:
    """Abort every socket of the connection, the sandbox's with a RST, and cancel their readers
    (an upstream still connecting too: its connect is abandoned)."""
    for connection, io in list(handler.transports.items()):
        connection.state = ConnectionState.CLOSED  # (a reader that then meets the EOF does not wait to write)
        writer = io.writer
        transport = getattr(writer, "transport", None)
        with contextlib.suppress(Exception):
            if transport is not None and connection.transport_protocol == "tcp":
                if connection is handler.client:
                    sock = transport.get_extra_info("socket")
                    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                transport.abort()
            elif writer is not None:  # (mitmproxy_rs streams: UDP, WireGuard, local redirect: this stream only)
                writer.close()
        if io.handler is not None:
            io.handler.cancel("egress gateway: the connection failed closed")


class TracebackBudget:
    """At most one traceback every `interval` seconds for each place that raised (the exception's
    type, file and line): a sandbox that can make its connections fail must not flood the log with
    tracebacks, nor keep another bug's traceback out of it (review 49: one budget for the whole
    process did). Each failure still gets its one line, and its audit line."""

    MAX_PLACES = 256  # places followed at once; past it the oldest are forgotten

    def __init__(self, interval: float = 1.0, clock=time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self._places: dict[tuple, list] = {}  # place -> [time of its last traceback, withheld since]

    def take(self, exc: BaseException) -> int | None:
        """The count withheld at `exc`'s place since its last traceback when one may be logged now,
        else None."""
        now = self.clock()
        place = _place(exc)
        seen = self._places.get(place)
        if seen is not None and now - seen[0] < self.interval:
            seen[1] += 1
            return None
        if seen is None and len(self._places) >= self.MAX_PLACES:
            del self._places[next(iter(self._places))]
        withheld = seen[1] if seen is not None else 0
        self._places[place] = [now, 0]
        return withheld


def _place(exc: BaseException) -> tuple:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ("?", 0)
    return (type(exc).__qualname__, *where)


tracebacks = TracebackBudget()


def _say(handler, exc: BaseException) -> None:
    if is_audit_failure(exc):
        unwritable.note(exc, refused=False)  # (expected; counted in its one warning a second: no 500 was sent)
    elif (withheld := tracebacks.take(exc)) is not None:
        since = f"; {withheld} more at this place since the last traceback" if withheld else ""
        handler.log("mitmproxy has crashed! The egress gateway reset every socket of this connection (fail "
                    f"closed; audited as internal_error{since})", logging.ERROR,
                    exc_info=(type(exc), exc, exc.__traceback__))
    else:
        type_, file, line = _place(exc)
        handler.log("mitmproxy has crashed! The egress gateway reset every socket of this connection (fail "
                    f"closed; audited as internal_error): {type_} at {file}:{line}, its traceback logged at "
                    "most once a second", logging.ERROR)
    state = _state
    if state is None:
        return
    try:
        conn = state.connections.get(handler.client.id)
        sandbox = state.scope(conn).sandbox if state.engine is not None else None
        state.record(event="connection", **connection_fields(conn, sandbox), **verdict_fields(CRASHED, status_sent=False))
    except Exception as failure:
        if is_audit_failure(failure):
            unwritable.note(failure, refused=False)
        else:
            logging.getLogger("egress").exception("egress gateway: could not audit a connection that failed closed")


def install(state) -> None:
    """Put this server_event in mitmproxy's place, before any wrapper of it: addons/write_backlog.py
    wraps what it finds, and installs this first."""
    global _state
    _state = state
    from mitmproxy.proxy import server

    current = server.ConnectionHandler.server_event
    inner = current
    while inner is not server_event and hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    if inner is server_event:
        return  # (installed, maybe wrapped since)
    if current.__module__ != server.__name__:
        raise RuntimeError("addons.crash_close must be installed before anything wraps ConnectionHandler.server_event "
                           f"(found {current.__module__}.{current.__qualname__})")
    global _mitmproxys
    _mitmproxys = current  # (kept: for tests, and so that no later function gets its id)
    setattr(server.ConnectionHandler, FAILED_ATTR, False)
    server.ConnectionHandler.server_event = server_event

