"""addons/conn_timers.py: a connection's inactivity watchdog and its layers' wakeups are loop timers.

The watchdog closes an idle connection when its timeout has run out since the last activity, not
while a hook is under way, and not after the client handler has ended; a wakeup hands its event on
once its delay is over, after the sandbox's turn, and never after a close. mitmproxy's code these
rely on (the watchdog's interface, `handle_client` cancelling every entry of `wakeup_timer` as it
ends, `server_event` adding the wakeup's task to the set after making it) is pinned by hash: an
upgrade that changes it fails here, besides the version check of addons/patches.py. The idle
timeout and the body-idle deadline are exercised end to end by tests/faults/test_upstream_faults.py
(`tcp_timeout`) and tests/e2e/test_budgets.py."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
import time

import pytest
from mitmproxy.proxy import commands, events, server

from addons import conn_timers
from addons.conn_timers import TimerWatchdog, timer_wakeup

conn_timers.install()

# sha256 of mitmproxy 12.3's sources these timers stand in for or rely on
MITMPROXY = {
    ("TimeoutWatchdog", None): "c369d9acd4797ef487d3f616a9e5be60e410fef5a0243a472a19a27c0af47eb1",
    ("ConnectionHandler", "wakeup"): "fe995f548239361515ded4be763e616cb438a48279c3c0cfc5ff883b720092c7",
    ("ConnectionHandler", "handle_client"): "a460e7dd21798856698b812d38067cb685baaee703b04f090635f85e0c69f370",
    ("ConnectionHandler", "server_event"): "ffbed451b4933f30d26bc1e2b1cb0a1c3f9ec7b94bb32a742f6faec3604b8cc0",
}


def _source(cls: str, name: str | None) -> str:
    source = inspect.getsource(server)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            if name is None:
                return ast.get_source_segment(source, node)
            found = next(f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and f.name == name)
            return ast.get_source_segment(source, found)
    raise AssertionError(cls)


@pytest.mark.parametrize("cls,name", list(MITMPROXY))
def test_mitmproxy_s_code_is_the_code_these_timers_were_written_for(cls, name):
    assert hashlib.sha256(_source(cls, name).encode()).hexdigest() == MITMPROXY[(cls, name)], (
        f"mitmproxy's {cls}{'.' + name if name else ''} changed: check addons/conn_timers.py against it, then "
        "update the hash")


def test_installed_in_mitmproxy_s_place():
    assert server.TimeoutWatchdog is TimerWatchdog
    assert server.ConnectionHandler.wakeup is timer_wakeup


class Handler:
    """What the timers use of a mitmproxy ConnectionHandler: its timers, its events, its turn."""

    def __init__(self, turn: asyncio.Future | None = None) -> None:
        self.wakeup_timer: set = set()
        self.events: list = []
        self.timed_out = asyncio.get_running_loop().create_future()
        self.delivered = asyncio.get_running_loop().create_future()
        self._turn = turn
        self.in_turn = asyncio.get_running_loop().create_future()
        if turn is not None:
            self.egress_turn = self._take_turn

    async def _take_turn(self) -> None:
        if not self.in_turn.done():
            self.in_turn.set_result(True)  # (what the tests wait on: the event is held at the turn now)
        await self._turn

    async def on_timeout(self) -> None:
        self.timed_out.set_result(True)

    async def server_event(self, event) -> None:
        self.events.append(event)
        if not self.delivered.done():
            self.delivered.set_result(event)

    def close(self) -> None:
        """What mitmproxy's handle_client does with the timers as it ends."""
        while self.wakeup_timer:
            self.wakeup_timer.pop().cancel()


def _run(main, eager: bool = False) -> None:
    async def runner():
        if eager:  # mitmproxy's loop: tasks run at once, up to their first wait
            asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        await main()

    asyncio.run(runner())


# -- the watchdog ----------------------------------------------------------------------------------------

def test_the_watchdog_is_one_timer_among_the_handler_s_and_fires_once_idle():
    async def main():
        handler = Handler()
        watchdog = TimerWatchdog(0, handler.on_timeout)  # (timeout 0: runs out at the next step of the loop)
        await watchdog.watch()
        assert handler.wakeup_timer == {watchdog}
        assert await handler.timed_out
        assert watchdog not in handler.wakeup_timer and watchdog._handle is None

    _run(main)


