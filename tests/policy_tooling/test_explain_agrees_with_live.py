"""`explain` and live traffic cannot disagree: over random policies and requests, explain's verdict
(allowed, reason, rule) is the one the connection's session (gateway/session.py, which the live
guards drive) reaches for the same request sent as a sandbox sends it: https as CONNECT then the
request in the tunnel, http as an absolute-form request on the proxy port, then the credential
verdict the injector asks. Both are given the same addresses for every name, so this compares the
walks, not the resolvers (tests/policy_tooling/live_walk.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from gateway.engine import Engine
from gateway.explain import explain
from gateway.policy import compile_policy
from gateway.resolver import ResolveError

from .live_walk import Live, addresses, policies, requests


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(), requests())
def test_explain_gives_the_verdict_live_traffic_gets(drawn, request):
    text, headers = drawn
    scheme, host, port, path, method = request
    policy = compile_policy(text, "random.yaml")
    engine = Engine.build(policy)
    client = Live(engine)
    path, headers = client.placeholders(path, headers)
    url = f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"
    explained = explain(policy, url, method, engine=engine, resolve=_addresses_of_name, headers=headers).decision
    got = client.request(scheme, host, port, path, method, headers)
    assert (explained.allowed, explained.reason, explained.rule, explained.would_deny) == \
        (got.allowed, got.reason, got.rule, got.would_deny), (url, method, text)


def _addresses_of_name(host):
    """explain's `resolve` hook: the same addresses (raises where the session is sent the error)."""
    found = addresses(host)
    if isinstance(found, ResolveError):
        raise found
    return found


PASSTHROUGH_POLICY = """\
version: 1
network:
  allow_ip_ranges: [203.0.113.0/24]
resolver:
  static_hosts:
    pt.test: [203.0.113.5]
rules:
  - id: relayed
    hosts: [pt.test]
    inspect: false
"""


def test_a_passthrough_tunnel_is_explained_as_relayed_unread():
    """Review 8: explain judged the request inside a passthrough (inspect: false) tunnel as if it
    were inspected (-H 'Host: evil.test' said 421 host_mismatch); live traffic relays it unread
    once the ClientHello passes, so no head check protects it, and explain must say so."""
    policy = compile_policy(PASSTHROUGH_POLICY, "pt.yaml")
    for method, headers in [("GET", [("Host", "evil.test")]), ("TRACE", []), ("GET", [("Upgrade", "h2c")])]:
        e = explain(policy, "https://pt.test/", method, headers=headers)
        assert (e.decision.allowed, e.decision.rule) == (True, "relayed"), (method, headers, e.decision)
        assert any(n.startswith("passthrough:") for n in e.notes)
