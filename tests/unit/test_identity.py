"""gateway/identity.py: a connection's rules come from its identity's profile, narrowed, never
widened; without an identity, from its source address, as before."""

from __future__ import annotations

import ipaddress
import textwrap

from hypothesis import given
from hypothesis import strategies as st

from gateway.identity import Identity, scope_of
from gateway.policy import compile_policy

POLICY = compile_policy(textwrap.dedent(
    """\
    version: 1
    rules:
      - {id: a, hosts: [a.test]}
      - {id: b, hosts: [b.test]}
      - {id: c, hosts: [c.test]}
    sandboxes:
      - id: ci
        source_ips: [10.8.0.0/16]
        rules: [a, b]
        limits: {requests_per_minute: 10}
      - id: agent
        rules: [b]
      - id: default
        rules: [c]
    """), "identity.yaml")


def test_without_an_identity_the_source_address_names_the_sandbox():
    scope = scope_of(POLICY, ipaddress.ip_address("10.8.1.1"))
    assert (scope.sandbox, scope.rule_ids, scope.profile) == ("ci", frozenset({"a", "b"}), "ci")
    assert scope_of(POLICY, ipaddress.ip_address("192.0.2.1")).sandbox == "default"


def test_an_identity_names_the_sandbox_and_takes_its_profiles_rules_and_limits():
    scope = scope_of(POLICY, ipaddress.ip_address("192.0.2.1"), Identity("task-7", "ci", "token"))
    assert (scope.sandbox, scope.rule_ids, scope.profile) == ("task-7", frozenset({"a", "b"}), "ci")
    assert POLICY.sandbox_limits(scope.profile).requests_per_minute == 10


def test_a_profile_the_policy_does_not_have_grants_nothing():
    scope = scope_of(POLICY, ipaddress.ip_address("10.8.1.1"), Identity("task-7", "gone", "token"))
    assert scope.rule_ids == frozenset() and scope.profile is None and scope.sandbox == "task-7"


@given(st.frozensets(st.sampled_from(["a", "b", "c", "x"])) | st.none())
def test_an_identity_narrows_its_profile_and_never_widens_it(narrowed):
    scope = scope_of(POLICY, None, Identity("task-7", "ci", "token", narrowed))
    assert scope.rule_ids <= frozenset({"a", "b"})
    if narrowed is not None:
        assert scope.rule_ids <= narrowed


def test_an_entry_without_source_ips_is_a_profile_no_address_selects():
    assert scope_of(POLICY, ipaddress.ip_address("10.9.9.9")).sandbox == "default"
    assert scope_of(POLICY, None, Identity("t", "agent", "token")).rule_ids == frozenset({"b"})
