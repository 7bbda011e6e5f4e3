"""Engine.check_destination, check_request and pin (with static_hosts, no DNS)."""

from __future__ import annotations

import asyncio
import ipaddress
import textwrap

import pytest

from gateway.decision import Decision
from gateway.engine import Engine, Pin, RequestFacts
from gateway.hostnames import canonical_host
from gateway.matcher import HostIndex, HostPattern
from gateway.policy import compile_policy
from gateway.resolver import ResolveError, Resolver
from tests.support.pins import pin_of

C = canonical_host
ip = ipaddress.ip_address

POLICY = textwrap.dedent(
    """\
    version: 1
    network:
      allow_ip_ranges: [10.1.0.0/16]
    resolver:
      static_hosts:
        good.test: [8.8.8.8, "2606:4700::1111"]
        mixed.test: [8.8.8.8, 169.254.169.254]
        mapped.test: ["::ffff:169.254.169.254"]
        inside.test: [10.1.2.3]
        listener.test: [10.1.0.5]
        self.test: [8.8.4.4]
        wild.a.test: [1.1.1.1]
    rules:
      - id: http-only
        hosts: [a.test]
        schemes: [http]
      - id: port-8443
        hosts: [a.test]
        ports: [8443]
      - id: get-only
        hosts: [a.test]
        methods: [GET]
      - id: x-paths
        hosts: [a.test]
        methods: [POST]
        paths: [/x/**]
      - id: wildcard
        hosts: ["*.a.test"]
      - id: nets
        hosts: [203.0.113.0/24, "2001:db8::/32", 192.0.2.1]
        ports: [443, 8443]
      - id: everything
        hosts: [all.test, good.test, mixed.test, mapped.test, inside.test, listener.test, self.test]
        schemes: [http, https]
        methods: [GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH, PROPFIND]
    """
)


@pytest.fixture(scope="module")
def policy():
    return compile_policy(POLICY, "engine.yaml")


@pytest.fixture(scope="module")
def engine(policy):
    return Engine.build(policy, self_addresses=[ip("8.8.4.4")], listeners=[(ip("10.1.0.5"), 3128)])


def facts(host: str, port: int = 443, scheme: str = "https", method: str = "GET", target: str = "/") -> RequestFacts:
    return RequestFacts(C(host), port, scheme, method, target)


# --------------------------------------------------------------------------------------------
# check_destination


def test_destination_without_rule(engine):
    assert engine.check_destination(C("b.test"), 443) == Decision(False, "no_rule", "no rule allows b.test:443", None, [])
    # the wildcard never covers its apex's siblings or the apex of another rule
    assert engine.check_destination(C("test"), 443).reason == "no_rule"


def test_destination_port_logic(engine):
    # first candidate (policy order) allowing the port wins
    assert engine.check_destination(C("a.test"), 443) == Decision(True, "allowed", "rule get-only allows a.test:443", "get-only")
    assert engine.check_destination(C("a.test"), 80).rule == "http-only"
    assert engine.check_destination(C("a.test"), 8443).rule == "port-8443"
    denied = engine.check_destination(C("a.test"), 22)
    assert denied == Decision(
        False,
        "port_not_allowed",
        "no rule allows port 22 on a.test",
        "http-only",
        [
            "rule http-only: port 22 not in [80] (scheme defaults)",
            "rule port-8443: port 22 not in [8443]",
            "rule get-only: port 22 not in [443] (scheme defaults)",
            "rule x-paths: port 22 not in [443] (scheme defaults)",
        ],
    )
    assert denied.status == 403


