"""gateway.revocation.rejudge: is an open connection still allowed under a new engine? Asked with
the engine's own checks, so it must agree with what a new connection gets (and with `explain`)."""

from __future__ import annotations

import asyncio
import ipaddress
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine import Engine, RequestFacts
from gateway.hostnames import canonical_host, ip_host
from gateway.policy import EVERY_RULE, compile_policy
from gateway.session import ClientSession, drive
from gateway.revocation import KINDS, PASSTHROUGH_WITHDRAWN, Established, rejudge, revocation
from tests.support.pins import pin_of

ip = ipaddress.ip_address
C = canonical_host

HEAD = """\
version: 1
{extra}
resolver:
  static_hosts:
    a.test: [93.184.216.34]
    b.test: [93.184.216.35]
    p.test: [93.184.216.36]
    inside.test: [10.9.0.1]
network:
  allow_ip_ranges: [10.9.0.0/16]
rules:
"""

RULES = {
    "a": "  - id: a\n    hosts: [a.test]\n",
    "a-ws": "  - id: a-ws\n    hosts: [a.test]\n    paths: ['/ws/**']\n",
    "b": "  - id: b\n    hosts: [b.test]\n    ports: [443, 8443]\n",
    "p": "  - id: p\n    hosts: [p.test]\n    inspect: false\n",
    "p-inspected": "  - id: p-inspected\n    hosts: [p.test]\n",
    "inside": "  - id: inside\n    hosts: [inside.test]\n",
    "ssh": "  - id: ssh\n    protocol: tcp\n    hosts: [93.184.216.77]\n    ports: [22]\n",
    "ssh-name": "  - id: ssh-name\n    protocol: tcp\n    hosts: [git.test]\n    ports: [22]\n",
}


def engine_of(*ids: str, extra: str = "") -> Engine:
    text = HEAD.format(extra=extra) + "".join(RULES[i] for i in ids)
    if not ids:
        text += "  []\n"
    engine = Engine.build(compile_policy(text, "test.yaml"))
    return engine


def pinned(engine: Engine, host: str, port: int = 443):
    decision, pin = pin_of(engine, C(host), port)
    assert pin is not None, decision
    return pin


def tunnel(engine: Engine, host: str, port: int = 443, kind: str = "tunnel", rule: str | None = None,
           client: str | None = None, original: str | None = None) -> Established:
    return Established(kind, pinned(engine, host, port), rule, ip(client) if client else None,
                       original=ip(original) if original else None)


def websocket(engine: Engine, host: str, path: str, method: str = "GET", rule: str | None = None,
              headers: tuple = ()) -> Established:
    pin = pinned(engine, host)
    facts = RequestFacts(pin.host, pin.port, "https", method, path, headers)
    return Established("websocket", pin, rule, None, request=facts)


def raw_tcp(address: str, port: int = 22, names: tuple[str, ...] = ()) -> Established:
    a = ip(address)
    from gateway.engine import Pin

    return Established("tcp", Pin(ip_host(a), port, a, (a,)), "ssh", None, names=names)


# --- each kind, judged as a new connection would be -----------------------------------------------


def test_a_tunnel_stays_while_its_host_is_allowed_and_goes_when_it_is_not():
    before = engine_of("a", "b")
    est = tunnel(before, "a.test", rule="a")
    assert rejudge(before, est).allowed
    assert rejudge(engine_of("a"), est).allowed
    gone = rejudge(engine_of("b"), est)
    assert (gone.allowed, gone.reason) == (False, "no_rule")


def test_a_tunnel_on_a_port_no_rule_allows_any_more():
    est = tunnel(engine_of("b"), "b.test", 8443, rule="b")
    narrowed = engine_of(extra="").__class__.build(compile_policy(
        HEAD.format(extra="") + "  - id: b\n    hosts: [b.test]\n    ports: [443]\n", "t.yaml"))
    decision = rejudge(narrowed, est)
    assert (decision.allowed, decision.reason, decision.rule) == (False, "port_not_allowed", "b")


def test_path_rules_do_not_close_a_tunnel_whose_host_is_still_allowed():
    est = tunnel(engine_of("a"), "a.test", rule="a")
    assert rejudge(engine_of("a-ws"), est).allowed  # each request is judged by the new paths already


