"""Core pieces of transparent mode: sandbox scopes, raw TCP rules, DNS answers, DNS memory."""

import asyncio
import ipaddress

import pytest

from gateway.dnsmemory import DnsMemory
from gateway.engine import Engine, RequestFacts
from gateway.hostnames import canonical_host
from gateway.policy import PolicyError, compile_policy

POLICY = """\
version: 1
network:
  allow_ip_ranges: [10.1.2.0/24]
resolver:
  static_hosts:
    a.test: [93.184.216.34, "2606:4700::1"]
    b.test: [93.184.216.35]
    private.test: [10.9.9.9]
    git.test: [93.184.216.36]
sandboxes:
  - id: ci
    source_ips: [10.8.0.0/16]
    rules: [a, ssh]
  - id: narrow
    source_ips: [10.8.1.0/24]
    rules: [b]
  - id: default
    rules: [b]
rules:
  - id: a
    hosts: [a.test, private.test]
  - id: b
    hosts: [b.test]
  - id: ssh
    protocol: tcp
    hosts: [10.1.2.3, git.test, 192.0.2.0/24]
    ports: [22]
"""


def ip(text):
    return ipaddress.ip_address(text)


@pytest.fixture
def engine():
    return Engine.build(compile_policy(POLICY, "p.yaml"))


def test_scope_by_source_address_most_specific_wins(engine):
    policy = engine.policy
    assert policy.scope_for(ip("10.8.0.7")).sandbox == "ci"
    assert policy.scope_for(ip("10.8.1.7")).sandbox == "narrow"
    assert policy.scope_for(ip("::ffff:10.8.1.7")).sandbox == "narrow"
    assert policy.scope_for(ip("192.168.5.5")).sandbox == "default"
    assert policy.scope_for(sandbox_id="ci").rule_ids == frozenset({"a", "ssh"})


def test_without_default_sandbox_unknown_clients_get_nothing():
    text = POLICY.replace("  - id: default\n    rules: [b]\n", "")
    policy = compile_policy(text, "p.yaml")
    scope = policy.scope_for(ip("192.168.5.5"))
    assert scope.rule_ids == frozenset()
    e = Engine.build(policy)
    decision = e.check_destination(canonical_host("b.test"), 443, scope)
    assert not decision.allowed and decision.reason == "no_rule"
    assert any("not granted" in n for n in decision.notes)


def test_without_sandboxes_section_every_rule_applies():
    policy = compile_policy("version: 1\nrules:\n  - id: x\n    hosts: [x.test]\n", "p.yaml")
    assert policy.scope_for(ip("1.2.3.4")).rule_ids is None


def test_request_checked_against_the_sandbox_rules(engine):
    ci = engine.policy.scope_for(sandbox_id="ci")
    narrow = engine.policy.scope_for(sandbox_id="narrow")
    facts_a = RequestFacts(canonical_host("a.test"), 443, "https", "GET", "/")
    assert engine.check_request(facts_a, ci).allowed
    denied = engine.check_request(facts_a, narrow)
    assert not denied.allowed and denied.reason == "no_rule" and "sandbox narrow" in denied.message


def test_tcp_rule_by_address_cidr_and_dns_answered_name(engine):
    ci = engine.policy.scope_for(sandbox_id="ci")
    assert engine.check_tcp(ip("10.1.2.3"), 22, (), ci).rule == "ssh"
    assert engine.check_tcp(ip("192.0.2.77"), 22, (), ci).allowed
    assert engine.check_tcp(ip("93.184.216.36"), 22, (), ci).reason == "no_rule"  # name not answered
    assert engine.check_tcp(ip("93.184.216.36"), 22, {"git.test"}, ci).allowed
    assert engine.check_tcp(ip("10.1.2.3"), 2222, (), ci).reason == "port_not_allowed"
    narrow = engine.policy.scope_for(sandbox_id="narrow")
    assert engine.check_tcp(ip("10.1.2.3"), 22, (), narrow).reason == "no_rule"


def test_http_rules_do_not_allow_raw_tcp_and_tcp_rules_do_not_allow_http(engine):
    ci = engine.policy.scope_for(sandbox_id="ci")
    assert not engine.check_tcp(ip("93.184.216.34"), 443, {"a.test"}, ci).allowed
    assert not engine.check_destination(canonical_host("10.1.2.3"), 22, ci).allowed


def answer(engine, name, qtype, sandbox="ci"):
    return asyncio.run(engine.answer_dns(name, qtype, engine.policy.scope_for(sandbox_id=sandbox)))


