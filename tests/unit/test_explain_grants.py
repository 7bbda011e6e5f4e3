"""gateway/explain.py given a registered sandbox's Scope (grants in `Scope.granted`): the candidate
listing checks each granted rule alone *with its grant*, lists hosts grants' transient rules where
the engine looks them up, and names the grant behind each; the decision is the engine's own."""

from __future__ import annotations

import ipaddress

import pytest

from gateway.engine import Engine
from gateway.explain import ExplainError, describe_scope, explain, render_dict, render_text
from gateway.grants import build_grant
from gateway.policy import STANDARD_METHODS, compile_policy
from gateway.registry import Registry
from gateway.session import UNCHECKED, decide_request

POLICY = compile_policy("""version: 1
network:
  allow_ip_ranges: [203.0.113.0/24]
resolver:
  static_hosts:
    a.test: [203.0.113.1]
    b.a.test: [203.0.113.2]
rules:
  - id: own
    hosts: [b.a.test]
    methods: [GET]
  - id: docs
    hosts: [a.test]
  - id: ssh
    protocol: tcp
    hosts: [203.0.113.0/24]
    ports: [22]
sandboxes:
  - id: agent
    rules: [own]
    grantable:
      rules: [docs, ssh]
      hosts: ["*.a.test", "a.test"]
      methods: [GET, POST]
""", "grants.yaml")
T0 = 1000.0
WALL = 1_700_000_000.0


def registered(*specs: dict, addresses=("10.0.0.5",)) -> tuple[Registry, Engine]:
    registry = Registry()
    registry.apply({"op": "register", "registration": {"id": "s1", "source_ips": list(addresses), "profile": "agent",
                                                       "expires": T0 + 600, "expires_at": WALL + 600, "by": "t"}})
    for n, spec in enumerate(specs):
        grant = build_grant(spec, POLICY.sandboxes_by_id["agent"].grantable, POLICY.rules_by_id, grant_id=f"g{n}",
                            sandbox="s1", by="t", now=T0, wall=WALL, standard_methods=STANDARD_METHODS)
        registry.apply({"op": "grant", "grant": grant.to_op()})
    engine = Engine.build(POLICY)
    engine.grant_rules = registry.grant_rules
    return registry, engine


def explained(registry: Registry, engine: Engine, url: str, method: str = "GET"):
    scope = registry.scope_of_registration(POLICY, "s1", T0)
    return explain(POLICY, url, method, scope=scope, engine=engine)


def test_a_granted_rule_that_also_matches_says_so_and_names_its_grant():
    registry, engine = registered({"hosts": ["b.a.test"]})
    e = explained(registry, engine, "https://b.a.test/x")
    assert e.decision.rule == "own"  # the profile's rule comes first, as the engine looks them up
    assert [(c.rule, c.outcome) for c in e.candidates] == [("own", "decided"), ("grant:g0", "matches")]
    granted = e.candidates[1]
    assert granted.grant.id == "g0" and granted.why.startswith("also matches (by grant g0 of sandbox s1, until ")
    assert granted.why.endswith(", but rule own comes first")
    # where the profile's rule refuses the method, the grant's rule decides
    e = explained(registry, engine, "https://b.a.test/x", "POST")
    assert (e.decision.rule, [c.outcome for c in e.candidates]) == ("grant:g0", ["no_match", "decided"])
    assert "(by grant g0 of sandbox s1, until " in e.decision.message


def test_a_rule_grant_of_a_tcp_rule_and_a_transient_rule_on_a_tcp_url():
    registry, engine = registered({"rule": "ssh"}, {"hosts": ["a.test"]})
    e = explained(registry, engine, "tcp://203.0.113.1:22")
    assert (e.decision.allowed, e.decision.rule) == (True, "ssh")
    assert [(c.rule, c.outcome, c.grant.id if c.grant else None) for c in e.candidates] == [("ssh", "decided", "g0")]
    e = explain(POLICY, "tcp://a.test:22", scope=registry.scope_of_registration(POLICY, "s1", T0), engine=engine)
    outcomes = {c.rule: (c.outcome, c.grant.id if c.grant else None) for c in e.candidates}
    assert outcomes == {"ssh": ("decided", "g0"), "docs": ("other_protocol", None),
                        "grant:g1": ("other_protocol", "g1")}


