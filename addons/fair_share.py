"""Each sandbox's share of a worker's event loop (gateway/fairshare.py `LoopShare`), enforced by
making its reads wait.

What a sandbox is charged: the time of every callback the event loop runs for one of its
connections (asyncio.Handle._run, timed; a connection's handler marks its task's context, and the
tasks it starts, for its connections and its hooks, inherit the mark). That is all of it, measured
where it runs: TLS, HTTP/1 and HTTP/2 parsing, WebSocket framing, the layers, every addon's
decision, audit and metrics work, and nothing while a hook awaits (a DNS answer costs the loop
nothing, and the work of others that runs meanwhile is theirs). The cost: two clock reads per
callback. The time is summed on the handler and charged at its next read. What it is made to do: after each
read of one of its connections
(ConnectionHandler.drain_writers, awaited after every read of every connection, mitmproxy 12.3),
wait for its slot (`LoopShare.reserve`) while it is over its share on a contended loop.
Its sockets' buffers fill and TCP slows it down; nothing is refused, and a sandbox alone on a
worker, or next to an idle loop, is never slowed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from mitmproxy import ctx, exceptions

from gateway.fairshare import DEFAULT_BURST, DEFAULT_BUSY, DEFAULT_MAX_SHARE, MAX_WAIT, LoopShare

ATTR = "_egress_share_key"
_step = [0.0]  # when the loop's current callback began (one loop, one callback at a time)
_serving: contextvars.ContextVar = contextvars.ContextVar("egress_serving", default=None)  # the ConnectionHandler

_share = LoopShare()
_state = None  # the gateway's GatewayState (install)


def _key(handler) -> str | None:
    """The handler's sandbox, once its client is known to the gateway (cached on the handler)."""
    key = getattr(handler, ATTR, None)
    if key is None and _state is not None:
        conn = _state.connections.get(handler.client.id)
        if conn is not None:
            key = _state.sandbox_key(conn)
            setattr(handler, ATTR, key)
    return key


def _charge(handler, seconds: float) -> None:
    try:
        key = _key(handler)
        if key is not None:
            _share.charge(key, seconds)
    except Exception:  # accounting must never break the connection it accounts for
        logging.getLogger("egress").exception("egress gateway: loop-share accounting failed")


def active() -> int:
    """Sandboxes active on this worker's loop now (the metrics' heartbeat reads it, on the loop)."""
    return _share.active()


def _waited(key: str, seconds: float) -> None:
    sandbox = key.removeprefix("sandbox:") if key.startswith("sandbox:") else None
    for listener in list(_state.wait_listeners if _state is not None else ()):
        try:
            listener(sandbox, seconds)
        except Exception:  # a metrics bug must not break the connection
            logging.getLogger("egress").exception("egress gateway: a loop-share listener failed")


def install(state) -> None:
    """Time every callback the event loop runs and charge it to the sandbox whose connection it
    serves, and make that sandbox's reads wait while it is over its share."""
    global _state
    _state = state
    from mitmproxy.proxy import server

    handler_class = server.ConnectionHandler
    if getattr(handler_class.handle_client, "_egress_share", False):
        return
    handle_client, drain_writers, run = handler_class.handle_client, handler_class.drain_writers, asyncio.Handle._run

    async def marked_handle_client(self) -> None:
        _serving.set(self)  # this task's context, and every task it starts (connections, hooks)
        await handle_client(self)

    def timed_run(self) -> None:
        handler = self._context.get(_serving)
        if handler is None:
            return run(self)
        _step[0] = perf_counter()
        try:
            return run(self)
        finally:
            handler._egress_spent += perf_counter() - _step[0]  # charged at its next read (cheap here)

    async def shared_drain_writers(self) -> None:
        await drain_writers(self)
        # The read just handled ran in this very step of the loop: its time so far is charged now,
        # before the next read is reserved (else each connection had one read uncharged).
        spent, self._egress_spent = self._egress_spent, 0.0
        if _serving.get() is self:  # (always, for a proxy connection's reader)
            now = perf_counter()
            spent += now - _step[0]
            _step[0] = now
        if spent:
            _charge(self, spent)
        key = getattr(self, ATTR, None)
        if key is None:
            return
        # A read waits for its own slot (LoopShare.reserve): its sandbox's debt paid, and the reads
        # of its other connections before it spaced by what a read costs, however many it holds; a
        # wait cut at MAX_WAIT reserves again, so that capped reads do not all resume at once.
        waited = 0.0
        while wait := _share.reserve(key):
            await asyncio.sleep(wait)
            waited += wait
            if wait < MAX_WAIT:
                break
        if waited:
            _waited(key, waited)

    perf_counter = time.perf_counter
    handler_class._egress_spent = 0.0  # loop time of the handler's callbacks not charged yet
    marked_handle_client._egress_share = True
    handler_class.handle_client = marked_handle_client
    handler_class.drain_writers = shared_drain_writers
    asyncio.Handle._run = timed_run


class FairShare:
    """Declares the options and installs the wrappers."""

    def __init__(self, state) -> None:
        install(state)

    def load(self, loader) -> None:
        loader.add_option(
            "egress_max_loop_share_per_sandbox", str, f"{DEFAULT_MAX_SHARE:g}",
            "Share of a worker's event loop one sandbox may take while another sandbox is active: at "
            "most this, and 1/N with N active; over it, its connections' next reads wait (back-pressure, "
            "nothing refused). 0: off.",
        )
        loader.add_option(
            "egress_loop_share_burst", str, f"{DEFAULT_BURST:g}",
            "Seconds of loop time a sandbox may use at once above its share.",
        )
        loader.add_option(
            "egress_loop_share_busy", str, f"{DEFAULT_BUSY:g}",
            "The loop counts as contended (shares apply) once the work of about the last second fills this "
            "fraction of it; below it nobody is slowed. 0: always contended.",
        )

    def configure(self, updated: set[str]) -> None:
        names = {"egress_max_loop_share_per_sandbox", "egress_loop_share_burst", "egress_loop_share_busy"}
        if updated & names:
            try:
                _share.configure(float(ctx.options.egress_max_loop_share_per_sandbox),
                                 float(ctx.options.egress_loop_share_burst), float(ctx.options.egress_loop_share_busy))
            except ValueError as exc:
                raise exceptions.OptionsError(f"{', '.join(sorted(names))}: {exc}") from None
