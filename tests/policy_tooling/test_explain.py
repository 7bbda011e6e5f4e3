"""`egress-gateway explain`: decision, deciding rule, candidates, addresses, credentials; text and json."""

from __future__ import annotations

import ipaddress
import json

import pytest

from gateway.explain import ExplainError, explain, parse_target, render_text
from gateway.policy import compile_policy
from gateway.resolver import ResolveError

from .helpers import POLICIES, run_cli, write

POLICY = """\
version: 1
network:
  allow_ip_ranges: [10.20.30.0/24]
resolver:
  static_hosts:
    mirror.internal: [10.20.30.5]
    leaky.internal: [10.20.30.6, 10.9.9.9]
    api.example.com: [151.101.0.10]
rules:
  - id: api-read
    hosts: [api.example.com]
    methods: [GET]
    paths: ["/v1/**"]
  - id: api-write
    hosts: [api.example.com]
    methods: [POST]
    paths: ["/v1/items"]
  - id: api-any
    hosts: [api.example.com]
    methods: [GET, POST]
  - id: mirror
    hosts: [mirror.internal, leaky.internal]
    schemes: [http]
  - id: ssh
    protocol: tcp
    hosts: [198.51.100.0/24, git.internal]
    ports: [22]
sandboxes:
  - id: ci
    source_ips: [10.8.0.0/16]
    rules: [api-read, api-write, mirror, ssh]
  - id: default
    rules: [api-read]
"""


@pytest.fixture
def policy():
    return compile_policy(POLICY, "p.yaml")


@pytest.fixture
def policy_file(tmp_path):
    return write(tmp_path / "p.yaml", POLICY)


def test_parse_target():
    t = parse_target("https://API.Example.com./v1/items?x=1#frag")
    assert (t.scheme, t.host.value, t.port, t.target) == ("https", "api.example.com", 443, "/v1/items?x=1")
    assert parse_target("http://[2001:db8::1]:8080").target == "/"
    assert parse_target("http://a.example?q").target == "/?q"
    t = parse_target("tcp://198.51.100.7:22")
    assert (t.scheme, t.host.value, t.port, t.target) == ("tcp", "198.51.100.7", 22, "")
    bad = parse_target("https://user@a.example/")
    assert bad.host is None and "forbidden character '@'" in bad.host_error
    for url in ("a.example/x", "ftp://a.example/", "https:///x", "tcp://198.51.100.7", "tcp://198.51.100.7:22/x"):
        with pytest.raises(ExplainError):
            parse_target(url)


def test_allowed_with_other_candidates(policy):
    e = explain(policy, "https://api.example.com/v1/items", "POST", sandbox="ci")
    assert e.decision.allowed and e.decision.rule == "api-write" and e.exit_status == 0
    assert [(c.rule, c.outcome) for c in e.candidates] == [
        ("api-read", "no_match"), ("api-write", "decided"), ("api-any", "not_granted")]
    assert e.candidates[0].why == "method POST not in [GET]"
    assert e.resolution == "static_hosts"
    assert [(str(v.address), v.allowed) for v in e.addresses] == [("151.101.0.10", True)]
    assert e.path == "/v1/items"


def test_denied_with_why_each_candidate_failed(policy):
    e = explain(policy, "https://api.example.com/v2/items", "POST", sandbox="ci")
    assert not e.decision.allowed and e.exit_status == 1
    assert (e.decision.reason, e.decision.rule) == ("path_not_allowed", "api-write")
    assert {c.rule: (c.outcome, c.why) for c in e.candidates} == {
        "api-read": ("no_match", "method POST not in [GET]"),
        "api-write": ("no_match", "path /v2/items matches none of [/v1/items]"),
        "api-any": ("not_granted", "not granted to ci"),
    }
    # the engine's own notes, for the candidates it looked at
    assert "rule api-any: not granted to sandbox ci" in e.decision.notes


