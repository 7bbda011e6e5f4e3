"""The metrics feed: the mitmproxy hooks and gateway listeners that tell gateway.metrics.GatewayMetrics
what happened. Decision entries and policy check timings come through the shared state's
listeners; this addon adds what only mitmproxy sees: open connections, relayed bytes, the
upstream's time to first byte, the audit log's state and the event loop share gauge.

It is fed only once the endpoint is on (`enable()`, HealthEndpoint): without anyone to scrape them,
the counters are not worth a hook's time on every request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from mitmproxy import http

from gateway.metrics import GatewayMetrics

from . import fair_share
from .heartbeat import every_second
from .state import GatewayState
from .streaming import counting_stream

COUNTED = "egress_bytes_counted"  # flow.metadata: this message's body is counted by a stream wrapper


def _mode_name(client) -> str:
    return type(client.proxy_mode).__name__.removesuffix("Mode").lower() if client.proxy_mode else "?"


def _decision(flow) -> Any:
    return flow.metadata.get("egress_decision")


def _counting_in(inner, count: Callable[[int], None]):
    """A stream callable counting bytes *before* `inner` (True: pass-through) sees them."""
    def stream(data: bytes):
        count(len(data))
        return data if inner is True else inner(data)
    return stream


class MetricsFeed:
    name = "egressmetrics"

    def __init__(self, state: GatewayState):
        self.state = state
        self.metrics = GatewayMetrics()
        self.enabled = False
        self._modes: dict[str, str] = {}  # client id -> mode, for the active connections gauge
        self._tcp_rules: dict[str, str | None] = {}  # client "ip:port" -> rule of its raw TCP connection
        self._policy = None  # the policy last installed
        self._audit_seen: tuple[int, int, int] = (0, 0, 0)  # (id of the log, failures, suppressed) told to metrics
        self._audit_lock = threading.Lock()  # the heartbeat and the endpoint's thread both tell them
        self._task: asyncio.Task | None = None
        state.install_listeners.append(self._on_install)  # every engine installed (start-up, reloads)
        state.usage_listeners.append(self.metrics.limited)  # bytes counted against policy limits
        state.wait_listeners.append(self.metrics.loop_share_waited)  # reads held for a sandbox's loop share

    def enable(self) -> None:
        """Someone scrapes: from now on decisions and timings are counted too."""
        if not self.enabled:
            self.state.decision_listeners.append(self._on_decision)
            self.state.timing_listeners.append(self.metrics.on_timing)
            self.enabled = True

    def _on_install(self, engine) -> None:
        if engine.policy is not self._policy:  # not when the same engine is installed again (configure)
            self._policy = engine.policy
            self.metrics.policy_loaded(engine.policy)

    def running(self):
        self._task = every_second(self._tick, "metrics heartbeat")

    def done(self):
        if self._task is not None:
            self._task.cancel()

    def _tick(self) -> None:
        self.metrics.loop_share_active.set(fair_share.active())
        self.audit_metrics()

    def audit_metrics(self) -> None:
        """Tell the metrics what changed in the audit log (heartbeat, and every scrape)."""
        if not self.enabled:
            return
        with self._audit_lock:
            audit = self.state.audit
            seen_id, failures, suppressed = self._audit_seen
            if seen_id != id(audit):
                failures = suppressed = 0
            now_failures, now_suppressed = audit.write_failures, audit.suppressed
            self.metrics.audit_state(audit.writable, now_failures - failures, now_suppressed - suppressed)
            self._audit_seen = (id(audit), now_failures, now_suppressed)

    # --- decision entries ---------------------------------------------------------------------------

    def _on_decision(self, entry: dict[str, Any]) -> None:
        self.metrics.on_decision(entry)
        if (entry.get("protocol") == "tcp" and entry.get("event") == "connection"
                and entry.get("decision") in ("allow", "would_deny")):  # both relay bytes
            self._tcp_rules[str(entry.get("client"))] = entry.get("rule")

    # --- mitmproxy hooks -------------------------------------------------------------------------

    def client_connected(self, client):
        mode = _mode_name(client)
        self._modes[client.id] = mode
        self.metrics.connection_opened(mode)

    def client_disconnected(self, client):
        mode = self._modes.pop(client.id, None)
        if mode is not None:
            self.metrics.connection_closed(mode)
        if client.peername and self._tcp_rules:
            self._tcp_rules.pop(f"{client.peername[0]}:{client.peername[1]}", None)

    def requestheaders(self, flow: http.HTTPFlow):
        if not self.enabled or flow.response is not None:
            return
        decision = _decision(flow)
        if decision is None or not decision.allowed:
            return
        if flow.request.stream:
            rule = decision.rule
            flow.request.stream = counting_stream(flow.request.stream, lambda n: self.metrics.relayed("sent", rule, n))
            flow.metadata[COUNTED + "_request"] = True

    def request(self, flow: http.HTTPFlow):
        if not self.enabled or flow.response is not None or flow.metadata.get(COUNTED + "_request"):
            return
        decision = _decision(flow)
        if decision is not None and decision.allowed:
            self.metrics.relayed("sent", decision.rule, len(flow.request.raw_content or b""))

    def responseheaders(self, flow: http.HTTPFlow):
        if not self.enabled:
            return
        decision = _decision(flow)
        response = flow.response
        if decision is None or not decision.allowed or response is None or flow.server_conn.timestamp_start is None:
            return
        sent = flow.request.timestamp_end or flow.request.timestamp_start
        if response.timestamp_start and sent:
            self.metrics.upstream_first_byte(decision.rule, response.timestamp_start - sent)
        if response.stream:
            rule = decision.rule
            response.stream = _counting_in(response.stream, lambda n: self.metrics.relayed("received", rule, n))
            flow.metadata[COUNTED + "_response"] = True

    def response(self, flow: http.HTTPFlow):
        if not self.enabled or flow.metadata.get(COUNTED + "_response"):
            return
        decision = _decision(flow)
        response = flow.response
        if decision is None or not decision.allowed or response is None or flow.server_conn.timestamp_start is None:
            return
        if response.stream:  # switched to streaming mid-body, after responseheaders: not counted
            return
        self.metrics.relayed("received", decision.rule, len(response.raw_content or b""))

    def websocket_message(self, flow: http.HTTPFlow):
        if not self.enabled or flow.websocket is None or not flow.websocket.messages:
            return
        decision = _decision(flow)
        message = flow.websocket.messages[-1]
        self.metrics.relayed("sent" if message.from_client else "received",
                             decision.rule if decision is not None else None, len(message.content))

    def tcp_message(self, flow):
        if not self.enabled or not flow.messages:
            return
        message = flow.messages[-1]
        peer = flow.client_conn.peername
        rule = self._tcp_rules.get(f"{peer[0]}:{peer[1]}") if peer else None
        self.metrics.relayed("sent" if message.from_client else "received", rule, len(message.content))
