"""addons/revocation.Revoker without a proxy: the registry (GatewayState.connections), what a sweep
judges and closes, fail-closed, connections decided during a reload, and the audit line's shape.
The closer is a recording stand-in; the end-to-end tests close real sockets."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from addons import revocation as revocation_addon
from addons.revocation import Revoker
from addons.state import GatewayState
from gateway.decision import Decision
from gateway.engine import Engine
from gateway.policy import compile_policy
from gateway.revocation import Established
from gateway.session import Step
from tests.support.pins import pin_of

POLICY = """\
version: 1
resolver:
  static_hosts:
    a.test: [93.184.216.34]
    b.test: [93.184.216.35]
rules:
{rules}
"""
A = "  - id: a\n    hosts: [a.test]\n"
B = "  - id: b\n    hosts: [b.test]\n"


def engine(rules: str) -> Engine:
    return Engine.build(compile_policy(POLICY.format(rules=rules), "t.yaml"))


class World:
    def __init__(self, rules: str = A + B):
        self.state = GatewayState()
        self.lines: list[dict] = []
        self.state.decision_listeners.append(self.lines.append)
        self.closed: list[str] = []
        self.revoker = Revoker(self.state, closer=lambda cid: self.closed.append(cid) or True)
        self.state.install(engine(rules))

    def open(self, client_id: str, host: str, kind: str = "tunnel", rule: str = "a"):
        conn = self.state.connection(client_id, ("10.0.0.9", 40000 + len(self.state.connections)))
        current = self.state.engine
        _, pin = pin_of(current, host)
        conn.commit(Step(Decision.allow(rule, "test"), pin))
        conn.admit(pin.address.compressed, 443, host)
        self.state.establish(client_id, conn, Established(kind, pin, rule, conn.address, current.generation))
        return conn

    def revoked(self) -> list[dict]:
        return [e for e in self.lines if e.get("reason") == "revoked"]


def test_a_sweep_closes_only_what_the_new_engine_refuses():
    world = World()
    a = world.open("c-a", "a.test", rule="a")
    b = world.open("c-b", "b.test", rule="b")
    world.state.install(engine(B))
    assert world.closed == ["c-a"]
    [line] = world.revoked()
    assert (line["event"], line["decision"], line["reason"], line["status"], line["rule"], line["cause"],
            line["kind"], line["host"], line["port"], line["client"]) == (
        "connection", "deny", "revoked", None, "a", "no_rule", "tunnel", "a.test", 443, a.client)
    assert a.poisoned is not None and a.poisoned.reason == "revoked" and a.admitted == {} and a.established == []
    assert b.poisoned is None and b.established[0].generation == world.state.engine.generation


def test_a_reload_that_still_allows_everything_closes_nothing_and_says_nothing():
    world = World()
    world.open("c-a", "a.test")
    world.state.install(engine(A + B + "  - id: c\n    hosts: [c.test]\n"))
    world.state.install(world.state.engine)  # the same engine again (an option changed): no sweep
    assert world.closed == [] and world.revoked() == []


def test_the_registry_is_the_open_connections_and_forgets_a_closed_one():
    world = World()
    world.open("c-a", "a.test")
    world.state.forget("c-a")  # client_disconnected
    world.state.install(engine(B))
    assert world.closed == [] and world.state.connections == {}


def test_fail_closed_when_judging_raises(monkeypatch):
    world = World()
    world.open("c-a", "a.test")

    def broken(engine, established):
        raise RuntimeError("boom")

    monkeypatch.setattr(revocation_addon, "rejudge", broken)
    world.state.install(engine(A + B))  # still allowed, but the judgement failed
    assert world.closed == ["c-a"]
    [line] = world.revoked()
    assert (line["decision"], line["cause"], line["rule"]) == ("deny", "internal_error", "a")


def test_a_connection_decided_under_a_replaced_engine_is_judged_at_once():
    """A CONNECT that awaited DNS while a reload happened: established with the old generation."""
    world = World()
    old = world.state.engine
    world.state.install(engine(B))
    conn = world.state.connection("late", ("10.0.0.9", 50000))
    _, pin = pin_of(old, "a.test")
    world.state.establish("late", conn, Established("tunnel", pin, "a", conn.address, old.generation))
    assert world.closed == ["late"] and conn.poisoned is not None
    # decided under the current engine: not judged twice
    ok = world.state.connection("fresh", ("10.0.0.9", 50001))
    _, pin_b = pin_of(world.state.engine, "b.test")
    world.state.establish("fresh", ok, Established("tunnel", pin_b, "b", ok.address, world.state.engine.generation))
    assert world.closed == ["late"]


def test_report_mode_keeps_it_open_with_one_would_deny_line_per_connection():
    world = World()
    conn = world.open("c-a", "a.test")
    facts_pin = conn.tunnel
    from gateway.engine import RequestFacts

    facts = RequestFacts(facts_pin.host, 443, "https", "GET", "/ws")
    world.state.establish("c-a", conn, Established("websocket", facts_pin, "a", conn.address,
                                                   world.state.engine.generation, request=facts))
    world.state.install(engine(B).__class__.build(compile_policy(
        POLICY.format(rules=B).replace("rules:", "mode: report\nrules:"), "t.yaml")))
    assert world.closed == []
    [line] = world.revoked()
    assert (line["decision"], line["kind"], line["cause"], line["path"], line["method"]) == (
        "would_deny", "websocket", "no_rule", "/ws", "GET")


def test_a_poisoned_connection_is_not_judged_again():
    world = World()
    conn = world.open("c-a", "a.test")
    conn.poison(Decision.deny("sni_mismatch", "x"))
    world.state.install(engine(B))
    assert world.closed == [] and conn.established == []


def test_close_client_without_a_proxy_says_so():
    assert revocation_addon.close_client("nobody") is False


@pytest.mark.parametrize("kind", ["tunnel", "passthrough", "http"])
def test_every_kind_names_itself_in_the_line(kind):
    world = World()
    world.open("c", "a.test", kind=kind)
    world.state.install(engine(B))
    assert world.revoked()[0]["kind"] == kind


def test_an_audit_line_that_cannot_be_written_still_closes_and_the_sweep_goes_on(monkeypatch):
    """Review finding: the revocation's line raised (a full disk) and the connection stayed open, and
    so did every connection after it in the sweep."""
    world = World()
    world.open("c1", "a.test")
    world.open("c2", "a.test")

    write = world.state.audit.record

    def full_disk(**fields):
        if fields.get("event") == "connection":
            raise OSError(28, "No space left on device")
        return write(**fields)

    monkeypatch.setattr(world.state.audit, "record", full_disk)
    world.state.install(engine(B))
    assert sorted(world.closed) == ["c1", "c2"]


def test_a_reload_whose_line_cannot_be_written_is_still_installed(tmp_path, monkeypatch):
    """Review finding: the reload line was written before the install, and a failing write lost the
    reload for good (the poller had taken the file's new identity)."""
    from addons.reload import PolicyReloader

    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY.format(rules=A + B))
    world = World()

    class Options:
        egress_policy = str(policy)

    monkeypatch.setattr("addons.reload.ctx", type("Ctx", (), {"options": Options()}))
    reloader = PolicyReloader(world.state, Engine.build)
    policy.write_text(POLICY.format(rules=B))

    write = world.state.audit.record

    def full_disk(**fields):
        if fields.get("event") == "policy_reload":
            raise OSError(28, "No space left on device")
        return write(**fields)

    monkeypatch.setattr(world.state.audit, "record", full_disk)
    with pytest.raises(OSError):
        asyncio.run(reloader.reload_now())
    assert [r.id for r in world.state.engine.policy.rules] == ["b"]