def test_destination_wildcards_and_networks(engine):
    assert engine.check_destination(C("b.a.test"), 443).rule == "wildcard"
    assert engine.check_destination(C("c.b.a.test"), 443).rule == "wildcard"
    assert engine.check_destination(C("b.a.test"), 80).reason == "port_not_allowed"
    assert engine.check_destination(C("203.0.113.9"), 8443).rule == "nets"
    assert engine.check_destination(C("[2001:db8::9]"), 443).rule == "nets"
    assert engine.check_destination(C("192.0.2.1"), 443).rule == "nets"
    assert engine.check_destination(C("0xc0.0.2.1"), 443).rule == "nets"
    assert engine.check_destination(C("192.0.2.2"), 443).reason == "no_rule"
    assert engine.check_destination(C("203.0.114.1"), 443).reason == "no_rule"
    assert engine.check_destination(C("all.test"), 80).rule == "everything"
    assert engine.check_destination(C("all.test"), 443).rule == "everything"
    assert engine.check_destination(C("all.test"), 8080).reason == "port_not_allowed"
    assert engine.check_destination(C("[2001:db8::9]"), 80).notes == ["rule nets: port 80 not in [443, 8443]"]


# --------------------------------------------------------------------------------------------
# check_request


def test_request_allowed_by_first_matching_rule(engine):
    assert engine.check_request(facts("a.test", method="GET", target="/y?q=1")) == Decision(
        True, "allowed", "rule get-only allows GET https://a.test:443/y", "get-only"
    )
    assert engine.check_request(facts("a.test", 80, "http", "DELETE", "/")).rule == "http-only"
    assert engine.check_request(facts("a.test", 8443, "https", "PUT", "/")).rule == "port-8443"
    assert engine.check_request(facts("a.test", method="POST", target="/x/1/2")).rule == "x-paths"
    assert engine.check_request(facts("a.test", method="POST", target="/x")).rule == "x-paths"
    assert engine.check_request(facts("a.test", method="POST", target="/x/../x/ok")).rule == "x-paths"


def test_request_picks_the_furthest_failing_reason(engine):
    decision = engine.check_request(facts("a.test", method="POST", target="/y"))
    assert decision == Decision(
        False,
        "path_not_allowed",
        "no rule allows POST https://a.test:443/y (path not allowed)",
        "x-paths",
        [
            "rule http-only: scheme https not in [http]",
            "rule port-8443: port 443 not in [8443]",
            "rule get-only: method POST not in [GET]",
            "rule x-paths: path /y matches none of [/x/**]",
        ],
    )
    # path normalisation decides the match: /x/../y is /y
    assert engine.check_request(facts("a.test", method="POST", target="/x/../y")).reason == "path_not_allowed"
    assert engine.check_request(facts("a.test", method="POST", target="/x%2f..%2fy")).reason == "path_not_allowed"


def test_request_method_stage(engine):
    decision = engine.check_request(facts("a.test", method="PATCH"))
    assert decision.reason == "method_not_allowed"
    assert decision.rule == "get-only"
    assert decision.notes[2:] == ["rule get-only: method PATCH not in [GET]", "rule x-paths: method PATCH not in [POST]"]
    assert decision.message == "no rule allows PATCH https://a.test:443/ (method not allowed)"
    default_methods = engine.check_request(facts("b.a.test", method="PROPFIND"))
    assert default_methods.reason == "method_not_allowed"
    assert default_methods.notes == ["rule wildcard: method PROPFIND not in [standard methods]"]


def test_request_port_stage(engine):
    decision = engine.check_request(facts("a.test", 9000, "https"))
    assert decision.reason == "port_not_allowed"
    assert decision.rule == "port-8443"
    assert decision.notes[0] == "rule http-only: scheme https not in [http]"
    assert decision.notes[1] == "rule port-8443: port 9000 not in [8443]"


def test_request_scheme_stage(engine):
    decision = engine.check_request(facts("b.a.test", 80, "http"))
    assert decision.reason == "scheme_not_allowed"
    assert decision.rule == "wildcard"
    assert decision.notes == ["rule wildcard: scheme http not in [https]"]
    # http on the default https port for a rule with explicit ports: the scheme is checked first
    assert engine.check_request(facts("203.0.113.1", 443, "http")).reason == "scheme_not_allowed"


