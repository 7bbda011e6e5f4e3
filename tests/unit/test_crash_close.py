"""addons/crash_close.py: an event whose handling raises fails its connection closed.

A real mitmproxy ConnectionHandler on real loopback sockets, its root layer replaced by a scripted
one. The layer raises at one kind of event (every kind a handler delivers), or the handler itself
fails on a command. Then:
- the sandbox's socket is reset, not closed with a FIN;
- every upstream socket is reset too, and an upstream still connecting never connects;
- no event after the failure reaches the layer: a hook's completion does not resume it;
- one `internal_error` connection line is recorded;
- the log has mitmproxy's crash line with the traceback, except when the audit log is unwritable.
mitmproxy's server_event, which the module copies, is pinned by hash."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
import logging
import socket
from dataclasses import dataclass

import pytest
from mitmproxy import options as moptions
from mitmproxy.connection import Server
from mitmproxy.proxy import commands, events, layer, mode_specs, server, server_hooks

from addons import conn_close, conn_timers, crash_close
from addons.state import GatewayState
from gateway.audit import AuditWriteError

MITMPROXY_SERVER_EVENT = "ffbed451b4933f30d26bc1e2b1cb0a1c3f9ec7b94bb32a742f6faec3604b8cc0"
TIMEOUT = 10.0  # a deadline for a test that has gone wrong, never a wait for something to happen


def _mitmproxy_source(name: str) -> str:
    source = inspect.getsource(server)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "ConnectionHandler")
    found = next(f for f in cls.body if isinstance(f, ast.AsyncFunctionDef) and f.name == name)
    return ast.get_source_segment(source, found)


def test_mitmproxy_s_server_event_is_the_one_copied():
    digest = hashlib.sha256(_mitmproxy_source("server_event").encode()).hexdigest()
    assert digest == MITMPROXY_SERVER_EVENT, (
        "mitmproxy's ConnectionHandler.server_event changed: carry the change into addons/crash_close.py's "
        "copy, then update the hash")


class _Ours(ast.NodeTransformer):
    """The copy's additions undone: the `watch` of each task it starts, and the name it gives the
    hook's task for that."""

    def visit_Expr(self, node):
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "watch":
            return None
        return self.generic_visit(node)

    def visit_Assign(self, node):
        if (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "asyncio_utils.create_task"
                and "hook_task" in ast.unparse(node.value.args[0])):
            return ast.Expr(node.value)
        return self.generic_visit(node)


def test_the_copy_differs_from_mitmproxy_s_only_in_the_failure_branch():
    """The copied body, statement for statement, but for the dropped events, the tasks watched and
    the except branch."""
    def locked(source: str) -> list[ast.stmt]:  # the statements in the `async with`
        return next(n for n in ast.parse(source).body[0].body if isinstance(n, ast.AsyncWith)).body

    ours = locked(inspect.getsource(crash_close.server_event))
    theirs = locked(_mitmproxy_source("server_event").strip())
    ours = [s for s in ours if not (isinstance(s, ast.If) and ast.unparse(s.test) == "self._egress_failed")]
    assert len(ours) == len(theirs) == 2
    assert ast.unparse(ours[0]) == ast.unparse(theirs[0])  # register_activity
    our_try, their_try = ours[1], theirs[1]
    assert ast.unparse(our_try.body).count("watch(self,") == 3  # the upstream's, the wakeup's and the hook's tasks
    normalised = ast.fix_missing_locations(_Ours().visit(ast.Module(our_try.body, [])))
    assert ast.dump(ast.parse(ast.unparse(normalised))) == ast.dump(ast.parse(ast.unparse(ast.Module(their_try.body, []))))
    assert ast.unparse(our_try.handlers[0]) == "except Exception as exc:\n    fail(self, exc)"


# -- a handler on real sockets, with a scripted layer ------------------------------------------------------

class Crash(RuntimeError):
    pass


@dataclass
class CrashCloseTestGate(server_hooks.ClientConnectedHook):
    """A blocking hook the test releases."""