def test_the_decision_is_the_engines_and_candidates_agree_with_it():
    """Whatever the request, explain's decision is the engine's for the same scope, and the candidate
    that `decided` is the deciding rule."""
    registry, engine = registered({"hosts": ["*.a.test"], "methods": ["GET"], "paths": ["/ok/**"]}, {"rule": "docs"})
    scope = registry.scope_of_registration(POLICY, "s1", T0)
    for url in ("https://b.a.test/ok/1", "https://b.a.test/no", "https://c.a.test/ok/x", "https://a.test/",
                "https://x.test/", "http://c.a.test/ok/1"):
        for method in ("GET", "POST", "DELETE"):
            e = explain(POLICY, url, method, scope=scope, engine=engine)
            t = e.target
            live = decide_request(engine, scope, t.scheme, t.host, t.port, method, t.target, answer=UNCHECKED)
            assert (e.policy_decision.allowed, e.policy_decision.reason, e.policy_decision.rule) == (
                live.allowed, live.reason, live.rule), (url, method)
            decided = [c.rule for c in e.candidates if c.outcome == "decided"]
            assert decided == ([live.rule] if live.allowed else []), (url, method, e.candidates)


def test_the_scope_text_names_the_profile_and_the_grants_and_the_text_shows_them():
    registry, engine = registered({"rule": "docs"})
    scope = registry.scope_of_registration(POLICY, "s1", T0)
    assert describe_scope(scope) == "sandbox s1 (profile agent, grants g0 until 2023-11-14T23:13:20Z)"  # WALL + max_ttl
    e = explain(POLICY, "https://a.test/", scope=scope, engine=engine)
    assert e.scope_text == describe_scope(scope)
    assert explain(POLICY, "https://a.test/", scope=scope, scope_text="mine", engine=engine).scope_text == "mine"
    text = render_text(e)
    assert text == render_dict(e.as_dict())
    assert "  docs  decided        rule docs allows GET https://a.test:443/ (by grant g0 of sandbox s1, until " in text
    assert e.as_dict()["candidates"][0]["grant"] == {"id": "g0", "sandbox": "s1", "expires_at": WALL + 3600}


NARROWED = """version: 1
network:
  allow_ip_ranges: [203.0.113.0/24]
resolver:
  static_hosts:
    a.test: [203.0.113.1]
rules:
  - id: own
    hosts: [b.a.test]
  - id: docs
    hosts: [a.test]
sandboxes:
  - id: agent
    rules: [own]
"""


def test_a_reload_that_narrows_the_envelope_makes_the_grant_inert_in_explain_too():
    registry, engine = registered({"rule": "docs"})
    narrowed = compile_policy(NARROWED, "n.yaml")  # docs is no longer grantable
    new_engine = Engine.build(narrowed)
    new_engine.grant_rules = registry.grant_rules
    scope = registry.scope_of_registration(narrowed, "s1", T0)
    e = explain(narrowed, "https://a.test/", scope=scope, engine=new_engine)
    assert (e.decision.reason, [c.outcome for c in e.candidates]) == ("no_rule", ["not_granted"])
    assert describe_scope(scope) == "sandbox s1 (profile agent)"


def test_a_scope_and_a_sandbox_together_are_refused():
    registry, engine = registered()
    scope = registry.scope_of_registration(POLICY, "s1", T0)
    with pytest.raises(ExplainError, match="not both"):
        explain(POLICY, "https://a.test/", scope=scope, sandbox="agent")
    with pytest.raises(ExplainError, match="not both"):
        explain(POLICY, "https://a.test/", scope=scope, source_ip=str(ipaddress.ip_address("10.0.0.5")))