class _Flow:
    """What the Revoker reads of a flow: its connection, id, liveness, metadata, and timestamps."""

    def __init__(self, client_id: str, flow_id: str, facts, pin, decision, generation: int):
        self.client_conn = type("Client", (), {"id": client_id})()
        self.id = flow_id
        self.live = True
        self.response = None
        self.request = type("Request", (), {"timestamp_end": None})()
        self.metadata = {revocation_addon.FACTS: facts, "egress_pin": pin, "egress_decision": decision,
                         revocation_addon.GENERATION: generation}


def test_a_stream_that_died_without_a_hook_is_forgotten_and_never_revoked():
    """Review finding: an HTTP/2 stream reset after its answer fires no hook; its entry stayed,
    grew with every such stream, and a later reload closed the connection for it."""
    from gateway.engine import RequestFacts

    world = World()
    conn = world.open("c1", "a.test")
    current = world.state.engine
    allowed = current.check_request(RequestFacts(conn.tunnel.host, 443, "https", "POST", "/upload"))
    flows = []
    for i in range(50):
        facts = RequestFacts(conn.tunnel.host, 443, "https", "POST", "/upload")
        flow = _Flow("c1", f"f{i}", facts, conn.tunnel, allowed, current.generation)
        world.revoker.requestheaders(flow)
        flow.live = False  # reset: mitmproxy drops the stream, no request/response/error hook
        flows.append(flow)
    assert sum(e.kind == "request" for e in conn.established) <= 1  # pruned at each new request
    world.state.install(engine(A.replace("hosts: [a.test]", "hosts: [a.test]\n    methods: [GET]") + B))
    assert world.closed == [] and world.revoked() == []


