"""GatewayMetrics fed by hand: which entries count where, and label values that stay bounded."""

from __future__ import annotations

import ipaddress
import types

import pytest
from prometheus_client import generate_latest

from addons.health import parse_listen
from addons.signals import SignalHub
from gateway.metrics import GatewayMetrics

from .conftest import samples, value


def policy(rules=("pypi", "github"), sandboxes=("ci",), secrets=("GITHUB_TOKEN",), sha="ab" * 32):
    return types.SimpleNamespace(
        rules=[types.SimpleNamespace(id=r) for r in rules],
        sandboxes=[types.SimpleNamespace(id=s) for s in sandboxes],
        secrets={name: object() for name in secrets},
        version=1, sha256=sha,
    )


@pytest.fixture
def metrics():
    m = GatewayMetrics()
    m.policy_loaded(policy(), when=1700000000.0)
    return m


def scraped(m: GatewayMetrics):
    return samples(generate_latest(m.registry).decode())


def test_request_decisions(metrics):
    metrics.on_decision({"event": "request", "sandbox": "ci", "rule": "pypi", "decision": "allow", "reason": "allowed"})
    metrics.on_decision({"event": "request", "sandbox": None, "rule": None, "decision": "deny", "reason": "no_rule"})
    metrics.on_decision({"event": "request", "sandbox": "ci", "rule": "pypi", "decision": "would_deny",
                         "reason": "path_not_allowed"})
    s = scraped(metrics)
    assert value(s, "egress_requests_total", sandbox="ci", rule="pypi", decision="allow", reason="allowed") == 1
    assert value(s, "egress_requests_total", sandbox="none", rule="none", decision="deny", reason="no_rule") == 1
    assert value(s, "egress_requests_total", decision="would_deny", reason="path_not_allowed") == 1


def test_label_values_stay_bounded(metrics):
    # values a sandbox could choose never become label values
    metrics.on_decision({"event": "request", "sandbox": "evil-sandbox", "rule": "exfil.attacker.example",
                         "decision": "maybe", "reason": "/etc/passwd", "host": "secret.attacker.example",
                         "path": "/leak?data=1"})
    metrics.on_decision({"event": "connect", "mode": "socks5", "decision": "deny", "reason": "x" * 100})
    metrics.on_decision({"event": "redaction", "secret": "NOT_DECLARED"})
    metrics.on_decision({"event": "request", "rule": "pypi", "decision": "allow", "reason": "allowed",
                         "injected": ["GITHUB_TOKEN", "ghp_realvalue123", None]})
    metrics.on_decision({"event": "policy_reload", "result": "weird"})
    text = generate_latest(metrics.registry).decode()
    for leaked in ("evil-sandbox", "attacker", "/etc/passwd", "leak", "socks5", "xxxx", "NOT_DECLARED", "ghp_", "maybe",
                   "weird"):
        assert leaked not in text
    s = samples(text)
    assert value(s, "egress_requests_total", sandbox="none", rule="none", decision="other", reason="other") == 1
    assert value(s, "egress_connections_total", mode="other", decision="deny", reason="other") == 1
    assert value(s, "egress_credential_redactions_total", secret="other") == 1
    assert value(s, "egress_credential_injections_total", secret="GITHUB_TOKEN", rule="pypi") == 1
    assert value(s, "egress_credential_injections_total", secret="other", rule="pypi") == 1
    assert value(s, "egress_policy_reloads_total", result="error") == 1


def test_event_contract(metrics):
    for event, extra in (("connect", {}), ("tls", {"ech": True}), ("connection", {"protocol": "tcp"})):
        metrics.on_decision({"event": event, "mode": "transparent", "decision": "deny", "reason": "no_rule", **extra})
    metrics.on_decision({"event": "dns", "decision": "allow", "reason": "allowed", "dns_type": "A", "rcode": "NOERROR"})
    metrics.on_decision({"event": "dns", "decision": "deny", "reason": "no_rule", "rcode": "NXDOMAIN"})
    metrics.on_decision({"event": "response", "decision": "deny", "reason": "unsolicited_upgrade"})
    metrics.on_decision({"event": "error", "decision": "deny", "reason": "upstream_failed"})
    metrics.on_decision({"event": "redaction", "secret": "GITHUB_TOKEN", "decision": "allow", "reason": "redacted"})
    metrics.on_decision({"event": "policy_reload", "result": "ok"})
    metrics.on_decision({"event": "policy_reload", "result": "error"})
    metrics.on_decision({"event": "something_new"})  # ignored
    s = scraped(metrics)
    assert value(s, "egress_connections_total", mode="transparent", decision="deny", reason="no_rule") == 3
    assert value(s, "egress_dns_queries_total", decision="allow") == 1
    assert value(s, "egress_dns_queries_total", decision="deny") == 1
    assert value(s, "egress_upstream_failures_total", reason="unsolicited_upgrade") == 1
    assert value(s, "egress_upstream_failures_total", reason="upstream_failed") == 1
    assert value(s, "egress_requests_total") == 0  # post-decision failures are not request decisions
    assert value(s, "egress_credential_redactions_total", secret="GITHUB_TOKEN") == 1
    assert value(s, "egress_policy_reloads_total", result="ok") == 1
    assert value(s, "egress_policy_reloads_total", result="error") == 1