class Scripted(layer.Layer):
    """Opens an upstream on b"open" (mitmproxy sends the layer the result: "connected"), asks a
    blocking hook on b"hook" and, once it completes ("hook completed"), sends its request head
    upstream; asks a wakeup on b"wake", yields a command no handler knows on b"bad", echoes on
    b"echo". Raises at the event, or the step, that `crash_on` picks; `seen` is every one of them."""

    def __init__(self, context, crash_on, upstream) -> None:
        super().__init__(context)
        self.crash_on = crash_on
        self.upstream = upstream
        self.server: Server | None = None
        self.seen: list = []
        self.progress: asyncio.Event | None = None  # set at every step (the handler's: `_until`)

    def _step(self, what) -> None:
        self.seen.append(what)
        if self.progress is not None:
            self.progress.set()
        if self.crash_on(self, what):
            raise Crash(f"injected: the layer raised at {what}")

    def handle_event(self, event):
        """Every event is a step, a paused layer's too (as a parent layer sees the events of a child
        stream that waits for a hook)."""
        self._step(event)
        yield from super().handle_event(event)

    def _handle_event(self, event):
        if isinstance(event, events.ConnectionClosed):  # as every layer does: the other side is closed too
            for connection in (self.context.client, self.server):
                if connection is not None:
                    yield commands.CloseConnection(connection)
            return
        if isinstance(event, events.DataReceived) and event.connection is self.context.client:
            if b"open" in event.data:
                self.server = Server(address=self.upstream)
                yield commands.OpenConnection(self.server)
                self._step("connected")
            if b"hook" in event.data:
                yield CrashCloseTestGate(self.context.client)
                self._step("hook completed")
                if self.server is not None:
                    yield commands.SendData(self.server, b"GET / HTTP/1.1\r\n\r\n")
            if b"wake" in event.data:
                yield commands.RequestWakeup(0)
            if b"later" in event.data:  # (a timer: the wakeup is handed on by addons/conn_timers.py's _Wakeup)
                yield commands.RequestWakeup(0.001)
            if b"bad" in event.data:
                yield object()  # the handler's own failure: "Unexpected command"
            if b"echo" in event.data:
                yield commands.SendData(self.context.client, b"echo")


class Handler(server.LiveConnectionHandler):
    def __init__(self, reader, writer, crash_on, upstream, hold_connect: asyncio.Future | None = None,
                 hold_hook: bool = False) -> None:
        opts = moptions.Options()
        super().__init__(reader, writer, opts, mode_specs.ProxyMode.parse("regular"))
        self.progress = asyncio.Event()  # something happened: a step of the layer, a hook, the failure
        self.layer = Scripted(self.layer.context, crash_on, upstream)
        self.layer.progress = self.progress
        self.gate = asyncio.get_running_loop().create_future()
        if not hold_hook:
            self.gate.set_result(None)
        self.hold_connect = hold_connect
        self.hooks: list[str] = []
        self.raise_in: str | None = None  # a hook's name, "drain" or "turn": raise there, outside server_event

    _failed = False

    @property
    def _egress_failed(self) -> bool:  # (addons/crash_close.py's mark, seen as it is set)
        return self._failed

    @_egress_failed.setter
    def _egress_failed(self, value: bool) -> None:
        self._failed = value
        self.progress.set()

    async def handle_hook(self, hook) -> None:
        self.hooks.append(hook.name)
        self.progress.set()
        if hook.name == self.raise_in:
            raise Crash(f"injected: the {hook.name} hook's task raised")
        if isinstance(hook, server_hooks.ServerConnectHook) and self.hold_connect is not None:
            await self.hold_connect
        if isinstance(hook, CrashCloseTestGate):
            await self.gate


    handle_client = conn_timers.handle_client  # the gateway's (installed under fair_share's wrapper)

    def egress_read_size(self) -> int:  # (how much one read may take, addons/fair_share.py)
        self.reads = getattr(self, "reads", 0) + 1
        if self.raise_in == "read size" and self.reads > 1:
            raise Crash("injected: the read size raised in the connection's reader")
        return 65535

    async def drain_writers(self):
        if self.raise_in == "drain":
            raise Crash("injected: a drain raised in the connection's reader")
        await super().drain_writers()

    async def egress_turn(self):  # (the sandbox's turn, addons/fair_share.py; awaited by a reader and a wakeup)
        if self.raise_in == "turn":
            raise Crash("injected: the sandbox's turn raised")


@pytest.fixture
def installed(monkeypatch):
    state = GatewayState()
    recorded: list[dict] = []
    state.decision_listeners.append(recorded.append)
    previous = server.ConnectionHandler.server_event
    monkeypatch.setattr(crash_close, "tracebacks", crash_close.TracebackBudget())
    crash_close.install(state)
    conn_close.install()  # the gateway's reader (it catches what its turn and drains raise)
    conn_timers.install()  # the gateway's wakeups (a turn taken before the event)
    yield recorded
    assert server.ConnectionHandler.server_event is previous or crash_close._mitmproxys is not None