def test_activity_since_puts_the_check_off_by_what_is_left():
    async def main():
        handler = Handler()
        watchdog = TimerWatchdog(600, handler.on_timeout)
        await watchdog.watch()
        watchdog.cancel()
        watchdog.last_activity = time.time() - 590  # 10 s left
        loop = asyncio.get_running_loop()
        watchdog._check()
        assert not handler.timed_out.done()
        assert 9 < watchdog._handle.when() - loop.time() <= 10
        watchdog.last_activity = time.time() - 601  # run out
        watchdog.cancel()
        watchdog._check()
        assert await handler.timed_out

    _run(main)


def test_a_disarmed_watchdog_does_not_fire_and_its_end_counts_as_activity():
    async def main():
        handler = Handler()
        watchdog = TimerWatchdog(600, handler.on_timeout)
        await watchdog.watch()
        loop = asyncio.get_running_loop()
        with watchdog.disarm():
            watchdog.last_activity = time.time() - 1000  # (a hook has been under way for long)
            watchdog.cancel()
            watchdog._check()
            assert 599 < watchdog._handle.when() - loop.time() <= 600  # looked at again a full timeout later
        assert time.time() - watchdog.last_activity < 60
        watchdog.cancel()
        watchdog._check()
        assert not handler.timed_out.done() and watchdog._handle is not None

    _run(main)


def test_a_closed_handler_cancels_its_watchdog():
    async def main():
        handler = Handler()
        watchdog = TimerWatchdog(0, handler.on_timeout)
        await watchdog.watch()
        handle = watchdog._handle
        handler.close()
        assert handle.cancelled() and watchdog._handle is None
        await asyncio.sleep(0)  # (the step at which the timer would have run: not synchronisation)
        await asyncio.sleep(0)  # (and the next: not synchronisation)
        assert not handler.timed_out.done()

    _run(main)


# -- wakeups ---------------------------------------------------------------------------------------------

async def _request(handler: Handler, delay: float) -> asyncio.Task:
    """What mitmproxy's server_event does for a RequestWakeup: make the task, then add it to the set."""
    request = commands.RequestWakeup(delay)
    task = asyncio.ensure_future(timer_wakeup(handler, request))
    handler.wakeup_timer.add(task)
    return task


SOON = 1e-6  # a delay that runs out at the loop's next step (the tests wait for events, not for time)


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_a_wakeup_is_a_timer_in_the_task_s_place_then_its_event(eager):
    async def main():
        handler = Handler()
        task = await _request(handler, SOON)
        await task
        assert task not in handler.wakeup_timer  # the task ended and gave its place to the timer
        event = await handler.delivered
        assert isinstance(event, events.Wakeup) and event.command.delay == SOON
        assert handler.wakeup_timer == set()

    _run(main, eager)


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_a_wakeup_due_at_once_is_handed_on_by_its_own_task_after_the_turn(eager):
    async def main():
        turn = asyncio.get_running_loop().create_future()
        handler = Handler(turn)
        task = await _request(handler, 0)
        await handler.in_turn
        assert handler.wakeup_timer == {task} and handler.events == []  # waiting for its turn, in the set
        turn.set_result(None)
        await task
        assert isinstance(handler.events[0], events.Wakeup) and handler.wakeup_timer == set()

    _run(main, eager)


def test_a_close_during_the_turn_of_a_wakeup_due_at_once_cancels_it():
    async def main():
        turn = asyncio.get_running_loop().create_future()
        handler = Handler(turn)
        task = await _request(handler, 0)
        await handler.in_turn
        handler.close()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert handler.events == [] and handler.wakeup_timer == set()

    _run(main)


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_a_close_before_the_delay_cancels_the_wakeup(eager):
    async def main():
        handler = Handler()
        await (await _request(handler, 3600))
        (timer,) = handler.wakeup_timer
        handle = timer.handle
        assert 3590 < handle.when() - asyncio.get_running_loop().time() <= 3600
        handler.close()
        assert handle.cancelled() and handler.events == []

    _run(main, eager)