def test_policy_info_follows_the_policy_in_force(metrics):
    s = scraped(metrics)
    assert value(s, "egress_policy_info", version="1", sha256="ab" * 32) == 1
    assert value(s, "egress_policy_last_reload_timestamp_seconds") == 1700000000.0
    metrics.policy_loaded(policy(rules=("new-rule",), sha="cd" * 32), when=1700000100.0)
    s = scraped(metrics)
    assert value(s, "egress_policy_info", sha256="ab" * 32) == 0  # one series: the policy in force
    assert value(s, "egress_policy_info", sha256="cd" * 32) == 1
    assert value(s, "egress_policy_last_reload_timestamp_seconds") == 1700000100.0
    metrics.on_decision({"event": "request", "rule": "new-rule", "decision": "allow", "reason": "allowed"})
    metrics.on_decision({"event": "request", "rule": "pypi", "decision": "allow", "reason": "allowed"})  # in flight
    s = scraped(metrics)
    assert value(s, "egress_requests_total", rule="new-rule") == 1
    assert value(s, "egress_requests_total", rule="pypi") == 1


def test_timings_bytes_latency_connections(metrics):
    metrics.on_timing("request", 0.00002)
    metrics.on_timing("destination", 0.00001)
    metrics.on_timing("bogus", 0.1)
    metrics.upstream_first_byte("pypi", 0.2)
    metrics.upstream_first_byte("pypi", -1)  # clock skew: dropped
    metrics.relayed("sent", "pypi", 100)
    metrics.relayed("received", "pypi", 5000)
    metrics.relayed("sideways", "pypi", 1)
    metrics.connection_opened("regular")
    metrics.connection_opened("regular")
    metrics.connection_closed("regular")
    s = scraped(metrics)
    assert value(s, "egress_decision_duration_seconds_count", kind="request") == 1
    assert value(s, "egress_decision_duration_seconds_count", kind="other") == 1
    assert value(s, "egress_upstream_request_duration_seconds_count", rule="pypi") == 1
    assert value(s, "egress_upstream_request_duration_seconds_bucket", rule="pypi", le="0.25") == 1
    assert value(s, "egress_bytes_total", direction="sent", rule="pypi") == 100
    assert value(s, "egress_bytes_total", direction="received", rule="pypi") == 5000
    assert value(s, "egress_bytes_total") == 5100
    assert value(s, "egress_active_connections", mode="regular") == 1


def test_naming_conventions(metrics):
    names = {family.name: family.type for family in metrics.registry.collect()}
    for name, kind in names.items():
        assert name.startswith("egress_")
        if kind == "counter":
            assert not name.endswith("_total")  # the client library adds it to the samples
        if kind == "histogram":
            assert name.endswith("_seconds")
    sample_names = set(metrics.metric_names())
    assert "egress_requests_total" in sample_names
    assert not any(n.endswith("_created") for n in sample_names)


def test_parse_listen():
    assert parse_listen("127.0.0.1:9464") == (ipaddress.ip_address("127.0.0.1"), 9464)
    assert parse_listen("[::1]:9464") == (ipaddress.ip_address("::1"), 9464)
    assert parse_listen("localhost:0") == (ipaddress.ip_address("127.0.0.1"), 0)
    for bad in ("9464", "example.com:9464", "127.0.0.1:99999", "[::1]", "::1:9464", ""):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_signal_hub_calls_every_subscriber():
    import signal

    hub = SignalHub()
    calls = []
    hub.subscribe(signal.SIGHUP, lambda: calls.append("audit"))
    hub.subscribe(signal.SIGHUP, lambda: 1 / 0)  # a failing subscriber does not stop the others
    hub.subscribe(signal.SIGHUP, lambda: calls.append("policy"))
    hub.dispatch(signal.SIGHUP)
    assert calls == ["audit", "policy"]


def test_bytes_counted_against_limits_by_sandbox_rule_and_direction(metrics):
    metrics.limited("ci", "pypi", "upload", 600)
    metrics.limited("ci", "pypi", "download", 800)
    metrics.limited("10.1.2.3", "pypi", "download", 5)  # never an address as a label value
    metrics.limited("ci", "pypi", "sideways", 1)
    metrics.limited("ci", "pypi", "upload", 0)
    s = scraped(metrics)
    assert value(s, "egress_limited_bytes_total", sandbox="ci", rule="pypi", direction="upload") == 600
    assert value(s, "egress_limited_bytes_total", sandbox="ci", rule="pypi", direction="download") == 800
    assert value(s, "egress_limited_bytes_total", sandbox="none", rule="pypi", direction="download") == 5
    assert value(s, "egress_limited_bytes_total") == 1405