class Upstream:
    """A loopback listener. `serve` takes one connection, greets it if asked, and reads until it ends:
    `received` is what it read, or the reset it ended with."""

    def __init__(self, greeting: bytes | None = None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()
        self.greeting = greeting
        self.received: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self.sock)
        with conn:
            if self.greeting:
                await loop.sock_sendall(conn, self.greeting)
            received = b""
            try:
                while chunk := await loop.sock_recv(conn, 4096):
                    received += chunk
            except ConnectionResetError as reset:
                self.received.set_result(received or reset)
                return
            self.received.set_result(received)

    def nothing_pending(self) -> bool:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return True
        conn.close()
        return False


async def _until(handler: Handler, done) -> None:
    """Until `done()`: woken by each step of the layer, each hook and the failure (a deadline only
    if the test broke)."""
    while not done():
        handler.progress.clear()
        await asyncio.wait_for(handler.progress.wait(), TIMEOUT)


async def _session(crash_on, send: list[bytes], *, hold_connect=None, hold_hook=False, after=None, greeting=None,
                   serve_upstream=True):
    """Serve one client with a Handler; send `send` one piece per event; returns (handler, what the
    client read until its socket ended or the exception it ended with, the upstream)."""
    upstream = Upstream(greeting)
    serving = asyncio.ensure_future(upstream.serve()) if serve_upstream else None
    made: asyncio.Future = asyncio.get_running_loop().create_future()
    finished: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(reader, writer):
        try:
            handler = Handler(reader, writer, crash_on, upstream.address, hold_connect, hold_hook)
        except Exception as exc:
            made.set_exception(exc)
            raise
        made.set_result(handler)
        try:
            await handler.handle_client()
        finally:
            finished.set_result(True)

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(*listener.sockets[0].getsockname())
        handler = await made
        read: bytes | Exception | None = None
        for piece in send:
            if handler._egress_failed:
                break
            seen = len(handler.layer.seen)
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionResetError as reset:  # (already reset: the failure came first)
                read = reset
                break
            await _until(handler, lambda: len(handler.layer.seen) > seen or handler._egress_failed)
        if after is not None:
            await after(handler, upstream)
        if read is None:
            try:
                read = await asyncio.wait_for(reader.read(), TIMEOUT)
            except ConnectionResetError as reset:
                read = reset
        writer.close()
        await asyncio.wait_for(finished, TIMEOUT)
        upstream.none_pending = upstream.nothing_pending()
        if serving is not None and handler.layer.server is not None:
            await asyncio.wait_for(upstream.received, TIMEOUT)
        return handler, read, upstream
    finally:
        if serving is not None:
            serving.cancel()
        listener.close()
        upstream.sock.close()


def _run(main):
    async def runner():
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)  # as in mitmproxy
        return await asyncio.wait_for(main(), 3 * TIMEOUT)

    return asyncio.run(runner())


def _at(kind, connection: str | None = None):
    def crash_on(layer_, event) -> bool:
        if not isinstance(event, kind):
            return False
        if connection == "client":
            return event.connection is layer_.context.client
        if connection == "server":
            return event.connection is layer_.server
        return True
    return crash_on


# -- every kind of event --------------------------------------------------------------------------------

def _data(marker: bytes):
    return lambda l, e: isinstance(e, events.DataReceived) and marker in e.data