def test_dns_answers_only_covered_names_with_checked_addresses(engine):
    a = answer(engine, "A.Test.", "A")
    assert a.rcode == "NOERROR" and a.addresses == (ip("93.184.216.34"),) and a.decision.rule == "a"
    aaaa = answer(engine, "a.test", "AAAA")
    assert aaaa.addresses == (ip("2606:4700::1"),)
    assert answer(engine, "secret.attacker.example", "A").rcode == "NXDOMAIN"
    assert answer(engine, "b.test", "A").rcode == "NXDOMAIN"  # rule b is not granted to ci
    assert answer(engine, "b.test", "A", "narrow").rcode == "NOERROR"
    private = answer(engine, "private.test", "A")
    assert private.rcode == "NXDOMAIN" and private.decision.reason == "denied_address"
    assert answer(engine, "a.test", "TXT").rcode == "REFUSED"
    https = answer(engine, "a.test", "HTTPS")
    assert https.rcode == "NOERROR" and https.addresses == ()
    assert answer(engine, "bad_name%00.test", "A").rcode == "NXDOMAIN"


def test_uncovered_names_are_never_resolved(engine):
    calls = []

    async def spy(host, version=None):
        calls.append(host.value)
        return ()

    engine.resolver.resolve = spy
    assert answer(engine, "exfil-4142.attacker.example", "A").rcode == "NXDOMAIN"
    assert answer(engine, "exfil-4142.attacker.example", "TXT").rcode == "NXDOMAIN"
    assert calls == []


def test_dns_memory_expires_and_is_bounded():
    now = [0.0]
    memory = DnsMemory(ttl=10, max_entries=2, clock=lambda: now[0])
    client = ip("10.8.0.2")
    memory.remember(client, "git.test", [ip("93.184.216.36")])
    assert memory.names_for(client, ip("93.184.216.36")) == {"git.test"}
    assert memory.names_for(ip("10.8.0.3"), ip("93.184.216.36")) == set()  # per client
    now[0] = 11
    assert memory.names_for(client, ip("93.184.216.36")) == set()
    memory.remember(client, "a", [ip("1.1.1.1")])
    memory.remember(client, "b", [ip("1.1.1.2")])
    memory.remember(client, "c", [ip("1.1.1.3")])
    assert memory.names_for(client, ip("1.1.1.1")) == set()  # evicted, least recently used
    assert memory.names_for(client, ip("1.1.1.3")) == {"c"}


@pytest.mark.parametrize(
    "snippet, expected",
    [
        ("rules:\n  - id: t\n    protocol: tcp\n    hosts: [1.2.3.4]\n", "rules[0]: a protocol: tcp rule needs ports"),
        ("rules:\n  - id: t\n    protocol: tcp\n    hosts: [1.2.3.4]\n    ports: [22]\n    paths: [/x]\n",
         "rules[0].paths: a protocol: tcp rule cannot restrict paths"),
        ("rules:\n  - id: t\n    protocol: udp\n    hosts: [1.2.3.4]\n", "rules[0].protocol: 'udp'"),
        ("rules:\n  - id: t\n    protocol: tcp\n    hosts: ['*.x.test']\n    ports: [22]\n", "wildcards are not allowed"),
        ("sandboxes:\n  - id: s\n    source_ips: [10.0.0.0/8]\n    rules: [nope]\nrules: []\n", "sandboxes[0].rules[0]: 'nope': no rule has this id"),
        ("sandboxes:\n  - id: s\n    source_ips: []\n    rules: [nope]\nrules: []\n", "sandboxes[0].rules[0]: 'nope'"),
        ("sandboxes:\n  - id: s\n    source_ips: [10.0.0.0/8]\n    rules: []\n  - id: s\n    source_ips: [11.0.0.0/8]\n    rules: []\nrules: []\n",
         "duplicate sandbox id 's'"),
        ("sandboxes:\n  - id: s\n    source_ips: [10.0.0.0/8]\n    rules: []\n  - id: t\n    source_ips: [10.0.0.0/8]\n    rules: []\nrules: []\n",
         "already claimed by sandbox 's'"),
        ("network:\n  strict_original_destination: yes please\nrules: []\n", "network.strict_original_destination: must be true or false"),
    ],
)
def test_policy_errors_for_transparent_keys(snippet, expected):
    with pytest.raises(PolicyError) as info:
        compile_policy("version: 1\n" + snippet, "t.yaml")
    assert expected in str(info.value)
    assert "t.yaml:" in str(info.value)