def test_later_matching_rule_is_shown(policy):
    e = explain(policy, "https://api.example.com/v1/x")
    assert e.scope_text == "a client no sandbox entry names: sandbox default"
    no_sandboxes = compile_policy(POLICY.split("sandboxes:")[0], "p.yaml")
    e = explain(no_sandboxes, "https://api.example.com/v1/x")
    assert [(c.rule, c.outcome) for c in e.candidates] == [
        ("api-read", "decided"), ("api-write", "no_match"), ("api-any", "matches")]
    assert e.candidates[2].why == "also matches, but rule api-read comes first"
    assert e.scope_text == "every rule (the policy has no sandboxes section)"


def test_scope_by_source_ip(policy):
    assert explain(policy, "http://mirror.internal/", source_ip="10.8.1.2").decision.allowed
    e = explain(policy, "http://mirror.internal/", source_ip="192.0.2.1")
    assert (e.decision.allowed, e.decision.reason, e.scope.sandbox) == (False, "no_rule", "default")
    assert e.candidates[0].outcome == "not_granted"
    with pytest.raises(ExplainError, match="no sandbox 'nope'"):
        explain(policy, "http://mirror.internal/", sandbox="nope")
    with pytest.raises(ExplainError):
        explain(policy, "http://mirror.internal/", source_ip="not-an-ip")


def test_addresses_and_the_deny_list(policy):
    ok = explain(policy, "http://mirror.internal/", sandbox="ci")
    assert ok.decision.allowed
    assert ok.addresses[0].detail == "exempted by allow_ip_ranges 10.20.30.0/24"
    leaky = explain(policy, "http://leaky.internal/", sandbox="ci")
    assert (leaky.decision.allowed, leaky.decision.reason, leaky.decision.rule) == (False, "denied_address", "mirror")
    assert leaky.policy_decision.allowed
    assert [v.allowed for v in leaky.addresses] == [True, False]
    given = explain(policy, "http://mirror.internal/", sandbox="ci", addresses=[ipaddress.ip_address("169.254.169.254")])
    assert (given.resolution, given.decision.reason) == ("given", "denied_address")


def test_no_dns_unless_asked(policy):
    calls = []

    def resolve(host):
        calls.append(host.value)
        return (ipaddress.ip_address("127.0.0.1"),)

    unresolved = explain(policy, "https://api.example.com/v1/x", sandbox="ci")
    assert unresolved.resolution == "static_hosts"
    no_static = compile_policy(POLICY.replace("    api.example.com: [151.101.0.10]\n", ""), "p.yaml")
    e = explain(no_static, "https://api.example.com/v1/x", sandbox="ci")
    assert (e.resolution, e.addresses, e.decision.allowed) == ("unresolved", [], True)
    assert any("addresses not checked" in n for n in e.notes)
    e = explain(no_static, "https://api.example.com/v1/x", sandbox="ci", resolve=resolve)
    assert calls == ["api.example.com"]
    assert (e.resolution, e.decision.reason) == ("dns", "denied_address")

    def failing(host):
        raise ResolveError("cannot resolve api.example.com: nope")

    e = explain(no_static, "https://api.example.com/v1/x", sandbox="ci", resolve=failing)
    assert (e.resolution, e.decision.reason, e.resolve_error) == ("failed", "resolve_failed", "cannot resolve api.example.com: nope")


def test_raw_tcp(policy):
    e = explain(policy, "tcp://198.51.100.7:22", sandbox="ci")
    assert (e.decision.allowed, e.decision.rule) == (False, "ssh")  # a documentation range: deny list
    assert e.decision.reason == "denied_address"
    allowing = compile_policy(POLICY.replace("  allow_ip_ranges: [10.20.30.0/24]", "  allow_ip_ranges: [10.20.30.0/24, 198.51.100.0/24]"), "p.yaml")
    e = explain(allowing, "tcp://198.51.100.7:22", sandbox="ci")
    assert (e.decision.allowed, e.decision.rule, e.candidates[0].outcome) == (True, "ssh", "decided")
    e = explain(allowing, "tcp://198.51.100.7:2222", sandbox="ci")
    assert (e.decision.reason, e.candidates[0].why) == ("port_not_allowed", "port 2222 not in [22]")
    e = explain(allowing, "tcp://git.internal:22", sandbox="ci")
    assert e.decision.reason == "no_rule" and "no address to decide on" in e.decision.message
    e = explain(allowing, "tcp://git.internal:22", sandbox="ci", addresses=[ipaddress.ip_address("198.51.100.9")])
    assert e.decision.allowed  # the name, answered with that address, is in the rule
    e = explain(allowing, "https://198.51.100.7/", sandbox="ci")
    assert e.decision.reason == "no_rule"
    assert [(c.rule, c.outcome) for c in e.candidates] == [("ssh", "other_protocol")]


