"""The secret map is never narrower than the gateway: hypothesis over small random policies.

For every request the engine allows, the real injector (addons/credentials.py
`CredentialInjector.apply`, on a mitmproxy flow) decides what goes in: inject templates and this
sandbox's placeholders swapped. Whatever secret ends up in the outgoing request (read back from
the request itself, by value, not from what the injector says it did) must be in the map, under
the deciding rule, with that host, port, scheme, method, path and sandbox. The membership test
reads only the JSON the map prints (`SecretMap.as_dict`), so what `check --format json` shows is
what is proven.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import quote

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mitmproxy.test import tflow, tutils

from addons.credentials import CredentialInjector
from addons.state import GatewayState
from gateway.credentials import placeholder
from gateway.engine import Engine, Pin, RequestFacts
from gateway.hostnames import canonical_host
from gateway.paths import compile_glob, normalise_path
from gateway.policy import PolicyError, compile_policy
from gateway.secrets import SecretStore
from gateway.secretmap import secret_map

SECRETS = ("S1", "S2", "S3")
VALUES = {name: f"value-of-{name.lower()}-0123456789" for name in SECRETS}
KEY = b"k" * 32

HOST_PATTERNS = ("a.example", "b.example", "x.a.example", "*.a.example", "203.0.113.7", "203.0.113.0/28",
                 "[2001:db8::1]")
REQUEST_HOSTS = ("a.example", "b.example", "x.a.example", "y.x.a.example", "z.b.example", "203.0.113.7",
                 "203.0.113.9", "2001:db8::1")
TEMPLATES = ("Bearer ${secrets.S1}", "${secrets.S2}", "${secrets.S2}:${secrets.S3}", "Token ${secrets.S3}")
PATHS = ("/v1/**", "/x", "/v1/*/items")
REQUEST_PATHS = ("/v1/a", "/v1/a/items", "/x", "/other", "/")


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def rules(draw, index: int):
    hosts = draw(st.lists(st.sampled_from(HOST_PATTERNS), min_size=1, max_size=2, unique=True))
    rule: dict = {"id": f"r{index}", "hosts": hosts}
    if schemes := draw(_maybe(st.lists(st.sampled_from(["https", "http"]), min_size=1, max_size=2, unique=True))):
        rule["schemes"] = schemes
    if ports := draw(_maybe(st.lists(st.sampled_from([443, 80, 8443]), min_size=1, max_size=2, unique=True))):
        rule["ports"] = ports
    if methods := draw(_maybe(st.lists(st.sampled_from(["GET", "POST"]), min_size=1, max_size=2, unique=True))):
        rule["methods"] = methods
    if paths := draw(_maybe(st.lists(st.sampled_from(PATHS), min_size=1, max_size=2, unique=True))):
        rule["paths"] = paths
    if mode := draw(_maybe(st.sampled_from(["enforce", "report"]))):
        rule["mode"] = mode
    injections = draw(st.lists(st.tuples(st.sampled_from(["header:Authorization", "header:X-Key", "query:sig"]),
                                         st.sampled_from(TEMPLATES)), max_size=2, unique_by=lambda t: t[0]))
    broad = any(h.startswith("*.") or "/" in h for h in hosts)
    if injections:
        rule["inject"] = [{k.split(":")[0]: k.split(":")[1], "value": v} for k, v in injections]
        # Legal only with the allowance; sometimes it is there without being needed.
        if broad or draw(st.booleans()):
            rule["allow_wildcard_credentials"] = True
        if "http" in rule.get("schemes", ()) or draw(st.booleans()):
            rule["allow_plaintext_credentials"] = True
        if draw(st.booleans()):
            rule["placeholders"] = {"query": draw(st.lists(st.sampled_from(["key", "q"]), max_size=2, unique=True)),
                                    "path": draw(st.booleans())}
    elif (not broad and not any(c in h for h in hosts for c in "[]") and not any(h[0].isdigit() for h in hosts)
          and set(rule.get("schemes", ["https"])) == {"https"} and "methods" not in rule and "paths" not in rule
          and draw(st.booleans())):
        rule["inspect"] = False
    return rule


@st.composite
def policies(draw):
    count = draw(st.integers(1, 4))
    doc: dict = {"version": 1, "secrets": {name: {"env": f"SM_{name}"} for name in SECRETS},
                 "rules": [draw(rules(i)) for i in range(count)]}
    if draw(st.integers(0, 3)) == 0:
        doc["mode"] = "report"
    if draw(st.booleans()):
        ids = [r["id"] for r in doc["rules"]]
        sandboxes = [{"id": "ci", "source_ips": ["10.8.0.0/16"], "rules": draw(st.lists(st.sampled_from(ids), unique=True))}]
        if draw(st.booleans()):
            sandboxes.append({"id": "default", "rules": draw(st.lists(st.sampled_from(ids), unique=True))})
        doc["sandboxes"] = sandboxes
    return yaml.safe_dump(doc, sort_keys=False)


CONCRETE = {"*.a.example": ("x.a.example", "y.x.a.example"), "203.0.113.0/28": ("203.0.113.7", "203.0.113.9"),
            "[2001:db8::1]": ("2001:db8::1",)}
FITTING_PATHS = {"/v1/**": "/v1/a", "/x": "/x", "/v1/*/items": "/v1/a/items"}


@st.composite
def requests(draw, doc: dict):
    """Half aimed at a rule (a host, scheme, port, method and path it allows), half anywhere."""
    rule = draw(st.sampled_from(doc["rules"])) if draw(st.booleans()) else None
    if rule is None:
        host = draw(st.sampled_from(REQUEST_HOSTS))
        scheme = draw(st.sampled_from(["https", "http"]))
        port = draw(st.sampled_from([443, 80, 8443]))
        method = draw(st.sampled_from(["GET", "POST", "PUT"]))
        path = draw(st.sampled_from(REQUEST_PATHS))
    else:
        pattern = draw(st.sampled_from(rule["hosts"]))
        host = draw(st.sampled_from(CONCRETE.get(pattern, (pattern,))))
        scheme = draw(st.sampled_from(rule.get("schemes", ["https"])))
        port = draw(st.sampled_from(rule.get("ports", [443 if scheme == "https" else 80])))
        method = draw(st.sampled_from(rule.get("methods", ["GET", "POST", "PUT"])))
        path = FITTING_PATHS[draw(st.sampled_from(rule["paths"]))] if "paths" in rule else draw(st.sampled_from(REQUEST_PATHS))
    # Placeholders where the sandbox may put them (or may not): header values, query, a path segment.
    held = draw(st.lists(st.sampled_from(SECRETS), max_size=2, unique=True))
    where = draw(st.lists(st.sampled_from(["header", "query", "path", "query-q"]), max_size=2, unique=True))
    sandbox = draw(st.sampled_from([None, "ci", "default", "other"]))
    return host, scheme, port, method, path, held, where, sandbox


def _target(path: str, held: list[str], where: list[str], sandbox: str | None) -> tuple[str, list]:
    tokens = [placeholder(KEY, name, sandbox) for name in held]
    headers = []
    query = []
    for i, token in enumerate(tokens):
        if "header" in where:
            headers.append(("Authorization" if i == 0 else f"X-Ph-{i}", f"Bearer {token}" if i == 0 else token))
        if "query" in where:
            query.append(f"key={token}")
        if "query-q" in where:
            query.append(f"q={token}")
        if "path" in where:
            path = path.rstrip("/") + "/" + token
    return path + ("?" + "&".join(query) if query else ""), headers


def _carried(request) -> set[str]:
    """The secrets whose value is in the outgoing request, raw or percent-encoded, anywhere but the body."""
    text = "\n".join([request.url, *(f"{k}: {v}" for k, v in request.headers.items(multi=True))])
    return {name for name, value in VALUES.items() if value in text or quote(value, safe="") in text}


# Membership, read off the map's JSON only.

def _host_matches(entry: dict, host) -> bool:
    kind, pattern = entry["kind"], entry["host"]
    if kind in ("name", "ip"):
        return canonical_host(pattern if ":" not in pattern or pattern.startswith("[") else f"[{pattern}]").value == host.value
    if kind == "wildcard":
        return host.ip is None and host.value.endswith(pattern[1:])
    network = ipaddress.ip_network(pattern)
    return host.ip is not None and host.ip.version == network.version and host.ip in network


def _in_map(doc: dict, secret: str, rule: str, host, port: int, scheme: str, method: str, path: str,
            sandbox: str | None) -> bool:
    entry = next(e for e in doc["entries"] if e["name"] == secret)
    for b in entry["rules"]:
        if b["rule"] != rule:
            continue
        if scheme not in b["schemes"] or port not in b["ports"][scheme] or method not in b["methods"]:
            return False
        if b["paths"] is not None and not any(compile_glob(g).match(path) for g in b["paths"]):
            return False
        if b["sandboxes"] is not None and sandbox not in b["sandboxes"]:
            return False
        return any(_host_matches(h, host) for h in b["hosts"])
    return False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(), st.data())
def test_every_secret_the_injector_writes_is_in_the_map(text, data):
    try:
        policy = compile_policy(text, "p.yaml")
    except PolicyError:
        assume(False)
    reqs = data.draw(st.lists(requests(yaml.safe_load(text)), min_size=1, max_size=12))
    engine = Engine.build(policy)
    engine.secrets = SecretStore(policy.secrets, environ={f"SM_{n}": v for n, v in VALUES.items()})
    state = GatewayState()
    state.engine = engine
    state.placeholder_key = KEY
    injector = CredentialInjector(state)
    doc = secret_map(policy, text).as_dict()
    assert doc["holds"] or all(p["id"] in ("no-unbound-overlap", "foreign-credentials-on")
                               for p in doc["properties"] if not p["holds"])
    for host_text, scheme, port, method, path, held, where, sandbox in reqs:
        host = canonical_host(host_text if ":" not in host_text else f"[{host_text}]")
        scope = policy.scope_for(sandbox_id=sandbox)
        target, headers = _target(path, held, where, scope.sandbox)
        decision = engine.check_request(RequestFacts(host, port, scheme, method, target), scope)
        if not decision.allowed:
            continue  # the request guard calls the injector only for allowed requests
        request = tutils.treq(scheme=scheme, host=host.value, port=port, method=method.encode(),
                              path=target.encode(), headers=())
        for name, value in headers:
            request.headers.add(name, value)
        flow = tflow.tflow(req=request)
        pin = Pin(host, port, host.ip or ipaddress.ip_address("198.18.0.1"), ())
        final, used = injector.apply(flow, decision, scope, pin, engine)
        carried = _carried(flow.request)
        assert carried <= set(used) or not final.allowed, (carried, used)
        if not final.allowed:
            continue  # refused: nothing is sent
        normalised = normalise_path(target)
        for secret in carried | set(used):
            assert _in_map(doc, secret, decision.rule, host, port, scheme, method, normalised, scope.sandbox), (
                secret, decision.rule, host.value, port, scheme, method, normalised, scope.sandbox, text)
        state.secret_memory.unpin(flow.id)


@settings(max_examples=200, deadline=None)
@given(policies())
def test_the_map_is_exactly_the_rules_secrets(text):
    """Every rule that references a secret and is granted somewhere appears under it, and no other."""
    try:
        policy = compile_policy(text, "p.yaml")
    except PolicyError:
        assume(False)
    doc = secret_map(policy, text).as_dict()
    granted = None if policy.sandboxes is None else set().union(set(), *(s.rule_ids for s in policy.sandboxes))
    for entry in doc["entries"]:
        expected = [r.id for r in policy.rules if entry["name"] in r.secrets and (granted is None or r.id in granted)]
        assert [b["rule"] for b in entry["rules"]] == expected
        for b in entry["rules"]:
            assert b["refused"] == []  # a loaded policy never asks for what credential_refusal refuses
            assert set(b["schemes"]) <= {"https"} | ({"http"} if b["allow_plaintext_credentials"] else set())
            assert all(h["kind"] in ("name", "ip") or b["allow_wildcard_credentials"] for h in b["hosts"])