def test_scheme_default_port_is_per_scheme(engine):
    # an https rule with no ports allows 443 for https but not for http, and vice versa
    assert engine.check_request(facts("all.test", 443, "https")).allowed
    assert engine.check_request(facts("all.test", 80, "http")).allowed
    assert engine.check_request(facts("all.test", 443, "http")).reason == "port_not_allowed"
    assert engine.check_request(facts("all.test", 80, "https")).reason == "port_not_allowed"


def test_ties_report_the_first_rule_at_that_stage(engine):
    # get-only and x-paths both fail at the method stage for OPTIONS
    decision = engine.check_request(facts("a.test", method="OPTIONS"))
    assert decision.reason == "method_not_allowed"
    assert decision.rule == "get-only"  # the first of them is reported


@pytest.mark.parametrize("method", ["TRACE", "TRACK", "CONNECT", "trace", "Track"])
def test_forbidden_methods(engine, method):
    decision = engine.check_request(facts("all.test", method=method))
    assert decision == Decision(False, "method_forbidden", f"{method.upper()} is always refused", None, [])
    # even for hosts with no rule: method_forbidden is decided first
    assert engine.check_request(facts("nothing.test", method=method)).reason == "method_forbidden"


@pytest.mark.parametrize("target", ["/..", "/a/../..", "/%2e%2e/x", "/a%00", "/%ff", "relative", "/a\udcff", "/%41\udcff"])
def test_bad_path(engine, target):
    decision = engine.check_request(facts("all.test", target=target))
    assert decision.allowed is False
    assert decision.reason == "bad_path"
    assert decision.message.startswith("bad request path: ")
    assert decision.status == 400


def test_request_without_rule(engine):
    assert engine.check_request(facts("b.test", target="/q")) == Decision(
        False, "no_rule", "no rule allows https://b.test:443", None, []
    )


def test_request_ipv6_where(engine):
    decision = engine.check_request(facts("[2001:db8::9]", 443, "https", "GET", "/p"))
    assert decision == Decision(True, "allowed", "rule nets allows GET https://[2001:db8::9]:443/p", "nets")


def test_lower_case_method_is_upper_cased(engine):
    assert engine.check_request(facts("a.test", method="get")).rule == "get-only"


# --------------------------------------------------------------------------------------------
# pin


def pin(engine: Engine, host: str, port: int = 443):
    return pin_of(engine, C(host), port)


def test_pin_static_host_all_addresses_checked(engine):
    decision, result = pin(engine, "good.test")
    assert decision.allowed is True
    assert result == Pin(C("good.test"), 443, ip("8.8.8.8"), (ip("8.8.8.8"), ip("2606:4700::1111")))
    assert result.sni == "good.test"


def test_pin_one_denied_address_denies_the_whole_pin(engine):
    decision, result = pin(engine, "mixed.test")
    assert result is None
    assert decision == Decision(
        False,
        "denied_address",
        "mixed.test resolves to 169.254.169.254: in deny range 169.254.0.0/16 (link-local / cloud metadata)",
        None,
        ["8.8.8.8: not in any deny range", "169.254.169.254: in deny range 169.254.0.0/16 (link-local / cloud metadata)"],
    )
    assert decision.status == 403


def test_pin_mapped_metadata_address_denied(engine):
    decision, result = pin(engine, "mapped.test")
    assert result is None
    assert decision.reason == "denied_address"
    assert "(embeds 169.254.169.254)" in decision.message


def test_pin_allow_ranges_exempt(engine):
    decision, result = pin(engine, "inside.test")
    assert decision.allowed is True
    assert result.address == ip("10.1.2.3")


def test_pin_listener_is_self_address(engine):
    decision, result = pin(engine, "listener.test", 3128)
    assert result is None
    assert decision.reason == "self_address"
    assert decision.message == "listener.test resolves to 10.1.0.5: is the gateway's own listener"
    # the same address on another port is allowed (10.1/16 is exempted)
    decision, result = pin(engine, "listener.test", 443)
    assert decision.allowed is True
    assert result.address == ip("10.1.0.5")


