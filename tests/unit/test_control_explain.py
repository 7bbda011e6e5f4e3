"""`GET /v1/sandboxes/{id}/explain` (gateway/control.py) and `egress-gateway sandbox explain`: a
registered sandbox's request explained under its live scope, grants included, by the engine in
force; and its verdict is the one live traffic gets. "Live" here is the walk the guards drive
(tests/policy_tooling/live_walk.py `Live`: a GatewayState whose registry the service changes, the
connection's scope looked up as addons/state.py looks it up for every decision)."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json

import pytest

from gateway import cli
from gateway.control import ControlService, Limits
from gateway.control_server import ControlServer
from gateway.engine import Engine
from gateway.explain import ExplainError, parse_target
from gateway.policy import compile_policy
from tests.policy_tooling.live_walk import CLIENT, Live

POLICY = compile_policy("""version: 1
network:
  allow_ip_ranges: [203.0.113.0/24, 198.51.100.0/24]
resolver:
  static_hosts:
    a.test: [203.0.113.1]
    b.a.test: [203.0.113.2, 203.0.113.3]
    c.test: [198.51.100.7]
rules:
  - id: own
    hosts: [c.test]
  - id: docs
    hosts: [a.test]
    methods: [GET]
  - id: other
    hosts: [b.a.test]
sandboxes:
  - id: default
    rules: []
  - id: agent
    rules: [own]
    grantable:
      rules: [docs]
      hosts: ["*.a.test"]
      methods: [GET, HEAD, POST]
      max_ttl: 1h
