"""The control API in a gateway process (docs/control-api.md): the platform registers sandboxes and
grants; this addon puts each change in force on the event loop, so every later decision and every
open connection it touched is judged by it (GatewayState.apply_registry -> addons/revocation.py).

Two ways to run:
- one process (`--control SPEC`): the listener (gateway/control_server.py) serves from its own
  threads, and each request is handled on the event loop (`_dispatch`), so the registry is only
  ever touched there and a change is in force when its answer is sent. A timer on the loop ends
  registrations and grants at their deadlines (`_expire`), audited and revoked like any change.
- a worker of `run --workers N` (EGRESS_CONTROL_FD, set by the supervisor, which owns the API):
  the worker reads its copy of the registry (a snapshot, then every op) from that pipe, applies
  each op on the loop and acknowledges it (gateway/control_fanout.py); the snapshot is applied in
  `running`, before the loop accepts any connection, so a restarted worker never judges a
  registered sandbox's connection without its registration.

A TCP control address joins the gateway's own listeners in the address guard (like the metrics
port): no request through the proxy can reach it (403 `self_address`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time

from mitmproxy import ctx, exceptions

from gateway.control import ControlService, Limits, Reply
from gateway.registry import Change
from gateway.control_fanout import CONTROL_FD_ENV, CONTROL_LISTEN_ENV, WorkerLink
from gateway.control_server import ControlServer, ControlSpecError, read_tokens
from gateway.ratelimit import parse_rate

from .metrics import MetricsFeed
from .options import declare
from .state import GatewayState

logger = logging.getLogger("egress")
DISPATCH_TIMEOUT = 30.0


class ControlApi:
    name = "egresscontrol"

    def __init__(self, state: GatewayState, feed: MetricsFeed | None = None):
        self.state = state
        self.feed = feed
        self.server: ControlServer | None = None
        self.service: ControlService | None = None
        self.link: WorkerLink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._listeners: list = []
        state.registry_listeners.append(self._on_change)

    def load(self, loader):
        declare(loader, "egress_control", "egress_control_token_file", "egress_control_group",
                "egress_control_max_sandboxes", "egress_control_max_grants", "egress_control_rate")
        # A worker of `run --workers N`: the supervisor's TCP control address is one of the gateway's
        # own listeners too (guarded before the first engine is installed).
        listen = os.environ.get(CONTROL_LISTEN_ENV, "")
        if listen:
            ip, _, port = listen.rpartition(":")
            self._guard(ipaddress.ip_address(ip.strip("[]")), int(port))

    def configure(self, updated: set[str]):
        if "egress_control" in updated and self.server is None and ctx.options.egress_control:
            self._start_server()

    # --- one process: the listener here -------------------------------------------------------------

    def _start_server(self) -> None:
        opts = ctx.options
        try:
            rate = parse_rate(opts.egress_control_rate)
            tokens = read_tokens(opts.egress_control_token_file) if opts.egress_control_token_file else None
            limits = Limits(max_sandboxes=max(1, opts.egress_control_max_sandboxes),
                            max_grants=max(1, opts.egress_control_max_grants), rate=rate, burst=2 * rate)
            self.service = ControlService(self.state.registry, self._policy, self._publish, self._record, limits,
                                          count=self._count, engine=self._engine)
            self.server = ControlServer(opts.egress_control, self.service, self._dispatch, tokens,
                                        opts.egress_control_group or None)
        except (ControlSpecError, ValueError, OSError, KeyError) as exc:
            raise exceptions.OptionsError(f"egress_control: {exc}") from None
        if self.server.address is not None:
            self._guard(*self.server.address)
            if self.state.engine is not None:
                self.state.install(self.state.engine)  # the engine in force refuses it too

    def _guard(self, ip, port: int) -> None:
        listeners = [(ip, port)]
        if ip == ipaddress.ip_address("0.0.0.0"):
            listeners.append((ipaddress.ip_address("::"), port))
        self._listeners += listeners
        self.state.extra_listeners.extend(listeners)

    def _policy(self):
        return self.state.engine.policy if self.state.engine is not None else None

    def _engine(self):
        """The engine in force: `sandbox explain` decides with what the sandbox's traffic is decided by."""
        return self.state.engine

    def _record(self, **fields) -> None:
        self.state.record(**fields)

    def _count(self, action: str, result: str) -> None:
        if self.feed is not None:
            self.feed.metrics.control.count(action, result)

    def _publish(self, ops: list[dict]) -> int:
        for op in ops:
            self.state.apply_registry(op)
        return 1

    def _dispatch(self, method: str, path: str, query, body: bytes, principal: str) -> Reply:
        """From the listener's thread: handle the request on the event loop and wait for it."""
        loop = self._loop
        if loop is None:
            return Reply(503, {"error": "starting", "message": "the gateway is starting"})

        async def run() -> Reply:
            reply = self.service.handle(method, path, query, body, principal)
            self._schedule()
            return reply
        return asyncio.run_coroutine_threadsafe(run(), loop).result(DISPATCH_TIMEOUT)

    def _schedule(self) -> None:
        """The timer at the earliest deadline (loop time is time.monotonic, the registry's clock)."""
        when = self.state.registry.next_deadline()
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = when
        if when is not None and self._loop is not None:
            self._timer = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._timer, self._timer_at = None, None
        try:
            if self.service is not None:
                self.service.expire()
            else:
                self._judge_due()
        except Exception:
            logger.exception("egress gateway: ending expired registrations failed")
        self._schedule()

    def _judge_due(self) -> None:
        """A worker, at a deadline of its own copy: what ran out is judged again now, without
        waiting for the supervisor's op (review 24: one stalled worker held the supervisor's
        publication, and the healthy workers closed what an expiry ended 6 s late). Nothing is
        removed here: every decision already ignores what has run out (gateway/registry.py `scope`),
        and the supervisor's op, when it comes, removes it as usual."""
        registry = self.state.registry
        for op in registry.due(time.monotonic()):
            sandbox = op.get("id") or op.get("sandbox")
            change = Change(op["op"], sandbox, registry.addresses_of(sandbox), grant=op.get("grant"), why="expired")
            for listener in self.state.registry_listeners:
                try:
                    listener(change)
                except Exception:
                    logger.exception("egress gateway: registry listener failed")

    # --- a worker: the supervisor's copy ---------------------------------------------------------------

    def running(self):
        self._loop = asyncio.get_running_loop()
        fd = os.environ.pop(CONTROL_FD_ENV, "")
        if fd.isdigit():
            self.link = WorkerLink(int(fd))
            started = time.monotonic()
            snapshot = self.link.read_snapshot()  # blocks the loop: nothing is accepted before it is in force
            self.state.registry.restore(snapshot)
            self._sizes()
            self.link.ack(self.state.registry.seq)
            logger.info("egress gateway: %d registered sandboxes from the supervisor (%.0f ms)",
                        len(self.state.registry), (time.monotonic() - started) * 1000)
            self._loop.add_reader(self.link.fd, self._on_link)
            self._on_link()  # ops that arrived with the snapshot are in the buffer already, not on the socket
        if self.server is not None:
            self.server.start()
            logger.info("egress gateway: control API at %s", self.server.where)
        self._schedule()

    def _on_link(self) -> None:
        try:
            batches = self.link.read_batches()
        except (OSError, ValueError):
            batches = None
        if batches is None:  # the supervisor is gone: workers die with it anyway
            self._loop.remove_reader(self.link.fd)
            return
        for seq, ops in batches:
            for op in ops:
                try:
                    self.state.apply_registry(op)
                except Exception:
                    logger.exception("egress gateway: applying a control op failed")
            self.link.ack(seq)
        self._schedule()  # (a worker's own timer: the new deadlines, `_judge_due`)

    def _on_change(self, change) -> None:
        self._sizes()

    def _sizes(self) -> None:
        if self.feed is not None:
            self.feed.metrics.control.sizes(len(self.state.registry), self.state.registry.grant_count)

    def done(self):
        if self._timer is not None:
            self._timer.cancel()
        if self.server is not None:
            self.server.stop()
            self.server = None
        for listener in self._listeners:
            if listener in self.state.extra_listeners:
                self.state.extra_listeners.remove(listener)

