"""gateway/registry.py `scope_of_registration`: a registration's Scope by its id (what the control
API's explain asks), the very Scope its addresses' connections get, and one for a registration
without any address too."""

from __future__ import annotations

from gateway.identity import scope_of
from gateway.registry import Registry
from tests.unit.test_registry import POLICY, T0, grant, ip, register


def test_by_id_is_the_scope_its_connections_get_cached_and_rebuilt_alike():
    registry = Registry()
    register(registry, "s1", ["10.0.0.5"])
    by_id = registry.scope_of_registration(POLICY, "s1", T0)
    assert by_id is scope_of(POLICY, ip("10.0.0.5"), None, registry, T0)  # one cache for both
    grant(registry, {"rule": "docs"})
    by_id = registry.scope_of_registration(POLICY, "s1", T0)
    assert "docs" in by_id.rule_ids and by_id.granted.grant_of("docs").id == "g1"
    assert by_id is scope_of(POLICY, ip("10.0.0.5"), None, registry, T0)
    registry.apply({"op": "revoke", "sandbox": "s1", "grant": "g1"})
    assert registry.scope_of_registration(POLICY, "s1", T0).rule_ids == frozenset({"pypi"})


def test_unknown_and_expired_registrations_have_no_scope():
    registry = Registry()
    assert registry.scope_of_registration(POLICY, "nobody", T0) is None
    register(registry, "s1", ["10.0.0.5"], ttl=10)
    assert registry.scope_of_registration(POLICY, "s1", T0 + 9.9).sandbox == "s1"
    assert registry.scope_of_registration(POLICY, "s1", T0 + 10) is None  # at its deadline, before the timer


def test_a_registration_without_addresses_has_a_scope_by_id():
    registry = Registry()
    register(registry, "s1", [])
    grant(registry, {"hosts": ["api.github.com"]})
    scope = registry.scope_of_registration(POLICY, "s1", T0)
    assert (scope.sandbox, scope.profile) == ("s1", "agent") and scope.granted.grant_of("grant:g1").id == "g1"


def test_a_grant_stops_deciding_at_its_deadline_by_id_too():
    registry = Registry()
    register(registry, "s1", ["10.0.0.5"])
    grant(registry, {"rule": "docs", "ttl_seconds": 30})
    assert "docs" in registry.scope_of_registration(POLICY, "s1", T0 + 29).rule_ids
    assert "docs" not in registry.scope_of_registration(POLICY, "s1", T0 + 30).rule_ids