def test_a_websocket_is_judged_by_its_upgrade_request():
    est = websocket(engine_of("a-ws"), "a.test", "/ws/chat", rule="a-ws")
    assert rejudge(engine_of("a-ws"), est).allowed
    narrowed = Engine.build(compile_policy(HEAD.format(extra="") + "  - id: a-ws\n    hosts: [a.test]\n"
                                           "    paths: ['/api/**']\n", "t.yaml"))
    decision = rejudge(narrowed, est)
    assert (decision.allowed, decision.reason) == (False, "path_not_allowed")
    posted = websocket(engine_of("a"), "a.test", "/ws", headers=(("X-HTTP-Method-Override", "DELETE"),))
    only_get = Engine.build(compile_policy(HEAD.format(extra="") + "  - id: a\n    hosts: [a.test]\n"
                                           "    methods: [GET]\n", "t.yaml"))
    assert rejudge(only_get, posted).reason == "method_not_allowed"  # overrides count, as for a new request


def test_a_passthrough_tunnel_needs_a_passthrough_rule_still():
    est = tunnel(engine_of("p"), "p.test", kind="passthrough", rule="p")
    assert rejudge(engine_of("p"), est).allowed
    withdrawn = rejudge(engine_of("p-inspected"), est)
    assert (withdrawn.allowed, withdrawn.reason, withdrawn.rule) == (False, PASSTHROUGH_WITHDRAWN, "p-inspected")
    # an inspected tunnel to a host that became passthrough stays: it is inspected, which is more
    assert rejudge(engine_of("p"), tunnel(engine_of("p-inspected"), "p.test", rule="p-inspected")).allowed


def test_the_new_deny_list_applies_to_the_pinned_addresses():
    est = tunnel(engine_of("inside"), "inside.test", rule="inside")
    no_exemption = Engine.build(compile_policy(
        HEAD.format(extra="").replace("  allow_ip_ranges: [10.9.0.0/16]\n", "  allow_ip_ranges: []\n")
        + RULES["inside"], "t.yaml"))
    decision = rejudge(no_exemption, est)
    assert (decision.allowed, decision.reason, decision.rule) == (False, "denied_address", "inside")


def test_strict_original_destination_applies_to_an_open_transparent_connection():
    est = tunnel(engine_of("a"), "a.test", rule="a", original="93.184.216.99")
    assert rejudge(engine_of("a"), est).allowed
    strict = Engine.build(compile_policy(HEAD.format(extra="").replace(
        "network:\n", "network:\n  strict_original_destination: true\n") + RULES["a"], "t.yaml"))
    assert rejudge(strict, est).reason == "original_destination_mismatch"
    assert rejudge(strict, tunnel(engine_of("a"), "a.test", original="93.184.216.34")).allowed


def test_raw_tcp_by_address_and_by_the_names_it_was_admitted_with():
    assert rejudge(engine_of("ssh"), raw_tcp("93.184.216.77")).allowed
    assert rejudge(engine_of("a"), raw_tcp("93.184.216.77")).reason == "no_rule"
    by_name = raw_tcp("93.184.216.78", names=("git.test",))
    assert rejudge(engine_of("ssh-name"), by_name).allowed
    assert rejudge(engine_of("ssh-name"), raw_tcp("93.184.216.78")).reason == "no_rule"


def test_sandbox_scope_of_the_new_policy_decides():
    sandboxes = ("sandboxes:\n  - id: ci\n    source_ips: [10.0.0.0/8]\n    rules: [{rules}]\n"
                 "  - id: default\n    rules: [b]\n")
    granted = engine_of("a", "b", extra=sandboxes.format(rules="a, b"))
    est = tunnel(granted, "a.test", rule="a", client="10.1.2.3")
    assert rejudge(granted, est).allowed
    revoked = rejudge(engine_of("a", "b", extra=sandboxes.format(rules="b")), est)
    assert (revoked.allowed, revoked.reason) == (False, "no_rule")
    assert "sandbox ci" in revoked.message


def test_report_mode_makes_an_allowlist_revocation_would_deny_but_never_an_address_one():
    est = tunnel(engine_of("a"), "a.test", rule="a")
    report = engine_of("b", extra="mode: report")
    decision = rejudge(report, est)
    assert (decision.allowed, decision.would_deny, decision.reason) == (True, True, "no_rule")
    line = revocation(est, decision)
    assert (line.verdict, line.reason, line.rule) == ("would_deny", "revoked", "a")
    inside = tunnel(engine_of("inside"), "inside.test", rule="inside")
    no_exemption = Engine.build(compile_policy(
        HEAD.format(extra="mode: report").replace("  allow_ip_ranges: [10.9.0.0/16]\n", "  allow_ip_ranges: []\n")
        + RULES["inside"], "t.yaml"))
    assert rejudge(no_exemption, inside).reason == "denied_address"  # never relaxed