def test_bad_host_is_a_denial(policy):
    e = explain(policy, "https://a%2eexample/")
    assert (e.decision.allowed, e.decision.reason, e.exit_status) == (False, "bad_host", 1)


def test_text_output(policy_file):
    result = run_cli("explain", "--policy", policy_file, "--sandbox", "ci", "-X", "POST", "https://api.example.com/v2/items")
    assert result.status == 1
    assert result.stdout == (
        "DENY  POST https://api.example.com/v2/items\n"
        "  reason:    path_not_allowed (403)\n"
        "  rule:      api-write\n"
        "  message:   no rule allows POST https://api.example.com:443/v2/items (path not allowed)\n"
        "  client:    sandbox ci\n"
        "  target:    https://api.example.com:443  path /v2/items\n"
        "candidate rules:\n"
        "  api-read   no_match       method POST not in [GET]\n"
        "  api-write  no_match       path /v2/items matches none of [/v1/items]\n"
        "  api-any    not_granted    not granted to ci\n"
        "addresses (static_hosts):\n"
        "  151.101.0.10                            allowed: not in any deny range\n"
        "credentials injected: none\n"
    )
    allowed = run_cli("explain", "--policy", policy_file, "--source-ip", "10.8.0.9", "http://mirror.internal/x")
    assert allowed.status == 0
    assert allowed.stdout.startswith("ALLOW  GET http://mirror.internal/x\n")
    assert "  client:    source IP 10.8.0.9: sandbox ci\n" in allowed.stdout


def test_json_output(policy_file):
    result = run_cli("explain", "--policy", policy_file, "--format", "json", "--sandbox", "ci", "http://leaky.internal/a/../b")
    assert result.status == 1
    report = json.loads(result.stdout)
    assert report["verdict"] == "deny"
    assert report["decision"] == {
        "allowed": False, "verdict": "deny", "reason": "denied_address", "status": 403, "rule": "mirror",
        "message": "leaky.internal resolves to 10.9.9.9: in deny range 10.0.0.0/8 (private (RFC 1918))",
        "notes": ["10.20.30.6: exempted by allow_ip_ranges 10.20.30.0/24", "10.9.9.9: in deny range 10.0.0.0/8 (private (RFC 1918))"],
    }
    assert report["policy_decision"]["allowed"] is True
    assert (report["method"], report["scheme"], report["host"], report["port"], report["path"], report["sandbox"]) == (
        "GET", "http", "leaky.internal", 80, "/b", "ci")
    assert report["candidates"] == [{"rule": "mirror", "outcome": "decided", "why": "rule mirror allows GET http://leaky.internal:80/b"}]
    assert report["resolution"] == "static_hosts"
    assert report["addresses"] == [
        {"address": "10.20.30.6", "allowed": True, "reason": "allowed", "detail": "exempted by allow_ip_ranges 10.20.30.0/24"},
        {"address": "10.9.9.9", "allowed": False, "reason": "denied_address", "detail": "in deny range 10.0.0.0/8 (private (RFC 1918))"},
    ]
    assert report["credentials"] == [] and report["injected"] == []
    assert report["exit"] == 1


def test_usage_errors_exit_2(policy_file, tmp_path):
    assert run_cli("explain", "--policy", policy_file, "ftp://a.example/").status == 2
    assert run_cli("explain", "--policy", policy_file, "--sandbox", "nope", "https://a.example/").status == 2
    assert run_cli("explain", "--policy", policy_file, "--address", "nope", "https://a.example/").status == 2
    bad = write(tmp_path / "bad.yaml", "version: 2\n")
    result = run_cli("explain", "--policy", bad, "https://a.example/")
    assert result.status == 2 and f"{bad}:1:10: version: 2: only version 1 is supported" in result.stderr


