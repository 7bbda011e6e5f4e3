"""The registry and grants, pure (gateway/registry.py, gateway/grants.py): registrations name
sandboxes by address, grants stay inside the profile's `grantable` envelope, TTLs run out by an
injected clock, and what a decision asks costs the same with one sandbox or many."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gateway.engine import Engine
from gateway.grants import GrantError, build_grant, envelope_refusal, parse_host_pattern, within
from gateway.hostnames import canonical_host
from gateway.identity import Identity, scope_of
from gateway.policy import STANDARD_METHODS, compile_policy
from gateway.registry import Registry

POLICY = compile_policy("""version: 1
network:
  allow_ip_ranges: [127.0.0.0/8]
rules:
  - id: pypi
    hosts: [pypi.org]
  - id: docs
    hosts: [docs.python.org]
  - id: secret-api
    hosts: [api.internal.example]
sandboxes:
  - id: ci
    source_ips: [10.9.0.0/16]
    rules: [pypi, secret-api]
  - id: default
    rules: []
  - id: agent
    rules: [pypi]
    grantable:
      rules: [docs]
      hosts: ["*.github.com", "example.org"]
      ports: [443, 8443]
      methods: [GET, HEAD]
      max_ttl: 30m
  - id: plain
    rules: [pypi]
""", "test")

ENVELOPE = POLICY.sandboxes_by_id["agent"].grantable
T0 = 1000.0
WALL = 1_700_000_000.0


def ip(text: str):
    return ipaddress.ip_address(text)


def register(registry: Registry, sandbox: str = "s1", addresses=("10.0.0.5",), profile: str = "agent",
             ttl: float = 600.0, now: float = T0):
    return registry.apply({"op": "register", "registration": {
        "id": sandbox, "source_ips": list(addresses), "profile": profile, "expires": now + ttl,
        "expires_at": WALL + ttl, "by": "test"}})


def grant(registry: Registry, spec: dict, sandbox: str = "s1", grant_id: str = "g1", now: float = T0):
    made = build_grant(spec, POLICY.sandboxes_by_id[registry.get(sandbox).profile].grantable, POLICY.rules_by_id,
                       grant_id=grant_id, sandbox=sandbox, by="test", now=now, wall=WALL,
                       standard_methods=STANDARD_METHODS)
    return registry.apply({"op": "grant", "grant": made.to_op()})


def decide(registry: Registry, host: str, address: str = "10.0.0.5", now: float = T0, port: int = 443):
    engine = Engine.build(POLICY)
    engine.grant_rules = registry.grant_rules
    scope = scope_of(POLICY, ip(address), None, registry, now)
    return engine.check_destination(canonical_host(host), port, scope)


# --- registrations ----------------------------------------------------------------------------------


def test_a_registration_names_its_addresses_and_overrides_the_static_table():
    registry = Registry()
    assert scope_of(POLICY, ip("10.9.0.7"), None, registry, T0).sandbox == "ci"
    register(registry, "s1", ["10.9.0.7"], "agent")
    scope = scope_of(POLICY, ip("10.9.0.7"), None, registry, T0)
    assert (scope.sandbox, scope.profile, scope.rule_ids) == ("s1", "agent", frozenset({"pypi"}))
    assert not decide(registry, "api.internal.example", "10.9.0.7").allowed  # ci's rule, not the profile's
    assert decide(registry, "pypi.org", "10.9.0.7").allowed
    # an IPv4-mapped IPv6 client is its IPv4 address
    assert scope_of(POLICY, ip("::ffff:10.9.0.7"), None, registry, T0).sandbox == "s1"


def test_deregistration_and_ttl_give_the_address_back_to_the_static_table():
    registry = Registry()
    register(registry, "s1", ["10.9.0.7"], ttl=10)
    assert scope_of(POLICY, ip("10.9.0.7"), None, registry, T0 + 9.9).sandbox == "s1"
    # at the deadline the registration no longer decides, even before the timer removed it
    assert scope_of(POLICY, ip("10.9.0.7"), None, registry, T0 + 10).sandbox == "ci"
    assert registry.due(T0 + 9) == []
    ops = registry.due(T0 + 10)
    assert ops == [{"op": "deregister", "id": "s1", "why": "expired"}]
    change = registry.apply(ops[0])
    assert change.removed and change.addresses == {ip("10.9.0.7")} and "TTL ran out" in change.describe()
    assert registry.owner(ip("10.9.0.7")) is None and len(registry) == 0


def test_re_registering_updates_the_addresses_and_keeps_grants_of_the_same_profile():
    registry = Registry()
    register(registry, "s1", ["10.0.0.5", "10.0.0.6"])
    grant(registry, {"rule": "docs"})
    change = register(registry, "s1", ["10.0.0.7"])
    assert change.addresses == {ip("10.0.0.5"), ip("10.0.0.6"), ip("10.0.0.7")}  # all judged again
    assert registry.owner(ip("10.0.0.5")) is None and registry.owner(ip("10.0.0.7")) == "s1"
    assert decide(registry, "docs.python.org", "10.0.0.7").allowed
    change = register(registry, "s1", ["10.0.0.7"], profile="plain")  # another envelope: grants go
    assert change.grants_dropped == 1 and registry.grant_count == 0
    assert not decide(registry, "docs.python.org", "10.0.0.7").allowed


def test_a_stale_deadline_of_an_earlier_registration_does_not_expire_the_new_one():
    registry = Registry()
    register(registry, "s1", ttl=10)
    register(registry, "s1", ttl=100)  # renewed
    assert registry.due(T0 + 50) == []
    assert registry.next_deadline() == T0 + 100


def test_the_deadline_heap_stays_bounded_under_heartbeats():
    registry = Registry()
    for i in range(20_000):
        register(registry, "s1", ttl=100 + i)
    assert len(registry._deadlines) <= 2 * 1 + 1024 + 1


def test_paging_is_in_id_order_and_bounded():
    registry = Registry()
    for i in range(25):
        register(registry, f"s{i:02d}", [f"10.1.0.{i + 1}"])
    page, cursor = registry.page(None, 10)
    assert [r.id for r in page] == [f"s{i:02d}" for i in range(10)] and cursor == "s09"
    page, cursor = registry.page(cursor, 10)
    assert page[0].id == "s10"
    page, cursor = registry.page("s19", 10)
    assert len(page) == 5 and cursor is None


def test_a_snapshot_rebuilds_an_equal_registry():
    registry = Registry()
    register(registry, "s1")
    grant(registry, {"hosts": ["api.github.com"]})
    copy = Registry()
    copy.restore(registry.snapshot())
    assert copy.seq == registry.seq
    assert decide(copy, "api.github.com").allowed and decide(copy, "api.github.com").rule == "grant:g1"


# --- grants -------------------------------------------------------------------------------------------


def test_a_rule_grant_adds_the_rule_until_its_ttl_and_decisions_name_the_grant():
    registry = Registry()
    register(registry)
    assert decide(registry, "docs.python.org").reason == "no_rule"
    grant(registry, {"rule": "docs", "ttl_seconds": 60})
    allowed = decide(registry, "docs.python.org", now=T0 + 59)
    assert allowed.allowed and allowed.rule == "docs" and "by grant g1 of sandbox s1, until" in allowed.message
    assert decide(registry, "docs.python.org", now=T0 + 60).reason == "no_rule"  # exactly at the deadline
    assert registry.due(T0 + 60) == [{"op": "revoke", "sandbox": "s1", "grant": "g1", "why": "expired"}]


def test_a_hosts_grant_becomes_a_transient_rule_checked_like_any_rule():
    registry = Registry()
    register(registry)
    grant(registry, {"hosts": ["*.x.github.com"], "ports": [8443], "methods": ["GET"], "paths": ["/repos/**"]})
    decision = decide(registry, "a.x.github.com", port=8443)
    assert decision.allowed and decision.rule == "grant:g1"
    assert decide(registry, "a.x.github.com", port=443).reason == "port_not_allowed"
    assert decide(registry, "x.github.com", port=8443).reason == "no_rule"  # the wildcard's own domain is not in it
    assert decide(registry, "a.x.github.com", address="10.0.0.99", port=8443).reason == "no_rule"  # not the sandbox
    engine = Engine.build(POLICY)
    engine.grant_rules = registry.grant_rules
    assert engine.rule("grant:g1").methods == {"GET"}  # what body checks look up
    registry.apply({"op": "revoke", "sandbox": "s1", "grant": "g1"})
    assert decide(registry, "a.x.github.com", port=8443).reason == "no_rule"
    assert "grant:g1" not in registry.grant_rules


@pytest.mark.parametrize("spec, reason", [
    ({"rule": "secret-api"}, "outside_envelope"),  # a rule of the policy that is not grantable
    ({"rule": "nope"}, "outside_envelope"),
    ({"hosts": ["*.com"]}, "outside_envelope"),
    ({"hosts": ["github.com"]}, "outside_envelope"),  # *.github.com does not cover github.com
    ({"hosts": ["api.github.com.evil.test"]}, "outside_envelope"),
    ({"hosts": ["api.github.com"], "ports": [22]}, "outside_envelope"),
    ({"hosts": ["api.github.com"], "methods": ["POST"]}, "outside_envelope"),
    ({"hosts": ["api.github.com"], "schemes": ["http"]}, "outside_envelope"),
    ({"rule": "docs", "ttl_seconds": 3600}, "outside_envelope"),  # max_ttl 30m
    ({"rule": "docs", "hosts": ["api.github.com"]}, "bad_grant"),
    ({"hosts": []}, "bad_grant"),
    ({"hosts": ["*"]}, "bad_grant"),
    ({"hosts": ["api.github.com"], "extra": 1}, "bad_grant"),
    ({"rule": "docs", "ttl_seconds": 0}, "bad_grant"),
    ({"rule": "docs", "ttl_seconds": True}, "bad_grant"),
])
def test_grants_outside_the_envelope_or_malformed_are_refused(spec, reason):
    with pytest.raises(GrantError) as refused:
        build_grant(spec, ENVELOPE, POLICY.rules_by_id, grant_id="g", sandbox="s", by="t", now=T0, wall=WALL,
                    standard_methods=STANDARD_METHODS)
    assert refused.value.reason == reason


def test_a_profile_without_grantable_takes_no_grant():
    with pytest.raises(GrantError) as refused:
        build_grant({"rule": "docs"}, POLICY.sandboxes_by_id["plain"].grantable, POLICY.rules_by_id, grant_id="g",
                    sandbox="s", by="t", now=T0, wall=WALL, standard_methods=STANDARD_METHODS)
    assert refused.value.reason == "outside_envelope"


def test_a_grant_the_reloaded_policy_no_longer_allows_is_inert():
    registry = Registry()
    register(registry)
    grant(registry, {"rule": "docs"})
    grant(registry, {"hosts": ["api.github.com"]}, grant_id="g2")
    narrowed = compile_policy("""version: 1