async def _waiting_for_its_turn() -> tuple[Handler, asyncio.Future, object]:
    """A wakeup whose timer ran out and whose task waits for the sandbox's turn."""
    turn = asyncio.get_running_loop().create_future()
    handler = Handler(turn)
    await (await _request(handler, SOON))
    (timer,) = handler.wakeup_timer
    await handler.in_turn  # the timer ran out and its task takes the turn
    assert timer.task is not None and timer in handler.wakeup_timer and handler.events == []  # waiting for its turn, still a timer
    return handler, turn, timer


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_the_event_waits_for_the_sandbox_s_turn_and_a_close_meanwhile_cancels_it(eager):
    async def main():
        handler, _, timer = await _waiting_for_its_turn()
        waiting = timer.task
        handler.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert handler.events == [] and handler.wakeup_timer == set()

    _run(main, eager)


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_after_its_turn_the_event_is_handed_on(eager):
    async def main():
        handler, turn, _ = await _waiting_for_its_turn()
        turn.set_result(None)
        assert isinstance(await handler.delivered, events.Wakeup)
        assert handler.wakeup_timer == set()

    _run(main, eager)


def test_a_wakeup_task_closed_before_its_first_step_arms_nothing():
    async def main():
        handler = Handler()
        task = await _request(handler, SOON)
        handler.close()  # cancels the task itself: it had not yet given its place
        with pytest.raises(asyncio.CancelledError):
            await task
        assert handler.wakeup_timer == set() and handler.events == []

    _run(main)


# -- handle_client ----------------------------------------------------------------------------------------

class _Theirs(ast.NodeTransformer):
    """mitmproxy's handle_client with the three changes conn_timers makes, for the comparison."""

    def visit_Assign(self, node):
        if ast.unparse(node.targets[0]) == "watch":  # the watchdog's task -> armed in place
            return ast.Expr(ast.Await(ast.parse("self.timeout_watchdog.watch()", mode="eval").body))
        return self.generic_visit(node)

    def visit_Expr(self, node):
        text = ast.unparse(node)
        if text == "watch.cancel()":
            return None
        if text == "await asyncio.wait([handler])":
            return ast.Expr(ast.Await(ast.parse("_ended(handler)", mode="eval").body))
        return self.generic_visit(node)


class _Unguarded(ast.NodeTransformer):
    """Our handle_client without its fail-closed guards (`try: ... except Exception: crash_close.fail`)."""

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if isinstance(statements, list):
                flat = []
                for s in statements:
                    if (isinstance(s, ast.Try) and len(s.handlers) == 1
                            and "crash_close.fail(self, exc)" in ast.unparse(s.handlers[0])):
                        flat.extend(s.body)
                    else:
                        flat.append(s)
                setattr(node, field, flat)
        return node


def test_handle_client_is_mitmproxy_s_but_for_the_watchdog_the_wait_and_the_guards():
    theirs = ast.parse(_source("ConnectionHandler", "handle_client").strip()).body[0]
    ours = ast.parse(inspect.getsource(conn_timers.handle_client)).body[0]
    assert inspect.getsource(conn_timers.handle_client).count("crash_close.fail(self, exc)") == 2
    ours = _Unguarded().visit(ours)
    ours.body = [s for s in ours.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]  # docstring
    expected = ast.fix_missing_locations(_Theirs().visit(theirs))
    assert ast.unparse(ours.body) == ast.unparse(expected.body)


def test_the_client_s_reader_is_awaited_on_one_future_that_its_end_resolves():
    async def main():
        gate = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(gate)
        waiter = conn_timers._ended(task)
        assert not waiter.done()
        gate.set_result(None)
        await waiter
        assert task.done()
        # cancelled while waiting: the task goes on, as with asyncio.wait
        other = asyncio.ensure_future(asyncio.get_running_loop().create_future())
        waiting = conn_timers._ended(other)  # (a Future: what handle_client awaits)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not other.done()
        other.cancel()

    _run(main)