CASES = {
    "start": (_at(events.Start), [b"x"]),
    "client data": (_data(b"boom"), [b"echo", b"boom"]),
    "upstream connected": (lambda l, e: e == "connected", [b"open"]),
    "hook completed": (lambda l, e: e == "hook completed", [b"hook"]),
    "hook completed, upstream open": (lambda l, e: e == "hook completed", [b"open", b"hook"]),
    "wakeup": (_at(events.Wakeup), [b"wake"]),
    "upstream data": (_at(events.DataReceived, "server"), [b"open"]),
    "a command the handler cannot carry out": (lambda l, e: False, [b"bad"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_event_that_raises_resets_the_sandbox_s_socket_and_nothing_reaches_the_layer_after(case, installed, caplog):
    crash_on, send = CASES[case]

    async def main():
        handler, read, upstream = await _session(crash_on, send, greeting=b"220 upstream\r\n")
        assert handler._egress_failed
        crashed_at = next((i for i, e in enumerate(handler.layer.seen) if crash_on(handler.layer, e)),
                          len(handler.layer.seen) - 1)
        return handler, read, crashed_at, upstream

    with caplog.at_level(logging.ERROR):
        handler, read, crashed_at, upstream = _run(main)
    assert isinstance(read, ConnectionResetError), f"the sandbox's socket ended with {read!r}, not a reset"
    assert handler.layer.seen[crashed_at + 1:] == [], handler.layer.seen[crashed_at + 1:]
    if handler.layer.server is not None:  # an upstream was opened: it got no byte, and was reset or closed
        assert upstream.received.result() in (b"",) or isinstance(upstream.received.result(), ConnectionResetError)
    [line] = installed
    assert (line["event"], line["decision"], line["reason"], line["status"]) == ("connection", "deny", "internal_error", None)
    crash = [r for r in caplog.records if "mitmproxy has crashed" in r.getMessage()]
    assert len(crash) == 1 and crash[0].exc_info is not None


def test_a_hook_that_completes_after_the_failure_does_not_resume_the_layer(installed):
    """The review-48 case: a layer waiting for a hook when its connection fails must not be resumed
    by the hook (here it would send its request head upstream)."""
    async def after(handler, upstream):
        await _until(handler, lambda: CrashCloseTestGate.name in handler.hooks)  # the layer waits for it
        assert handler.transports[handler.layer.server].writer is not None  # (the upstream is open)
        handler.layer.crash_on = _data(b"boom")
        await handler.server_event(events.DataReceived(handler.client, b"boom"))
        assert handler._egress_failed
        handler.gate.set_result(None)  # the hook completes now

    async def main():
        return await _session(lambda l, e: False, [b"open", b"hook"], after=after, hold_hook=True)

    handler, read, upstream = _run(main)
    assert isinstance(read, ConnectionResetError), read
    assert "hook completed" not in handler.layer.seen, handler.layer.seen
    assert not any(isinstance(e, events.HookCompleted) for e in handler.layer.seen), handler.layer.seen
    received = upstream.received.result()
    assert received == b"" or isinstance(received, ConnectionResetError), f"the upstream got {received!r}"


def test_an_upstream_still_connecting_never_connects(installed):
    async def main():
        hold = asyncio.get_running_loop().create_future()

        async def after(handler, upstream):
            await _until(handler, lambda: "server_connect" in handler.hooks)  # the connect waits on it
            await handler.server_event(events.DataReceived(handler.client, b"boom"))
            if not hold.done():  # (cancelled with the connect: what should happen)
                hold.set_result(None)  # the hook returns: the connect would go on now

        handler, read, upstream = await _session(
            lambda l, e: isinstance(e, events.DataReceived) and b"boom" in e.data, [b"open"],
            hold_connect=hold, after=after, serve_upstream=False)
        return handler, read, upstream

    handler, read, upstream = _run(main)
    assert isinstance(read, ConnectionResetError), read
    assert upstream.none_pending, "the upstream was connected to after the connection failed"
    assert not any(isinstance(e, events.OpenConnectionCompleted) for e in handler.layer.seen)


def test_an_unwritable_audit_log_fails_the_connection_without_a_traceback(installed, caplog, monkeypatch):
    """Counted in the one warning a second as a traceback withheld, not as a 500 refusal: none was sent."""
    from addons import failclosed

    monkeypatch.setattr(crash_close, "unwritable", failclosed._Unwritable())

    def crash_on(layer_, event):
        if isinstance(event, events.DataReceived) and b"boom" in event.data:
            raise AuditWriteError(28, "No space left on device")
        return False

    async def main():
        return await _session(crash_on, [b"boom"])

    with caplog.at_level(logging.DEBUG):
        handler, read, _ = _run(main)
    assert isinstance(read, ConnectionResetError), read
    assert crash_close.unwritable.total == 0  # no decision was refused with a 500
    [warning] = [r.getMessage() for r in caplog.records if "audit log is not writable" in r.getMessage()]
    assert "0 decision(s) refused" in warning and "1 traceback(s) withheld" in warning, warning
    assert not [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], AuditWriteError)]
    assert not [r for r in caplog.records if "mitmproxy has crashed" in r.getMessage()]


def test_a_healthy_connection_is_left_alone(installed, caplog):
    async def after(handler, upstream):
        handler.transports[handler.client].writer.close()  # the gateway side ends it, cleanly

    async def main():
        return await _session(lambda l, e: False, [b"echo"], after=after)

    handler, read, _ = _run(main)
    assert read == b"echo" and not handler._egress_failed and installed == []
    assert not [r for r in caplog.records if "crashed" in r.getMessage()]


def test_installed_in_mitmproxy_s_place_and_wrapped_by_the_write_backlog(installed):
    from addons import write_backlog

    write_backlog.install(GatewayState())
    current = server.ConnectionHandler.server_event
    assert current is crash_close.server_event or current.__wrapped__ is crash_close.server_event
    crash_close.install(GatewayState())  # again: a no-op, not an error
    assert server.ConnectionHandler.server_event is current


def test_one_traceback_a_second_for_each_place_the_others_a_line_each(installed, caplog, monkeypatch):
    """A sandbox that can make its connections fail can neither flood the log with tracebacks nor
    keep another bug's traceback out of it (review 49: one budget for the process did): every
    failure is audited and has its line; one traceback a second for each place that raised, the next
    saying how many were withheld there."""
    now = [100.0]
    monkeypatch.setattr(crash_close, "tracebacks", crash_close.TracebackBudget(clock=lambda: now[0]))

    def elsewhere(layer_, event):
        if isinstance(event, events.DataReceived) and b"other" in event.data:
            raise KeyError("a different bug")
        return False

    async def main():
        for _ in range(5):
            await _session(_data(b"boom"), [b"boom"])
        await _session(elsewhere, [b"other"])  # another place, within the same second
        now[0] += 1.0
        await _session(_data(b"boom"), [b"boom"])

    with caplog.at_level(logging.ERROR):
        _run(main)
    assert len(installed) == 7  # every failure audited
    lines = [r for r in caplog.records if "mitmproxy has crashed" in r.getMessage()]
    assert len(lines) == 7, [r.getMessage() for r in lines]
    with_traceback = [r for r in lines if r.exc_info]
    assert [type(r.exc_info[1]).__name__ for r in with_traceback] == ["Crash", "KeyError", "Crash"]
    assert "4 more at this place since the last traceback" in with_traceback[2].getMessage()
    assert all("Crash at " in r.getMessage() and "test_crash_close.py:" in r.getMessage()
               for r in lines if not r.exc_info)


def test_the_places_followed_are_bounded():
    budget = crash_close.TracebackBudget(clock=lambda: 0.0)
    for n in range(budget.MAX_PLACES * 3):
        try:
            exec(compile("raise ValueError()", f"<place {n}>", "exec"))
        except ValueError as exc:
            assert budget.take(exc) == 0
    assert len(budget._places) == budget.MAX_PLACES


# -- raised outside server_event: in a task the handler started, or in its reader ---------------------------

OUTSIDE = {
    # where it raises: (what the client sends, what the test makes raise)
    "a hook's task": ([b"hook"], CrashCloseTestGate.name),
    "an upstream's connect hook": ([b"open"], "server_connect"),
    "the reader's drain": ([b"echo"], "drain"),
    "a wakeup's turn": ([b"wake"], "turn"),
    "a timed wakeup's turn": ([b"later"], "turn"),
    "the reader's read size": ([b"echo"], "read size"),
    "the client's connect hook": ([], "client_connected"),
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_a_task_of_the_connection_that_raises_fails_it_closed_too(case, installed, caplog):
    """Review 49: these ran in tasks of their own; mitmproxy logged the error when the task was
    collected, the layer waited for a reply that never came, and the client got a clean end after
    `tcp_timeout`, with no audit line."""
    send, where = OUTSIDE[case]

    async def main():
        made: list[Handler] = []
        original = Handler.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.raise_in = where
            made.append(self)

        Handler.__init__ = init
        try:
            return await _session(lambda l, e: False, send, serve_upstream=False)
        finally:
            Handler.__init__ = original

    with caplog.at_level(logging.ERROR):
        handler, read, upstream = _run(main)
    assert handler._egress_failed
    assert isinstance(read, ConnectionResetError), f"the sandbox's socket ended with {read!r}, not a reset"
    assert "hook completed" not in handler.layer.seen and "connected" not in handler.layer.seen
    [line] = installed
    assert (line["reason"], line["status"]) == ("internal_error", None)
    [crash] = [r for r in caplog.records if "mitmproxy has crashed" in r.getMessage()]
    assert "injected" in str(crash.exc_info[1])
    assert upstream.none_pending


def test_a_disconnect_hook_that_raises_still_closes_the_upstreams(installed):
    """Review 50: mitmproxy's handle_client skipped the closing of the transports when the
    client_disconnected hook raised: the upstreams stayed open."""
    async def after(handler, upstream):
        await _until(handler, lambda: "server_connected" in handler.hooks)  # the upstream is connected
        handler.raise_in = "client_disconnected"
        handler.transports[handler.client].handler.cancel()  # the client goes

    async def main():
        return await _session(lambda l, e: False, [b"open"], after=after)

    handler, read, upstream = _run(main)
    assert handler._egress_failed
    received = upstream.received.result()  # (the session waited for the upstream's end)
    assert received == b"" or isinstance(received, ConnectionResetError), received
    assert not handler.transports