def test_pin_self_address(engine):
    decision, result = pin(engine, "self.test")
    assert result is None
    assert decision.reason == "self_address"
    assert decision.notes == ["8.8.4.4: is an address of the gateway itself"]


def test_pin_ip_literal_needs_no_resolution(engine):
    decision, result = pin(engine, "203.0.113.5")
    assert result is None
    assert decision.reason == "denied_address"  # TEST-NET-3 is in the default deny list
    decision, result = pin(engine, "[2606:4700::1111]")
    assert decision.allowed is True
    assert result == Pin(C("[2606:4700::1111]"), 443, ip("2606:4700::1111"), (ip("2606:4700::1111"),))
    assert result.sni is None


def test_pin_resolve_failure(policy):
    class Failing(Resolver):
        async def resolve(self, host):
            raise ResolveError(f"cannot resolve {host.value}: nope")

    engine = Engine.build(policy, resolver=Failing())
    decision, result = pin_of(engine, C("nowhere.test"), 443)
    assert result is None
    assert decision == Decision(False, "resolve_failed", "cannot resolve nowhere.test: nope", None, [])
    assert decision.status == 502


def test_resolver_static_hosts_first():
    resolver = Resolver({"static.test": (ip("192.0.2.10"),)})
    assert asyncio.run(resolver.resolve(C("static.test"))) == (ip("192.0.2.10"),)
    assert asyncio.run(resolver.resolve(C("[::1]"))) == (ip("::1"),)


def test_engine_build_uses_policy_static_hosts(policy):
    engine = Engine.build(policy)
    assert engine.resolver.static_hosts == policy.static_hosts
    assert engine.guard.self_addresses == frozenset()
    assert engine.guard.listeners == frozenset()


# --------------------------------------------------------------------------------------------
# a large policy


def test_engine_with_100k_rules():
    from gateway.policy import Policy, Rule
    from gateway.addresses import RangeTable, default_deny_table
    from gateway.yamlsource import Location

    rules = []
    for i in range(100_000):
        rules.append(
            Rule(f"r{i}", i, (HostPattern("exact", f"h{i}.example.com"),), frozenset({"https"}), None, None, None, None,
                 Location("big", i + 1, 1))
        )
    small = compile_policy(POLICY, "p")
    base = len(rules)
    for rule in small.rules:
        rules.append(Rule(rule.id, base + rule.index, rule.hosts, rule.schemes, rule.ports, rule.methods,
                          rule.path_globs, rule.path_patterns, rule.location))
    index = HostIndex.build((p, r.index) for r in rules for p in r.hosts)
    big = Policy(tuple(rules), index, default_deny_table(), RangeTable(), {}, "big", "0" * 64)
    engine = Engine.build(big)
    assert engine.check_destination(C("h77777.example.com"), 443).rule == "r77777"
    assert engine.check_request(facts("h99999.example.com", target="/x")).rule == "r99999"
    assert engine.check_request(facts("a.test", method="POST", target="/x/1")).rule == "x-paths"
    assert engine.check_destination(C("h100000.example.com"), 443).reason == "no_rule"


def test_request_facts_keep_no_instance_dict_and_find_their_overrides_once():
    """The facts live in the flow for as long as its response streams (issue 18): slots, and the
    overrides found at the first ask are the ones every later ask gets; equal facts stay equal."""
    facts = RequestFacts(canonical_host("a.example"), 443, "https", "POST", "/x?_method=DELETE",
                         (("X-HTTP-Method-Override", "PUT"),))
    assert not hasattr(facts, "__dict__")
    first = facts.overrides
    assert {o.name for o in first} == {"_method", "X-HTTP-Method-Override"} and facts.overrides is first
    twin = RequestFacts(canonical_host("a.example"), 443, "https", "POST", "/x?_method=DELETE",
                        (("X-HTTP-Method-Override", "PUT"),))
    assert twin == facts and hash(twin) == hash(facts)
    with pytest.raises(AttributeError):
        facts.method = "GET"
