"""The gateway's life: starting (the "ready" line, the supervisor told), liveness and readiness
(what /healthz and /readyz answer), and draining on SIGTERM.

- liveness: a once-a-second heartbeat; /healthz fails when the event loop has not ticked for
  STALLED_SECONDS (the endpoint answers from its own thread, so it can tell);
- readiness: policy loaded, proxy listeners up, CA certificate present, event loop alive, audit
  log writable, not draining;
- `drain()` stops accepting, then waits for the requests in flight; the runner calls it on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time

from mitmproxy import ctx, exceptions, http
from mitmproxy.utils import human

from gateway.workers import notify_ready

from .heartbeat import every_second
from .options import declare
from .state import GatewayState

logger = logging.getLogger("egress")

STALLED_SECONDS = 10.0  # /healthz fails when the event loop has not ticked for this long
DRAIN_GRACE_SECONDS = 0.2  # after the last response hook, for the bytes to reach the client socket


class Lifecycle:
    name = "egresslifecycle"

    def __init__(self, state: GatewayState):
        self.state = state
        self._running = False
        self._listeners_up = False
        self._heartbeat = 0.0
        self._task: asyncio.Task | None = None
        self._ca_path: str | None = None
        self.draining = False
        self._in_flight: dict[str, str] = {}  # flow id -> client id: requests not answered yet

    def load(self, loader):
        declare(loader, "egress_drain_timeout")

    def configure(self, updated: set[str]):
        if "egress_drain_timeout" in updated and not 0 <= ctx.options.egress_drain_timeout < math.inf:
            # (NaN passes `< 0`, as it did for egress_loop_share_burst and froze a worker: review 31)
            raise exceptions.OptionsError("egress_drain_timeout must be a finite number of seconds >= 0")

    # --- starting ----------------------------------------------------------------------------------

    def running(self):
        self._running = True
        self._install_signals()
        self._ca_path = os.path.join(os.path.expanduser(ctx.options.confdir), "mitmproxy-ca-cert.pem")
        self._task = every_second(self._tick, "heartbeat")
        logger.info("egress gateway: ready: %s", self.summary())
        notify_ready()  # `run --workers N`: the supervisor now knows this worker listens

    def _install_signals(self) -> None:
        """Under `mitmdump -s` nobody else installs the hub's handlers (the runner does, earlier)."""
        if self.state.signals.installed(signal.SIGHUP):
            return
        try:
            self.state.signals.install(asyncio.get_running_loop())
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            logger.warning("egress gateway: cannot handle SIGHUP here: the audit log is not reopened on it")

    def summary(self) -> str:
        """One line: where the gateway listens, the policy in force, the CA sandboxes must trust."""
        proxyserver = ctx.master.addons.get("proxyserver")
        listening = []
        for server in proxyserver.servers if proxyserver is not None else []:
            kind = type(server.mode).__name__.removesuffix("Mode").lower()
            listening += [f"{kind} {human.format_address(a)}" for a in dict.fromkeys(server.listen_addrs)]
        engine = self.state.engine
        policy = f"{engine.policy.source} (sha256 {engine.policy.sha256})" if engine is not None else "none"
        parts = [f"listening on {', '.join(listening) or 'nothing'}", f"policy {policy}", f"CA certificate {self._ca_path}"]
        endpoint = ctx.master.addons.get("egresshealth")
        url = getattr(endpoint, "url", None)
        if url:
            parts.append(f"metrics {url}/metrics")
        return "; ".join(parts)

    def done(self):
        if self._task is not None:
            self._task.cancel()

    def _tick(self) -> None:
        self._heartbeat = time.monotonic()
        proxyserver = ctx.master.addons.get("proxyserver") if ctx.master else None
        servers = list(proxyserver.servers) if proxyserver is not None else []
        self._listeners_up = bool(servers) and all(s.is_running for s in servers) and not self.draining

    # --- /healthz and /readyz (called from the endpoint's thread) ----------------------------------

    def health(self) -> tuple[bool, str]:
        if not self._running:
            return True, "ok: starting\n"
        age = time.monotonic() - self._heartbeat
        if age > STALLED_SECONDS:
            return False, f"event loop stalled for {age:.0f}s\n"
        return True, "ok\n"

    def readiness(self) -> tuple[bool, str]:
        checks = [self._policy_check(), self._listeners_check(), self._ca_check(), self._loop_check()]
        audit = self._audit_check()
        if audit is not None:
            checks.append(audit)
        ok = all(passed for _, passed, _ in checks)
        lines = [f"{name}: {'ok' if passed else 'FAIL'} ({detail})" for name, passed, detail in checks]
        return ok, ("ready\n" if ok else "not ready\n") + "\n".join(lines) + "\n"

    def _policy_check(self) -> tuple[str, bool, str]:
        engine = self.state.engine
        return "policy", engine is not None, f"sha256 {engine.policy.sha256}" if engine else "not loaded"

    def _listeners_check(self) -> tuple[str, bool, str]:
        if self.draining:
            return "listeners", False, "draining: not accepting connections"
        if not self._running:
            return "listeners", False, "starting"
        return "listeners", self._listeners_up, "up" if self._listeners_up else "not listening"

    def _ca_check(self) -> tuple[str, bool, str]:
        ca = self._ca_path
        ok = bool(ca) and os.path.isfile(ca)
        return "ca", ok, ca if ok else f"missing {ca}" if ca else "not known yet"

    def _loop_check(self) -> tuple[str, bool, str]:
        alive, why = self.health()
        return "event_loop", alive, why.strip()

    def _audit_check(self) -> tuple[str, bool, str] | None:
        audit = self.state.audit
        if audit.target is None:
            return None
        if audit.writable:
            return "audit_log", True, "writable"
        code = getattr(audit, "supervisor_errno", 0)
        why = f"{os.strerror(code)}, says the supervisor" if code else "the last write failed"
        since = audit.failing_since
        when = f", since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))}" if since else ""
        return "audit_log", False, f"not writable ({why}{when}): every decision is refused (500 internal_error)"

    # --- draining ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def drain(self, timeout: float) -> bool:
        """Stop accepting connections, then wait up to `timeout` seconds for in-flight requests.
        True when none is left (the caller then shuts down)."""
        self.draining = True
        self._listeners_up = False
        proxyserver = ctx.master.addons.get("proxyserver")
        if proxyserver is not None:
            await proxyserver.servers.update([])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._in_flight:
            return False
        await asyncio.sleep(DRAIN_GRACE_SECONDS)
        return True

    def requestheaders(self, flow: http.HTTPFlow):
        self._in_flight[flow.id] = flow.client_conn.id

    def response(self, flow: http.HTTPFlow):
        self._in_flight.pop(flow.id, None)

    def error(self, flow: http.HTTPFlow):
        self._in_flight.pop(flow.id, None)

    def client_disconnected(self, client):
        if self._in_flight:
            for flow_id in [f for f, c in self._in_flight.items() if c == client.id]:
                del self._in_flight[flow_id]