rules:
  - id: pypi
    hosts: [pypi.org]
  - id: docs
    hosts: [docs.python.org]
sandboxes:
  - id: agent
    rules: [pypi]
    grantable: {hosts: ["*.gitlab.com"]}
""", "narrowed")
    engine = Engine.build(narrowed)
    engine.grant_rules = registry.grant_rules
    scope = scope_of(narrowed, ip("10.0.0.5"), None, registry, T0)
    assert scope.rule_ids == {"pypi"} and scope.granted is None
    assert not engine.check_destination(canonical_host("api.github.com"), 443, scope).allowed


# --- properties ------------------------------------------------------------------------------------------

LABEL = st.sampled_from(["a", "b", "x", "github", "com", "org", "example", "api"])
NAMES = st.lists(LABEL, min_size=1, max_size=4).map(".".join)
PATTERNS = st.one_of(NAMES, NAMES.map(lambda n: "*." + n))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(inner=PATTERNS, outer=PATTERNS, host=NAMES)
def test_within_means_every_host_the_inner_pattern_matches_the_outer_one_matches(inner, outer, host):
    a, b, h = parse_host_pattern(inner), parse_host_pattern(outer), canonical_host(host)
    if within(a, b) and a.matches(h):
        assert b.matches(h)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(hosts=st.lists(PATTERNS, min_size=1, max_size=3),
       ports=st.lists(st.sampled_from([22, 80, 443, 8443]), min_size=1, max_size=3),
       methods=st.lists(st.sampled_from(["GET", "HEAD", "POST", "DELETE"]), min_size=1, max_size=3),
       ttl=st.floats(min_value=1, max_value=7200), probe=NAMES, port=st.sampled_from([22, 80, 443, 8443]))
def test_no_grant_ever_widens_past_grantable(hosts, ports, methods, ttl, probe, port):
    try:
        made = build_grant({"hosts": hosts, "ports": ports, "methods": methods, "ttl_seconds": ttl}, ENVELOPE,
                           POLICY.rules_by_id, grant_id="g", sandbox="s1", by="t", now=T0, wall=WALL,
                           standard_methods=STANDARD_METHODS)
    except GrantError as exc:
        # refused: some part is outside (or the TTL is past max_ttl)
        assert exc.reason == "outside_envelope"
        return
    assert envelope_refusal(made, ENVELOPE, POLICY.rules_by_id) is None
    assert made.expires - T0 <= ENVELOPE.max_ttl
    assert made.ports <= ENVELOPE.ports and made.methods <= ENVELOPE.methods
    host = canonical_host(probe)
    if any(h.matches(host) for h in made.hosts):
        assert any(o.matches(host) for o in ENVELOPE.hosts)
    registry = Registry()
    register(registry)
    registry.apply({"op": "grant", "grant": made.to_op()})
    if decide(registry, probe, port=port).allowed:  # whatever it allows, the profile or the envelope does
        assert probe == "pypi.org" or (any(o.matches(host) for o in ENVELOPE.hosts) and port in ENVELOPE.ports)


@settings(max_examples=200)
@given(inner=PATTERNS)
def test_a_host_grant_outside_the_patterns_is_refused(inner):
    pattern = parse_host_pattern(inner)
    inside = any(within(pattern, o) for o in ENVELOPE.hosts)
    try:
        build_grant({"hosts": [inner]}, ENVELOPE, POLICY.rules_by_id, grant_id="g", sandbox="s", by="t", now=T0,
                    wall=WALL, standard_methods=STANDARD_METHODS)
        assert inside
    except GrantError as exc:
        assert not inside and exc.reason == "outside_envelope"


@settings(max_examples=100)
@given(ttls=st.lists(st.floats(min_value=1, max_value=1000), min_size=1, max_size=20),
       at=st.floats(min_value=0, max_value=1100))
def test_ttls_expire_by_the_injected_clock(ttls, at):
    registry = Registry()
    register(registry, ttl=2000)
    for i, ttl in enumerate(ttls):
        grant(registry, {"rule": "docs", "ttl_seconds": min(ttl, 1800)}, grant_id=f"g{i}")
    ops = registry.due(T0 + at)
    expired = {op["grant"] for op in ops}
    assert expired == {f"g{i}" for i, ttl in enumerate(ttls) if T0 + min(ttl, 1800) <= T0 + at}
    for op in ops:
        registry.apply(op)
    live = [t for t in ttls if T0 + min(t, 1800) > T0 + at]
    assert decide(registry, "docs.python.org", now=T0 + at).allowed == bool(live)


# --- the workers' link -----------------------------------------------------------------------------------


def test_ops_that_arrive_with_the_snapshot_are_not_left_in_the_buffer():
    """Review finding (bench): an op sent right after the snapshot came in the same read, stayed in
    the worker's buffer, and was never acknowledged (the socket had nothing more to say)."""
    import json
    import socket

    from gateway.control_fanout import WorkerLink

    ours, theirs = socket.socketpair()
    registry = Registry()
    register(registry)
    op = {"op": "deregister", "id": "s1"}
    ours.sendall(json.dumps({"snapshot": registry.snapshot()}).encode() + b"\n"
                 + json.dumps({"seq": 2, "ops": [op]}).encode() + b"\n")
    link = WorkerLink(theirs.detach())
    copy = Registry()
    copy.restore(link.read_snapshot())
    assert copy.owner(ip("10.0.0.5")) == "s1"
    assert link.read_batches() == [(2, [op])]  # from the buffer, although the socket is empty now
    link.ack(2)
    assert ours.recv(16) == b"2\n"
    ours.close()
    assert link.read_batches() is None  # the supervisor is gone


