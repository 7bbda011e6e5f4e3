"""Prometheus metrics: definitions and the listeners that feed them (no mitmproxy types here).

Every metric is fed from something the gateway already produces:
- decision entries (`GatewayState.record`: the audit entry plus private "_" keys), by `on_decision`;
- policy check timings (`Engine.timings`), by `on_timing`;
- policy loads (every engine installed), by `policy_loaded`;
- the mitmproxy addon (addons/metrics.py) for connections, bytes and upstream latency.

Label values are bounded: rule and sandbox ids must belong to a policy this process loaded, reason
codes to gateway.decision.REASONS, secret names to a policy's `secrets`; anything else (None, an
unknown id, a host name, a path) becomes "none" or "other". No label ever carries a value from the
sandbox. The event contract (which entries count where) is documented in docs/metrics.md.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client import disable_created_metrics

from .decision import REASONS
from .revocation import KINDS as REVOKED_KINDS

NONE = "none"  # no value (no rule matched, no sandbox section, ...)
OTHER = "other"  # a value outside the bounded set

DECISIONS = frozenset({"allow", "deny", "would_deny"})
MODES = frozenset({"regular", "transparent", "dns"})
CHECK_KINDS = frozenset({"destination", "request", "tcp", "dns"})
RELOAD_RESULTS = frozenset({"ok", "error"})
DIRECTIONS = frozenset({"sent", "received"})
USAGE_DIRECTIONS = frozenset({"upload", "download"})

REQUEST_EVENTS = frozenset({"request"})
FAILURE_EVENTS = frozenset({"response", "error", "request_body"})  # refusals after the policy allowed the request
CONNECTION_EVENTS = frozenset({"connect", "tls", "connection"})
DNS_EVENT = "dns"
REDACTION_EVENT = "redaction"
RELOAD_EVENT = "policy_reload"

# Time to first byte from an upstream: from well under a millisecond (loopback) to a minute.
UPSTREAM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# One policy check (no DNS, no I/O): microseconds.
DECISION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)

_SECRET_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def multiprocess_dir() -> str | None:
    """Set (by `run --workers N`) when several processes share the metrics: prometheus-client's
    multiprocess mode, in which every process writes its values to files in this directory and
    any process can serve the sum."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir") or None


def _known(value: Any, known: frozenset[str]) -> str:
    """A label value from a bounded set, so no input can create a new time series."""
    if value is None:
        return NONE
    return value if isinstance(value, str) and value in known else OTHER


class ControlMetrics:
    """The control API's metrics (gateway/control.py), in whichever registry serves them: the
    gateway's own, or (run --workers N) the supervisor's multiprocess files, summed with the workers'.
    Labels are bounded: an action of `ROUTES` and a result code, never a sandbox id."""

    def __init__(self, registry: CollectorRegistry):
        from .control import ACTIONS

        self._actions = frozenset(ACTIONS)
        self.requests = Counter(
            "egress_control_requests", "Control API requests and expiries, by action (register, deregister, grant, "
            "revoke, expire, list, get, ...) and result (ok, or the refusal's reason code).", ["action", "result"],
            registry=registry)
        self.sandboxes = Gauge("egress_registered_sandboxes", "Sandboxes registered through the control API now.",
                               registry=registry, multiprocess_mode="livemax")
        self.grants = Gauge("egress_control_grants", "Grants held by registered sandboxes now.", registry=registry,
                            multiprocess_mode="livemax")
        for action in ("register", "deregister", "grant", "revoke", "expire"):
            self.requests.labels(action, "ok")

    def count(self, action: str, result: str) -> None:
        self.requests.labels(_known(action, self._actions), result if _RESULT.match(result or "") else OTHER).inc()

    def sizes(self, sandboxes: int, grants: int) -> None:
        self.sandboxes.set(sandboxes)
        self.grants.set(grants)


_RESULT = re.compile(r"^[a-z_]{1,32}$")


