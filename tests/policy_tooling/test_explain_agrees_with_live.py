"""`explain` and live traffic cannot disagree: over random policies and requests, explain's verdict
(allowed, reason, rule) is the one the connection's session (gateway/session.py, which the live
guards drive) reaches for the same request sent as a sandbox sends it: https as CONNECT then the
request in the tunnel, http as an absolute-form request on the proxy port. Both are given the same
addresses for every name, so this compares the walks, not the resolvers."""

from __future__ import annotations

import ipaddress

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.engine import Engine
from gateway.explain import explain, scope_for
from gateway.policy import compile_policy
from gateway.resolver import ResolveError
from gateway.session import PASSTHROUGH, ClientSession, RequestHead, drive_now

NAMES = ["a.test", "b.a.test", "c.test", "meta.test", "gone.test"]
ADDRESSES = {"a.test": ["203.0.113.1"], "b.a.test": ["203.0.113.2", "203.0.113.3"], "c.test": ["198.51.100.7"],
             "meta.test": ["203.0.113.9", "169.254.169.254"]}
HOST_PATTERNS = ["a.test", "*.a.test", "c.test", "meta.test", "gone.test", "203.0.113.0/24", "198.51.100.7"]


@st.composite
def rules(draw, index):
    rule = {"id": f"r{index}", "hosts": draw(st.lists(st.sampled_from(HOST_PATTERNS), min_size=1, max_size=2,
                                                      unique=True))}
    if draw(st.booleans()):
        rule["schemes"] = draw(st.lists(st.sampled_from(["http", "https"]), min_size=1, max_size=2, unique=True))
    if draw(st.booleans()):
        rule["ports"] = draw(st.lists(st.sampled_from([80, 443, 8080, 8443]), min_size=1, max_size=2, unique=True))
    if draw(st.booleans()):
        rule["methods"] = draw(st.lists(st.sampled_from(["GET", "POST", "PUT", "DELETE"]), min_size=1, max_size=3,
                                        unique=True))
    if draw(st.booleans()):
        rule["paths"] = draw(st.lists(st.sampled_from(["/v1/**", "/x", "/**", "/v1/*/y"]), min_size=1, max_size=2,
                                      unique=True))
    if draw(st.booleans()):
        rule["mode"] = draw(st.sampled_from(["report", "enforce"]))
    if draw(st.integers(0, 5)) == 0 and set(rule.get("schemes", ["https"])) == {"https"} and not {
            "methods", "paths"} & set(rule) and not any(h[0].isdigit() for h in rule["hosts"]):
        rule["inspect"] = False  # passthrough: https, names, no method or path (what the loader accepts)
    return rule


@st.composite
def policies(draw):
    count = draw(st.integers(min_value=0, max_value=4))
    document = {
        "version": 1,
        "network": {"allow_ip_ranges": ["203.0.113.0/24", "198.51.100.0/24"]},
        "resolver": {"static_hosts": ADDRESSES},
        "rules": [draw(rules(i)) for i in range(count)],
    }
    if draw(st.booleans()):
        document["mode"] = "report"
    headers = draw(st.sampled_from([(), (("Host", "evil.test"),), (("X-HTTP-Method-Override", "DELETE"),)]))
    return yaml.safe_dump(document, sort_keys=False), headers


@st.composite
def requests(draw):
    scheme = draw(st.sampled_from(["http", "https"]))
    host = draw(st.sampled_from(NAMES + ["203.0.113.1", "198.51.100.7", "169.254.169.254"]))
    port = draw(st.sampled_from([None, 80, 443, 8080, 8443]))
    path = draw(st.sampled_from(["/", "/v1/models", "/x", "/v1/a/y", "/v1/%2e%2e/x", "/y?_method=DELETE"]))
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    return scheme, host, port, path, method


def _fields(authority: str, headers) -> tuple:
    """The head a client sends: its own Host if it gives one (-H Host), else the URL's authority."""
    given = tuple(headers)
    return given if any(k.lower() == "host" for k, _ in given) else (("Host", authority), *given)


def _addresses(host):
    if host.is_ip:
        return [host.ip]
    if host.value not in ADDRESSES:
        return ResolveError(f"{host.value}: no such name")
    return [ipaddress.ip_address(a) for a in ADDRESSES[host.value]]


def live(engine: Engine, scheme: str, host: str, port: int | None, path: str, method: str, headers=()):
    """The session's verdict for the request as a sandbox sends it through the proxy port."""
    scope, _ = scope_for(engine.policy)
    session = ClientSession("10.0.0.2:5000", "regular", ipaddress.ip_address("10.0.0.2"))
    authority = host if port is None else f"{host}:{port}"
    if scheme == "https":
        connect = drive_now(session.connect(f"{host}:{port or 443}", engine, scope, engine.passthrough_rule),
                            _addresses)
        if not connect.admitted:
            return connect.decision
        session.commit(connect)  # as ConnectGuard does, once the allow is audited
        if session.phase == PASSTHROUGH:
            return connect.decision  # relayed unread after its ClientHello (TlsGuard): no head is judged
        head = RequestHead(method, "https", path, "HTTP/1.1", _fields(authority, headers), form="origin",
                           end_stream=True)
    else:
        head = RequestHead(method, "http", path, "HTTP/1.1", _fields(authority, headers), authority, authority,
                           "absolute", True)
    return drive_now(session.request_head(head, engine, scope), _addresses).decision


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(), requests())
def test_explain_gives_the_verdict_live_traffic_gets(drawn, request):
    text, headers = drawn
    scheme, host, port, path, method = request
    policy = compile_policy(text, "random.yaml")
    engine = Engine.build(policy)
    url = f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"
    explained = explain(policy, url, method, engine=engine, resolve=_addresses_of_name, headers=headers).decision
    got = live(engine, scheme, host, port, path, method, headers)
    assert (explained.allowed, explained.reason, explained.rule, explained.would_deny) == \
        (got.allowed, got.reason, got.rule, got.would_deny), (url, method, text)


def _addresses_of_name(host):
    """explain's `resolve` hook: the same addresses (raises where the session is sent the error)."""
    found = _addresses(host)
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