# --- limits of registered sandboxes ----------------------------------------------------------------------


def test_a_registered_sandbox_takes_its_profiles_limits_per_id_and_its_windows_go_with_it():
    from addons.rate_limits import Limiter, limit_of
    from addons.state import GatewayState

    policy = compile_policy("""version: 1
rules:
  - id: pypi
    hosts: [pypi.org]
    limits: {requests_per_minute: 5}
sandboxes:
  - id: agent
    rules: [pypi]
    limits: {requests_per_minute: 100}
""", "limits")
    state = GatewayState()
    limiter = Limiter(state, clock=lambda: T0)
    state.install(Engine.build(policy))
    for sandbox, address in (("s1", "10.0.0.5"), ("s2", "10.0.0.6")):
        state.apply_registry({"op": "register", "registration": {
            "id": sandbox, "source_ips": [address], "profile": "agent", "expires": T0 + 600,
            "expires_at": WALL + 600, "by": "test"}})
    s1 = scope_of(policy, ip("10.0.0.5"), None, state.registry, T0)
    s2 = scope_of(policy, ip("10.0.0.6"), None, state.registry, T0)
    one = {key: w.limit for key, w, _ in limiter.windows(policy, s1, "pypi", [])}
    two = {key: w.limit for key, w, _ in limiter.windows(policy, s2, "pypi", [])}
    assert one == {("sandbox", "s1", None, None, "requests_per_minute", "agent"): 100,
                   ("rule", "s1", "pypi", None, "requests_per_minute", "agent"): 5}
    assert set(two) == {("sandbox", "s2", None, None, "requests_per_minute", "agent"),
                        ("rule", "s2", "pypi", None, "requests_per_minute", "agent")}  # each id its own windows
    assert all(limit_of(policy, key) == limit for key, limit in one.items())  # a reload keeps them
    state.install(Engine.build(policy))  # a reload: limit_of keeps the windows of registered sandboxes
    assert len(limiter.quotas) == 4
    state.apply_registry({"op": "deregister", "id": "s1"})
    assert set(limiter.quotas.keys()) == set(two)  # s1's windows went with it, s2's stay