class GatewayMetrics:
    """All gateway metrics, in a registry of their own (so several gateways can live in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        # `_created` series double the series count for no use here.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = multiprocess_dir() is not None
        # What /metrics serves: this registry, or with workers the sum over every worker's files.
        self.exposition_registry = self.registry
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.exposition_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposition_registry)
        r = self.registry
        self.requests = Counter(
            "egress_requests", "HTTP request decisions, by sandbox, rule, decision and reason code.",
            ["sandbox", "rule", "decision", "reason"], registry=r,
        )
        self.connections = Counter(
            "egress_connections", "Connection-level decisions (CONNECT, TLS SNI, raw TCP, refused protocols), "
            "by proxy mode, decision and reason code.", ["mode", "decision", "reason"], registry=r,
        )
        self.active_connections = Gauge(
            "egress_active_connections", "Client connections open now, by proxy mode.", ["mode"], registry=r,
            multiprocess_mode="livesum",
        )
        self.upstream_duration = Histogram(
            "egress_upstream_request_duration_seconds",
            "Time from the end of the request to the first byte of the upstream response, by rule.",
            ["rule"], buckets=UPSTREAM_BUCKETS, registry=r,
        )
        self.decision_duration = Histogram(
            "egress_decision_duration_seconds", "Time spent in one policy check (no DNS, no I/O), by kind.",
            ["kind"], buckets=DECISION_BUCKETS, registry=r,
        )
        self.bytes = Counter(
            "egress_bytes", "Payload bytes relayed for allowed traffic: HTTP bodies, WebSocket messages and raw "
            "TCP data; sent = to the upstream, received = from it.", ["direction", "rule"], registry=r,
        )
        self.injections = Counter(
            "egress_credential_injections", "Credentials injected into allowed requests, by secret name and rule.",
            ["secret", "rule"], registry=r,
        )
        self.redactions = Counter(
            "egress_credential_redactions", "Secrets redacted from upstream responses, by secret name.",
            ["secret"], registry=r,
        )
        self.reloads = Counter(
            "egress_policy_reloads", "Policy reload attempts, by result (ok|error).", ["result"], registry=r,
        )
        policy_help = "The policy in force: its format version and the SHA-256 of its file."
        if self.multiprocess:
            # Info metrics do not work across processes; a gauge of the same name and labels does
            # (1: in force in some live worker, 0: replaced).
            self.policy_info = Gauge("egress_policy_info", policy_help, ["version", "sha256"], registry=r,
                                     multiprocess_mode="livemax")
        else:
            self.policy_info = Info("egress_policy", policy_help, registry=r)
        self._policy_labels: tuple[str, str] | None = None
        self.policy_loaded_at = Gauge(
            "egress_policy_last_reload_timestamp_seconds",
            "Unix time at which the policy in force was loaded (the initial load counts).", registry=r,
            multiprocess_mode="livemax",
        )
        self.upstream_failures = Counter(
            "egress_upstream_failures", "Allowed requests that failed afterwards (upstream connection or TLS "
            "failure, oversized or unsolicited responses), by reason code.", ["reason"], registry=r,
        )
        self.revoked = Counter(
            "egress_revoked_connections", "Open connections closed because a policy change no longer allows them, "
            "by kind (tunnel, http, passthrough, tcp, websocket, request).", ["kind"], registry=r,
        )
        self.limited_bytes = Counter(
            "egress_limited_bytes", "Body bytes counted against the policy's limits: budgets (upload_bytes_per_hour, "
            "download_bytes_per_hour), by sandbox, rule and direction (upload|download).",
            ["sandbox", "rule", "direction"], registry=r,
        )
        self.loop_share_waits = Counter(
            "egress_loop_share_wait_seconds", "Seconds the reads of a sandbox's connections waited because it was over "
            "its share of a worker's event loop while another sandbox was active (egress_max_loop_share_per_sandbox), "
            "by sandbox.", ["sandbox"], registry=r,
        )
        self.loop_share_active = Gauge(
            "egress_loop_share_active_sandboxes", "Sandboxes whose connections used a worker's event loop in the last "
            "second (each may have at least 1/N of it, and what lighter ones leave, up to "
            "egress_max_loop_share_per_sandbox; summed over workers).", registry=r, multiprocess_mode="livesum",
        )
        self.dns_queries = Counter(
            "egress_dns_queries", "DNS-mode queries answered, by decision.", ["decision"], registry=r,
        )
        self.audit_write_failures = Counter(
            "egress_audit_write_failures", "Audit lines that could not be written (disk full, read-only, the "
            "supervisor's file unwritable): each failed its decision closed (500 internal_error).", registry=r,
        )
        self.audit_writable = Gauge(
            "egress_audit_writable", "1 while the audit log can be written, 0 from a failed write until a write "
            "succeeds again (with workers: 0 if any worker says so).", registry=r, multiprocess_mode="livemin",
        )
        self.audit_suppressed = Counter(
            "egress_audit_suppressed_refusals", "Refusals over their sandbox's audit line budget: counted in a "
            "'suppressed' summary line instead of a line each (every refusal still counts in the other metrics).",
            registry=r,
        )
        self.audit_writable.set(1)
        self.control = ControlMetrics(r)
        self._lock = threading.Lock()
        self._rules: set[str] = set()
        self._sandboxes: set[str] = set()
        self._secrets: set[str] = set()
        # Series that exist from the start, so that rate() and alerts see zeros instead of nothing.
        for result in sorted(RELOAD_RESULTS):
            self.reloads.labels(result)
        for mode in sorted(MODES):
            self.active_connections.labels(mode)
        for decision in ("allow", "deny"):
            self.dns_queries.labels(decision)
        for kind in REVOKED_KINDS:
            self.revoked.labels(kind)

    # --- bounded label values --------------------------------------------------------------------

    def rule_label(self, rule: Any) -> str:
        return rule if isinstance(rule, str) and rule in self._rules else NONE

    def sandbox_label(self, sandbox: Any, profile: Any = None) -> str:
        """The sandbox's id if the policy has it, else its profile's (a token's subject is not a label
        value: there may be any number of them), else "none"."""
        if isinstance(sandbox, str) and sandbox in self._sandboxes:
            return sandbox
        return profile if isinstance(profile, str) and profile in self._sandboxes else NONE

    def secret_label(self, secret: Any) -> str:
        if isinstance(secret, str) and secret in self._secrets:
            return secret
        return NONE if secret is None else OTHER

    @staticmethod
    def reason_label(reason: Any) -> str:
        return _known(reason, REASONS)

    @staticmethod
    def decision_label(decision: Any) -> str:
        return _known(decision, DECISIONS)

    @staticmethod
    def mode_label(mode: Any) -> str:
        return _known(mode, MODES)

    # --- feeds ---------------------------------------------------------------------------------

    def policy_loaded(self, policy: Any, when: float | None = None) -> None:
        """A policy was installed (initial load or reload): its ids become valid label values."""
        rules = {r.id for r in getattr(policy, "rules", ())}
        sandboxes = {s.id for s in getattr(policy, "sandboxes", None) or ()}
        secrets = {name for name in (getattr(policy, "secrets", None) or {}) if _SECRET_NAME.match(str(name))}
        with self._lock:
            # Ids of earlier policies stay valid: decisions in flight during a reload still name them.
            self._rules |= rules
            self._sandboxes |= sandboxes
            self._secrets |= secrets
        labels = (str(getattr(policy, "version", "")), str(getattr(policy, "sha256", "")))
        if self.multiprocess:
            if self._policy_labels is not None and self._policy_labels != labels:
                self.policy_info.labels(*self._policy_labels).set(0)
            self.policy_info.labels(*labels).set(1)
        else:
            self.policy_info.info({"version": labels[0], "sha256": labels[1]})
        self._policy_labels = labels
        self.policy_loaded_at.set(time.time() if when is None else when)

    def on_timing(self, kind: str, seconds: float) -> None:
        self.decision_duration.labels(kind if kind in CHECK_KINDS else OTHER).observe(seconds)

    def on_decision(self, entry: dict[str, Any]) -> None:
        """One recorded entry (audit keys plus private "_" keys); see docs/metrics.md."""
        event = entry.get("event")
        repeated = entry.get("repeated")  # one line that stands for several refusals (HTTP/2 floods)
        weight = repeated if isinstance(repeated, int) and not isinstance(repeated, bool) and repeated > 0 else 1
        if event in REQUEST_EVENTS:
            rule = self.rule_label(entry.get("rule"))
            self.requests.labels(
                self.sandbox_label(entry.get("sandbox"), entry.get("profile")), rule,
                self.decision_label(entry.get("decision")), self.reason_label(entry.get("reason")),
            ).inc(weight)
            injected = entry.get("injected")
            if isinstance(injected, (list, tuple)):
                for secret in dict.fromkeys(s for s in injected if isinstance(s, str)):
                    self.injections.labels(self.secret_label(secret), rule).inc()
        elif event in CONNECTION_EVENTS:
            self.connections.labels(
                self.mode_label(entry.get("mode")), self.decision_label(entry.get("decision")),
                self.reason_label(entry.get("reason")),
            ).inc(weight)
            if event == "connection" and entry.get("reason") == "revoked" and entry.get("decision") == "deny":
                kind = entry.get("kind")
                self.revoked.labels(kind if kind in REVOKED_KINDS else OTHER).inc()
        elif event in FAILURE_EVENTS:
            self.upstream_failures.labels(self.reason_label(entry.get("reason"))).inc()
        elif event == DNS_EVENT:
            self.dns_queries.labels(self.decision_label(entry.get("decision"))).inc()
        elif event == REDACTION_EVENT:
            self.redactions.labels(self.secret_label(entry.get("secret"))).inc()
        elif event == RELOAD_EVENT:
            result = entry.get("result")
            self.reloads.labels(result if result in RELOAD_RESULTS else "error").inc()

    def audit_state(self, writable: bool, failures: int = 0, suppressed: int = 0) -> None:
        """The audit log's state: writable now, and failures and suppressed refusals since last told."""
        self.audit_writable.set(1 if writable else 0)
        if failures > 0:
            self.audit_write_failures.inc(failures)
        if suppressed > 0:
            self.audit_suppressed.inc(suppressed)

    def connection_opened(self, mode: str) -> None:
        self.active_connections.labels(self.mode_label(mode)).inc()

    def connection_closed(self, mode: str) -> None:
        self.active_connections.labels(self.mode_label(mode)).dec()

    def upstream_first_byte(self, rule: Any, seconds: float) -> None:
        if seconds >= 0:
            self.upstream_duration.labels(self.rule_label(rule)).observe(seconds)

    def relayed(self, direction: str, rule: Any, count: int) -> None:
        if count > 0 and direction in DIRECTIONS:
            self.bytes.labels(direction, self.rule_label(rule)).inc(count)

    def limited(self, sandbox: Any, rule: Any, direction: str, count: int) -> None:
        if count > 0 and direction in USAGE_DIRECTIONS:
            self.limited_bytes.labels(self.sandbox_label(sandbox), self.rule_label(rule), direction).inc(count)

    def loop_share_waited(self, sandbox: Any, seconds: float) -> None:
        if seconds > 0:
            self.loop_share_waits.labels(self.sandbox_label(sandbox)).inc(seconds)

    def metric_names(self) -> Iterable[str]:
        """Every sample name this registry exposes (in the text format), labelled or not yet."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",),
                    "gauge": ("",), "summary": ("_count", "_sum", "")}
        for family in self.registry.collect():
            for suffix in suffixes.get(family.type, ("",)):
                yield family.name + suffix