def test_default_policy_without_policy_flag():
    result = run_cli("explain", "https://pypi.org/simple/requests/")
    assert result.status == 0 and "  rule:      pypi\n" in result.stdout
    assert run_cli("explain", "-X", "POST", "https://pypi.org/simple/").status == 1


# --------------------------------------------------------------------------------------------
# credentials: names only, never values


@pytest.fixture
def github():
    return POLICIES / "github.yaml"


def test_credentials_are_named_never_valued(github, monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_supersecretvalue")
    result = run_cli("explain", "--policy", github, "https://api.github.com/repos/example-org/app")
    assert result.status == 0
    assert "credentials injected (names only):\n  header Authorization <- secrets.GITHUB_TOKEN\n" in result.stdout
    assert "supersecret" not in result.stdout + result.stderr
    report = json.loads(run_cli("explain", "--policy", github, "--format", "json",
                                "https://api.github.com/repos/example-org/app").stdout)
    assert report["credentials"] == [{"target": "header", "name": "Authorization", "secrets": ["GITHUB_TOKEN"]}]
    assert report["injected"] == ["GITHUB_TOKEN"]
    assert "supersecret" not in json.dumps(report) and "Bearer" not in json.dumps(report)
    denied = json.loads(run_cli("explain", "--policy", github, "--format", "json",
                                "https://api.github.com/user").stdout)
    assert denied["credentials"] == [] and denied["exit"] == 1


CREDENTIAL_POLICY = """\
version: 1
secrets:
  TOKEN: {env: TOKEN}
rules:
  - id: wild
    hosts: ["*.example.com", api.example.net]
    schemes: [https, http]
    allow_wildcard_credentials: %s
    allow_plaintext_credentials: %s
    inject:
      - query: key
        value: "${secrets.TOKEN}"
"""


def test_credential_refusals_like_the_gateway():
    strict = compile_policy(CREDENTIAL_POLICY % ("true", "true"), "p.yaml")
    e = explain(strict, "http://a.example.com/")
    assert e.decision.allowed and e.injected == ["TOKEN"]
    assert [(c.target, c.name) for c in e.credentials] == [("query", "key")]
    # the loader refuses these combinations; a rule object that has them still gets the gateway's checks
    rule = strict.rules[0]
    object.__setattr__(rule, "allow_plaintext_credentials", False)
    e = explain(strict, "http://api.example.net/")
    assert (e.decision.allowed, e.decision.reason, e.injected) == (False, "plaintext_credentials", [])
    object.__setattr__(rule, "allow_wildcard_credentials", False)
    e = explain(strict, "https://a.example.com/")
    assert (e.decision.reason, e.injected) == ("credential_host", [])
    assert explain(strict, "https://api.example.net/").decision.allowed


def test_render_text_is_stable_for_an_allowed_request(policy):
    text = render_text(explain(policy, "https://api.example.com/v1/items", "post", sandbox="ci"))
    assert text.splitlines()[:3] == ["ALLOW  POST https://api.example.com/v1/items", "  reason:    allowed", "  rule:      api-write"]


# --------------------------------------------------------------------------------------------
# report mode: would_deny


REPORT = POLICY.replace("  - id: api-read\n", "  - id: api-read\n    mode: report\n")


def test_report_mode_rule_gives_would_deny(tmp_path):
    policy = compile_policy(REPORT, "p.yaml")
    e = explain(policy, "https://api.example.com/v2/x", "PUT", sandbox="ci")
    # every candidate fails at the method: the first (api-read, in report mode) is named, and reports
    assert (e.decision.rule, e.decision.reason) == ("api-read", "method_not_allowed")
    assert (e.verdict, e.exit_status, e.mode) == ("would_deny", 0, "report")
    assert [c.outcome for c in e.candidates] == ["no_match", "no_match", "not_granted"]
    assert any("report mode" in n for n in e.notes)
    e = explain(policy, "https://api.example.com/v2/x", "POST", sandbox="ci")
    assert (e.decision.rule, e.verdict) == ("api-write", "deny")  # api-write came closest, and enforces
    path = write(tmp_path / "r.yaml", REPORT)
    result = run_cli("explain", "--policy", path, "--sandbox", "ci", "-X", "PUT", "https://api.example.com/v2/x")
    assert result.status == 0
    assert result.stdout.startswith("WOULD_DENY  PUT https://api.example.com/v2/x\n  reason:    method_not_allowed\n")
    assert "  mode:      report (allowlist denials are let through and logged as would_deny)\n" in result.stdout
    report = json.loads(run_cli("explain", "--policy", path, "--sandbox", "ci", "--format", "json", "-X", "PUT",
                                "https://api.example.com/v2/x").stdout)
    assert (report["verdict"], report["decision"]["allowed"], report["mode"]) == ("would_deny", True, "report")


def test_report_mode_never_relaxes_the_deny_list():
    policy = compile_policy("version: 1\nmode: report\nresolver:\n  static_hosts:\n    a.example: [10.0.0.1]\n"
                            "rules:\n  - id: a\n    hosts: [a.example]\n    methods: [GET]\n", "p.yaml")
    assert explain(policy, "https://b.example/").verdict == "would_deny"
    e = explain(policy, "https://a.example/", "POST")
    assert (e.verdict, e.decision.reason) == ("deny", "denied_address")
    assert explain(policy, "https://b.example/", "TRACE").verdict == "deny"


def test_report_mode_injects_no_credentials():
    policy = compile_policy(
        "version: 1\nsecrets:\n  T: {env: T}\nrules:\n  - id: a\n    hosts: [a.example]\n    methods: [GET]\n"
        "    mode: report\n    inject:\n      - header: Authorization\n        value: \"${secrets.T}\"\n", "p.yaml")
    assert explain(policy, "https://a.example/").injected == ["T"]
    e = explain(policy, "https://a.example/", "POST")
    assert (e.verdict, e.injected) == ("would_deny", [])


def test_method_overrides_in_headers_and_the_url(policy, policy_file):
    """The engine judges every method a request names (gateway/methods/); explain takes headers
    with -H, and finds overrides in the URL's query itself."""
    e = explain(policy, "https://api.example.com/v1/items", "GET", headers=[("X-HTTP-Method-Override", "DELETE")])
    assert (e.decision.allowed, e.decision.reason, e.decision.rule) == (False, "method_not_allowed", "api-read")
    assert e.overrides == ("header X-HTTP-Method-Override: DELETE",)
    assert "method override header X-HTTP-Method-Override: DELETE" in e.decision.message
    e = explain(policy, "https://api.example.com/v1/items?_method=delete", "GET")
    assert (e.decision.allowed, e.decision.reason) == (False, "method_not_allowed")
    assert e.overrides == ("query parameter _method: DELETE",)
    assert explain(policy, "https://api.example.com/v1/items?_method=GET", "GET").decision.allowed
    result = run_cli("explain", "--policy", policy_file, "-H", "X-HTTP-Method: PATCH", "--format", "json",
                     "https://api.example.com/v1/items")
    assert result.status == 1
    data = json.loads(result.stdout)
    assert data["headers"] == [["X-HTTP-Method", "PATCH"]]
    assert data["method_override"] == ["header X-HTTP-Method: PATCH"]
    assert data["decision"]["reason"] == "method_not_allowed"
    text = run_cli("explain", "--policy", policy_file, "-H", "X-HTTP-Method: PATCH", "https://api.example.com/v1/x")
    assert "  override:  header X-HTTP-Method: PATCH\n" in text.stdout
    for bad in ("no-colon", " X: y", ": y"):
        assert run_cli("explain", "--policy", policy_file, "-H", bad, "https://api.example.com/").status == 2
    assert run_cli("explain", "--secrets", "--policy", policy_file, "-H", "X: y").status == 2