def test_a_worker_judges_what_ran_out_at_its_own_deadline_without_the_supervisors_op():
    """Review 24: a worker's timer did nothing; what an expiry ended was closed only when the
    supervisor's op came, and one stalled worker held that op back from the others (6 s late). Now
    a worker's own timer tells its listeners (the revoker) at the deadline; its copy is not changed
    (every decision already ignores what ran out) until the supervisor's op removes it."""
    import time

    from addons.control import ControlApi
    from addons.state import GatewayState

    state = GatewayState()
    api = ControlApi(state)  # no service: a worker's copy
    told = []
    state.registry_listeners.append(told.append)
    now = time.monotonic()
    state.apply_registry({"op": "register", "registration": {
        "id": "s1", "source_ips": ["10.0.0.5"], "profile": "agent", "expires": now - 0.001,
        "expires_at": WALL, "by": "test"}})
    told.clear()
    api._expire()  # (the timer at the deadline)
    assert [(c.op, c.sandbox, c.why, c.removed) for c in told] == [("deregister", "s1", "expired", False)]
    assert told[0].addresses == frozenset({ip("10.0.0.5")})
    assert state.registry.get("s1") is not None  # the supervisor's op removes it
    told.clear()
    api._expire()
    assert told == []  # once


@pytest.mark.parametrize("address", ["fe80::1%eth0", "0.0.0.0", "::", "255.255.255.255", "224.0.0.1", "ff02::1"])
def test_an_address_no_client_connects_from_is_not_registered(address):
    """Review 24: such a registration matched nothing, and its sandbox silently fell back to the
    static table."""
    from gateway.registry import parse_address

    with pytest.raises(ValueError, match="not an address a sandbox connects from"):
        parse_address(address)