SANDBOXED = POLICY.format(rules=A + B) + """\
sandboxes:
  - id: default
    rules: []
  - id: agent
    rules: [b]
    grantable:
      rules: [a]
"""


@pytest.mark.parametrize("change", ["revoke", "deregister"])
def test_a_connection_decided_while_the_registry_changed_is_judged_at_once(change):
    """Review 26: a CONNECT awaiting DNS while its grant was revoked (or its sandbox deregistered)
    was established after the revocation had judged the sandbox's connections, and never again:
    29 of 30 tunnels outlived the revoke. The registry's op count at the decision says it moved."""
    world = World()
    world.state.install(Engine.build(compile_policy(SANDBOXED, "t.yaml")))
    world.state.apply_registry({"op": "register", "registration": {
        "id": "task-1", "source_ips": ["10.0.0.9"], "profile": "agent", "expires": 1e12, "expires_at": 1e12,
        "by": "test"}})
    world.state.apply_registry({"op": "grant", "grant": {
        "id": "g1", "sandbox": "task-1", "rule": "a", "expires": 1e12, "expires_at": 1e12, "by": "test"}})
    conn = world.state.connection("late", ("10.0.0.9", 50000))
    assert world.state.scope(conn).grants(world.state.engine.policy.rules_by_id["a"])
    decided_at = world.state.registry.seq  # the guard takes the scope, then awaits DNS ...
    if change == "revoke":
        world.state.apply_registry({"op": "revoke", "sandbox": "task-1", "grant": "g1"})
    else:
        world.state.apply_registry({"op": "deregister", "id": "task-1"})
    assert world.closed == []  # nothing was established yet: the revocation found nothing to close
    _, pin = pin_of(world.state.engine, "a.test")
    world.state.establish("late", conn, Established("tunnel", pin, "a", conn.address, world.state.engine.generation),
                          decided_at)
    assert world.closed == ["late"] and conn.poisoned is not None
    # decided after the change, under the registry as it is now: not judged again
    ok = world.state.connection("fresh", ("10.0.0.9", 50001))
    _, pin_b = pin_of(world.state.engine, "b.test")
    established = Established("tunnel", pin_b, "b", ok.address, world.state.engine.generation)
    if change == "revoke":
        world.state.establish("fresh", ok, established, world.state.registry.seq)
        assert world.closed == ["late"] and ok.poisoned is None


def test_a_token_sandboxs_rate_windows_outlive_its_registration_an_address_ones_do_not():
    """Review 26: deregistering (or the TTL of) a registration without addresses reset the quotas
    of the sandbox its token still names; it closed its connections around the TTL to get them."""
    from addons.rate_limits import Limiter
    from gateway.registry import Change

    state = GatewayState()
    limiter = Limiter(state)
    for sandbox in ("pod-7", "task-1"):
        limiter.quotas.window(("sandbox", sandbox, None, None, "requests_per_minute", "agent"), 10, 60.0)
    limiter._on_registry_change(Change("deregister", "pod-7", frozenset(), removed=True))
    limiter._on_registry_change(Change("deregister", "task-1", frozenset({ipaddress.ip_address("10.0.0.9")}),
                                       removed=True))
    assert len(limiter.quotas) == 1  # pod-7's (named by its token) stays; task-1's (by address) goes