""", "explain.yaml")


class Gateway:
    """A GatewayState running POLICY (its engine guarding `listeners` as the gateway's own), the
    control service changing its registry, and a fresh client connection from CLIENT per request."""

    def __init__(self, listeners=(), engine_in_force: bool = True, rate: float = 0.0):
        self.live = Live(Engine.build(POLICY, (), listeners))
        self.state = self.live.state
        self.lines: list[dict] = []
        self.counted: list[tuple[str, str]] = []
        self.service = ControlService(self.state.registry, lambda: self.state.engine.policy, self._publish,
                                      lambda **fields: self.lines.append(fields), Limits(rate=rate, burst=rate),
                                      count=lambda action, result: self.counted.append((action, result)),
                                      engine=(lambda: self.state.engine) if engine_in_force else None)
        self.clients = 0

    def _publish(self, ops: list[dict]) -> int:
        for op in ops:
            self.state.apply_registry(op)
        return 1

    def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None):
        reply = self.service.handle(method, path, {k: v if isinstance(v, list) else [v] for k, v in (query or {}).items()},
                                    json.dumps(body).encode() if body is not None else b"", "test")
        return reply.status, reply.body

    def register(self, sandbox: str = "s1", profile: str = "agent") -> None:
        status, body = self.call("POST", "/v1/sandboxes", {"id": sandbox, "source_ips": [CLIENT], "profile": profile})
        assert status == 201, body

    def grant(self, spec: dict, sandbox: str = "s1") -> dict:
        status, body = self.call("POST", f"/v1/sandboxes/{sandbox}/grants", spec)
        assert status == 201, body
        return body

    def explain(self, url: str, method: str = "GET", sandbox: str = "s1", headers=()):
        query = {"url": url, "method": method}
        if headers:
            query["header"] = list(headers)
        return self.call("GET", f"/v1/sandboxes/{sandbox}/explain", query=query)

    def live_decision(self, url: str, method: str = "GET"):
        """What a request from CLIENT gets now, on a new connection (its scope looked up now)."""
        self.clients += 1
        self.live.session = self.state.connection(f"c{self.clients}", (CLIENT, 5000 + self.clients))
        self.live.scope = self.state.scope(self.live.session)
        target = parse_target(url)
        return self.live.request(target.scheme, target.host.value, target.port, target.target, method)


def agrees(gw: Gateway, url: str, method: str = "GET") -> dict:
    """The explanation, after checking its verdict is live traffic's (allowed, reason, rule)."""
    status, body = gw.explain(url, method)
    assert status == 200, body
    got = gw.live_decision(url, method)
    said = body["decision"]
    assert (said["allowed"], said["reason"], said["rule"]) == (got.allowed, got.reason, got.rule), (url, body, got)
    return body


def candidates(body: dict) -> dict:
    return {c["rule"]: c for c in body["candidates"]}


@pytest.fixture
def gw():
    gateway = Gateway()
    gateway.register()
    return gateway


def test_a_hosts_grant_is_explained_as_its_transient_rule_and_agrees_with_live_traffic(gw):
    before = agrees(gw, "https://b.a.test/x")
    assert (before["decision"]["reason"], before["sandbox"]) == ("no_rule", "s1")
    assert candidates(before)["other"]["outcome"] == "not_granted"
    grant = gw.grant({"hosts": ["b.a.test"], "methods": ["GET"], "ttl_seconds": 600})
    rule = f"grant:{grant['id']}"
    after = agrees(gw, "https://b.a.test/x")
    assert (after["verdict"], after["decision"]["rule"]) == ("allow", rule)
    assert f"(by grant {grant['id']} of sandbox s1, until " in after["decision"]["message"]
    listed = candidates(after)
    assert listed["other"]["outcome"] == "not_granted"  # the policy's rule: still not the sandbox's
    assert listed[rule]["outcome"] == "decided"
    assert listed[rule]["grant"] == {"id": grant["id"], "sandbox": "s1", "expires_at": grant["expires_at"]}
    assert grant["id"] in after["scope"] and after["scope"].startswith("registered sandbox s1 (profile agent")
    assert after["resolution"] == "static_hosts" and len(after["addresses"]) == 2
    # outside what the grant allows: the transient rule is the one that came closest, as live
    post = agrees(gw, "https://b.a.test/x", "POST")
    assert (post["decision"]["reason"], post["decision"]["rule"]) == ("method_not_allowed", rule)
    assert candidates(post)[rule]["outcome"] == "no_match" and "method POST not in [GET]" in candidates(post)[rule]["why"]


def test_after_the_grant_is_revoked_explain_denies_with_live_traffics_reason(gw):
    grant = gw.grant({"hosts": ["*.a.test"], "ttl_seconds": 600})
    assert agrees(gw, "https://b.a.test/x")["decision"]["rule"] == f"grant:{grant['id']}"
    assert gw.call("DELETE", f"/v1/sandboxes/s1/grants/{grant['id']}")[0] == 200
    after = agrees(gw, "https://b.a.test/x")
    assert (after["verdict"], after["decision"]["reason"], after["decision"]["rule"]) == ("deny", "no_rule", None)
    assert f"grant:{grant['id']}" not in candidates(after) and grant["id"] not in after["scope"]


def test_a_rule_grant_is_explained_as_the_granted_rule_naming_its_grant(gw):
    before = agrees(gw, "https://a.test/")
    assert before["decision"]["reason"] == "no_rule"
    assert "grantable.rules: a rule grant could add it" in candidates(before)["docs"]["why"]
    grant = gw.grant({"rule": "docs", "ttl_seconds": 600})
    after = agrees(gw, "https://a.test/")
    assert (after["decision"]["rule"], candidates(after)["docs"]["outcome"]) == ("docs", "decided")
    assert candidates(after)["docs"]["grant"]["id"] == grant["id"]
    assert f"by grant {grant['id']} of sandbox s1" in after["decision"]["message"]
    denied = agrees(gw, "https://a.test/", "DELETE")
    assert denied["decision"]["reason"] == "method_not_allowed"
    assert f"(by grant {grant['id']} of sandbox s1, until " in candidates(denied)["docs"]["why"]
    assert agrees(gw, "https://c.test/")["decision"]["rule"] == "own"  # the profile's own rule: no grant named
    assert "grant" not in candidates(agrees(gw, "https://c.test/"))["own"]


def test_explain_uses_the_engine_in_force():
    """The gateway's own listener is refused live (self_address): explain says so only because it
    asks the engine in force; one built from the policy file alone would allow it."""
    listener = [(ipaddress.ip_address("203.0.113.1"), 443)]
    gw = Gateway(listener)
    gw.register()
    gw.grant({"rule": "docs"})
    body = agrees(gw, "https://a.test/")
    assert (body["verdict"], body["decision"]["reason"]) == ("deny", "self_address")
    assert body["policy_decision"]["allowed"] and body["policy_sha256"] == POLICY.sha256
    detached = Gateway(listener, engine_in_force=False)
    detached.register()
    detached.grant({"rule": "docs"})
    assert detached.explain("https://a.test/")[1]["verdict"] == "allow"


def test_names_are_not_looked_up_and_the_answer_says_the_addresses_were_not_checked(gw):
    gw.grant({"hosts": ["new.a.test"]})
    status, body = gw.explain("https://new.a.test/")
    assert status == 200 and body["verdict"] == "allow" and body["resolution"] == "unresolved"
    assert body["addresses"] == [] and any(n.startswith("addresses not checked") for n in body["notes"])


def test_headers_and_tcp_urls_are_explained_too(gw):
    gw.grant({"rule": "docs"})
    status, body = gw.explain("https://a.test/", headers=["X-HTTP-Method-Override: DELETE"])
    assert status == 200 and body["decision"]["reason"] == "method_not_allowed"
    assert body["headers"] == [["X-HTTP-Method-Override", "DELETE"]]
    status, body = gw.explain("tcp://198.51.100.7:22")
    assert status == 200 and body["method"] is None and body["decision"]["reason"] == "no_rule"


def test_an_unknown_or_expired_sandbox_is_404():
    now = [1000.0]
    gw = Gateway()
    gw.service.clock = lambda: now[0]
    assert gw.explain("https://a.test/", sandbox="nobody") == (
        404, {"error": "unknown_sandbox", "message": "no sandbox 'nobody' is registered"})
    assert gw.call("POST", "/v1/sandboxes", {"id": "s2", "source_ips": ["10.1.0.1"], "profile": "agent",
                                             "ttl_seconds": 10})[0] == 201
    assert gw.explain("https://a.test/", sandbox="s2")[0] == 200
    now[0] += 10
    assert gw.explain("https://a.test/", sandbox="s2")[1]["error"] == "unknown_sandbox"


@pytest.mark.parametrize("query, message", [
    ({"url": "ftp://a.test/"}, None),
    ({"url": "a.test/x"}, None),
    ({"url": "tcp://198.51.100.7"}, None),
    ({}, "url is required"),
    ({"url": ""}, "url is required"),
    ({"url": "https://a.test/", "method": "GET /x"}, "is not an HTTP method"),
    ({"url": "https://a.test/", "header": "no-colon"}, "give a header as 'NAME: VALUE'"),
    # live traffic refuses a method that is not upper-case (400 non_http): never explained as GET (review 26)
    ({"url": "https://a.test/", "method": "get"}, "methods are case-sensitive"),
    ({"url": "https://a.test/", "method": "Post"}, "methods are case-sensitive"),
    ({"url": "https://a.test/" + "x" * 8200}, "url: at most 8192 characters"),  # bounded work on the loop
])
def test_a_question_explain_cannot_ask_is_400_with_its_reason(gw, query, message):
    status, body = gw.call("GET", "/v1/sandboxes/s1/explain", query=query)
    assert (status, body["error"]) == (400, "bad_request"), body
    if message is None:  # the URL's own reason, as `egress-gateway explain` gives it
        with pytest.raises(ExplainError) as raised:
            parse_target(query["url"])
        message = str(raised.value)
    assert message in body["message"]


def test_a_malformed_host_is_explained_as_the_bad_host_refusal(gw):
    status, body = gw.explain("https://user@a.test/")
    assert status == 200 and (body["verdict"], body["decision"]["reason"]) == ("deny", "bad_host")


def test_explain_is_a_read_counted_not_audited_and_rate_limited():
    gw = Gateway(rate=1.0)  # one request a second, burst 1: the registration takes it
    assert gw.call("POST", "/v1/sandboxes", {"id": "s1", "source_ips": [CLIENT], "profile": "agent"})[0] == 201
    written = len(gw.lines)
    status, body = gw.explain("https://c.test/")
    assert (status, body["error"]) == (429, "rate_limited")
    assert gw.lines[written:] == [{**gw.lines[-1], "action": "explain", "reason": "rate_limited", "status": 429}]
    fast = Gateway()
    fast.register()
    written = len(fast.lines)
    assert fast.explain("https://c.test/")[0] == 200 and fast.explain("https://x.test/")[0] == 200
    assert fast.explain("ftp://x", sandbox="s1")[0] == 400 and fast.explain("https://c.test/", sandbox="no")[0] == 404
    assert fast.lines[written:] == []  # a read: no line, allowed or refused
    assert fast.counted[-4:] == [("explain", "ok"), ("explain", "ok"), ("explain", "bad_request"),
                                 ("explain", "unknown_sandbox")]


# --- the CLI: a thin client ----------------------------------------------------------------------------


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(list(argv))
    return status, out.getvalue()


def test_sandbox_explain_prints_the_text_or_the_json_and_exits_like_the_other_subcommands(gw, tmp_path):
    grant = gw.grant({"hosts": ["b.a.test"], "methods": ["GET"]})
    server = ControlServer(f"unix:{tmp_path / 'c.sock'}", gw.service)
    server.start()
    try:
        control = ("sandbox", "--control", server.where)
        status, text = _cli(*control, "explain", "s1", "https://b.a.test/x")
        assert status == 0 and text.startswith("ALLOW  GET https://b.a.test/x\n  reason:    allowed\n")
        assert f"  rule:      grant:{grant['id']}\n" in text
        assert f"  grant:{grant['id']}  decided" in text and "  client:    registered sandbox s1 (profile agent" in text
        status, text = _cli(*control, "explain", "s1", "https://b.a.test/x", "-X", "post", "--json")
        body = json.loads(text)
        assert status == 0 and (body["method"], body["decision"]["reason"]) == ("POST", "method_not_allowed")
        status, text = _cli(*control, "explain", "s1", "https://a.test/", "-H", "X-HTTP-Method: DELETE", "--json")
        assert status == 0 and json.loads(text)["headers"] == [["X-HTTP-Method", "DELETE"]]
        status, text = _cli(*control, "explain", "nobody", "https://a.test/")
        assert status == 1 and json.loads(text)["error"] == "unknown_sandbox"
        status, text = _cli(*control, "explain", "s1", "ftp://a.test/")
        assert status == 1 and json.loads(text)["error"] == "bad_request"
    finally:
        server.stop()
    assert _cli("sandbox", "--control", f"unix:{tmp_path / 'gone.sock'}", "explain", "s1", "https://a.test/")[0] == 2