# --- sandboxes named by a token --------------------------------------------------------------------------


def decide_as(registry: Registry, identity: Identity, host: str, now: float = T0):
    engine = Engine.build(POLICY)
    engine.grant_rules = registry.grant_rules
    return engine.check_destination(canonical_host(host), 443, scope_of(POLICY, ip("192.0.2.9"), identity,
                                                                        registry, now))


def test_a_registration_without_addresses_gives_its_grants_to_the_token_of_its_id_and_profile():
    registry = Registry()
    register(registry, "pod-7", addresses=(), ttl=3600)
    grant(registry, {"hosts": ["api.github.com"]}, sandbox="pod-7")
    grant(registry, {"rule": "docs"}, sandbox="pod-7", grant_id="g2")
    token = Identity("pod-7", "agent", "token")
    assert decide_as(registry, token, "api.github.com").rule == "grant:g1"
    assert decide_as(registry, token, "docs.python.org").rule == "docs"
    assert decide_as(registry, token, "pypi.org").rule == "pypi"  # the profile's own
    assert registry.owner(ip("192.0.2.9")) is None  # no address is this sandbox
    # another sandbox, the same sandbox under another profile, no token: none of it
    for other in (Identity("pod-8", "agent", "token"), Identity("pod-7", "plain", "token"), None):
        assert not decide_as(registry, other, "api.github.com").allowed
    # at the grants' deadline (max_ttl 30 min), exactly; the token's profile stays
    assert decide_as(registry, token, "docs.python.org", now=T0 + 1799.9).rule == "docs"
    assert not decide_as(registry, token, "docs.python.org", now=T0 + 1800).allowed
    assert decide_as(registry, token, "pypi.org", now=T0 + 1800).rule == "pypi"


def test_a_token_sandboxs_registration_ends_its_grants_at_its_own_deadline():
    registry = Registry()
    register(registry, "pod-7", addresses=(), ttl=60)
    grant(registry, {"rule": "docs"}, sandbox="pod-7")
    token = Identity("pod-7", "agent", "token")
    assert decide_as(registry, token, "docs.python.org", now=T0 + 59.9).rule == "docs"
    assert not decide_as(registry, token, "docs.python.org", now=T0 + 60).allowed
    assert registry.due(T0 + 60)[0] == {"op": "deregister", "id": "pod-7", "why": "expired"}


@given(st.frozensets(st.sampled_from(["pypi", "docs", "secret-api", "x"])) | st.none())
def test_a_narrowed_token_keeps_its_narrowing_and_gains_only_what_was_granted(narrowed):
    registry = Registry()
    register(registry, "pod-7", addresses=())
    grant(registry, {"rule": "docs"}, sandbox="pod-7")
    scope = scope_of(POLICY, None, Identity("pod-7", "agent", "token", narrowed), registry, T0)
    base = frozenset({"pypi"}) if narrowed is None else frozenset({"pypi"}) & narrowed
    assert scope.rule_ids == base | {"docs"}
    assert "secret-api" not in scope.rule_ids