def test_a_revocation_line_is_a_deny_naming_the_old_rule():
    est = tunnel(engine_of("a"), "a.test", rule="a")
    line = revocation(est, rejudge(engine_of("b"), est))
    assert (line.verdict, line.reason, line.rule, line.allowed) == ("deny", "revoked", "a", False)
    assert "no rule allows a.test:443" in line.message


def test_an_unknown_kind_is_refused():
    pin = pinned(engine_of("a"), "a.test")
    with pytest.raises(ValueError):
        Established("smtp", pin, "a", None)
    with pytest.raises(ValueError):
        Established("websocket", pin, "a", None)  # no upgrade request


# --- properties --------------------------------------------------------------------------------------

RULE_IDS = sorted(RULES)
HOSTS = ["a.test", "b.test", "p.test", "inside.test"]
subsets = st.lists(st.sampled_from(RULE_IDS), unique=True)


def _established(engine: Engine, host: str, port: int, kind: str, path: str):
    """What a new connection would establish under `engine`, or None if it is refused (exactly as
    the guards decide: check_destination / check_request, then the pinned addresses)."""
    session = ClientSession("10.0.0.2:1", "regular")
    step = asyncio.run(drive(session.connect(C(host).authority(port), engine, EVERY_RULE), engine.resolved,
                             lambda established: None))
    decision, pin = step.decision, step.pin
    if pin is None or not decision.allowed:
        return None
    if kind == "passthrough":
        if engine.passthrough_rule(decision) is None:
            return None
        return Established("passthrough", pin, decision.rule, None)
    if kind == "websocket":
        facts = RequestFacts(pin.host, pin.port, "https", "GET", path)
        if not engine.check_request(facts).allowed:
            return None
        return Established("websocket", pin, decision.rule, None, request=facts)
    return Established(kind, pin, decision.rule, None)


@settings(max_examples=150, deadline=None)
@given(subsets, st.sampled_from(HOSTS), st.sampled_from([443, 8443]), st.sampled_from(["tunnel", "passthrough",
       "websocket"]), st.sampled_from(["/ws/x", "/api"]))
def test_whatever_an_engine_admits_it_never_revokes(ids, host, port, kind, path):
    engine = engine_of(*ids)
    est = _established(engine, host, port, kind, path)
    if est is not None:
        assert rejudge(engine, est).allowed


@settings(max_examples=150, deadline=None)
@given(subsets, subsets, st.sampled_from(HOSTS), st.sampled_from([443, 8443]),
       st.sampled_from(["tunnel", "websocket"]), st.sampled_from(["/ws/x", "/api"]))
def test_rejudging_agrees_with_what_a_new_connection_gets(before, after, host, port, kind, path):
    """Open under `before`, judged again under `after`: kept exactly when a new connection like it
    would be admitted by `after` (inspected kinds: same checks, same pinned addresses)."""
    est = _established(engine_of(*before), host, port, kind, path)
    if est is None:
        return
    new = engine_of(*after)
    assert rejudge(new, est).allowed == (_established(new, host, port, kind, path) is not None)


@settings(max_examples=100, deadline=None)
@given(subsets, subsets, st.sampled_from(HOSTS), st.sampled_from(["tunnel", "passthrough", "websocket"]))
def test_appending_rules_never_revokes(ids, more, host, kind):
    engine = engine_of(*ids)
    est = _established(engine, host, 443, kind, "/ws/x")
    if est is None:
        return
    wider = engine_of(*ids, *[i for i in more if i not in ids])
    assert rejudge(wider, est).allowed


@settings(max_examples=100, deadline=None)
@given(subsets, subsets, st.sampled_from(HOSTS), st.sampled_from(["tunnel", "websocket"]))
def test_report_mode_never_closes_what_only_the_allowlist_refuses(before, after, host, kind):
    est = _established(engine_of(*before), host, 443, kind, "/ws/x")
    if est is None:
        return
    decision = rejudge(engine_of(*after, extra="mode: report"), est)
    assert decision.allowed or decision.reason not in ("no_rule", "port_not_allowed", "path_not_allowed",
                                                       "method_not_allowed", "scheme_not_allowed")


def test_every_kind_is_known_to_the_metrics():
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    for kind in KINDS:
        metrics.on_decision({"event": "connection", "mode": "regular", "decision": "deny", "reason": "revoked",
                             "kind": kind})
    metrics.on_decision({"event": "connection", "decision": "would_deny", "reason": "revoked", "kind": "tcp"})
    for kind in KINDS:
        assert metrics.registry.get_sample_value("egress_revoked_connections_total", {"kind": kind}) == 1
    assert metrics.registry.get_sample_value(
        "egress_connections_total", {"mode": "regular", "decision": "deny", "reason": "revoked"}) == len(KINDS)
