"""`egress-gateway test`: case files, the summary line and the exit status (0 pass, 1 fail, 2 invalid)."""

from __future__ import annotations

import json

import pytest

from gateway.policytest import parse_cases, run_cases, run_file
from gateway.policy import PolicyError, compile_policy

from .helpers import POLICIES, run_cli, write

POLICY = """\
version: 1
resolver:
  static_hosts:
    api.example.com: [151.101.0.10]
rules:
  - id: api
    hosts: [api.example.com]
    methods: [GET]
    paths: ["/v1/**"]
  - id: ci-only
    hosts: [ci.example.com]
sandboxes:
  - id: ci
    source_ips: [10.8.0.0/16]
    rules: [api, ci-only]
  - id: default
    rules: [api]
"""

PASSING = """\
policy: policy.yaml
description: the API is read-only
cases:
  - url: https://api.example.com/v1/items
    expect: allow
    rule: api
    reason: allowed
    inject: []
  - {url: "https://api.example.com/v1/items", method: post, expect: deny, reason: method_not_allowed, rule: api}
  - {url: "https://ci.example.com/", sandbox: ci, expect: allow, rule: ci-only}
  - {url: "https://ci.example.com/", source_ip: 10.8.4.4, expect: allow}
  - {url: "https://ci.example.com/", source_ip: 192.0.2.1, expect: deny, reason: no_rule}
  - {url: "https://ci.example.com/", expect: deny, reason: no_rule}
  - {url: "https://api.example.com/v1/", addresses: [10.0.0.1], expect: deny, reason: denied_address}
  - {name: not resolved, url: "https://ci.example.com/", sandbox: ci, expect: allow}
  - {url: "tcp://198.51.100.7:22", expect: deny, reason: no_rule}
"""


@pytest.fixture
def files(tmp_path):
    write(tmp_path / "policy.yaml", POLICY)
    return tmp_path


def test_all_pass_exit_0(files):
    path = write(files / "ok.test.yaml", PASSING)
    result = run_cli("test", path)
    assert result.status == 0, result.stdout
    assert result.stdout == f"{path} (policy {files / 'policy.yaml'}): .........\n9 passed, 0 failed\n"


def test_verbose_lists_every_case(files):
    path = write(files / "ok.test.yaml", PASSING)
    result = run_cli("test", "-v", path)
    assert f"  PASS {path}:4:5: GET https://api.example.com/v1/items\n" in result.stdout
    assert f"  PASS {path}:12:5: GET https://ci.example.com/ [source 192.0.2.1]\n" in result.stdout
    assert f"  PASS {path}:15:5: not resolved: GET https://ci.example.com/ [sandbox ci]\n" in result.stdout


def test_failures_exit_1_with_what_differed(files):
    path = write(files / "fail.test.yaml", """\
        policy: policy.yaml
        cases:
          - {url: "https://api.example.com/v1/items", expect: allow}
          - {url: "https://api.example.com/v2/items", expect: allow}
          - {url: "https://api.example.com/v1/items", method: POST, expect: deny, reason: path_not_allowed}
          - {url: "https://api.example.com/v1/items", expect: allow, rule: other}
          - {url: "https://api.example.com/v1/items", expect: allow, inject: [TOKEN]}
    """)
    result = run_cli("test", path)
    assert result.status == 1
    out = result.stdout
    assert out.splitlines()[0] == f"{path} (policy {files / 'policy.yaml'}): .FFFF"
    assert f"  FAIL {path}:4:5: GET https://api.example.com/v2/items\n" \
           "       expected allow, got deny (path_not_allowed, rule api): no rule allows GET " \
           "https://api.example.com:443/v2/items (path not allowed)\n" in out
    assert "       expected deny (path_not_allowed), got deny (method_not_allowed, rule api)" in out
    assert "       expected rule other, got api\n" in out
    assert "       expected injected [TOKEN], got []\n" in out
    assert out.endswith("1 passed, 4 failed\n")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cases:\n  - {url: 'https://a.example/', expect: allow}\n", "1:1: policy: missing required key 'policy'"),
        ("policy: policy.yaml\n", "1:1: cases: missing required key 'cases'"),
        ("policy: policy.yaml\ncases: []\n", "2:8: cases: must be a non-empty list of cases"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/'}\n", "3:5: cases[0]: missing required key 'expect'"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: maybe}\n",
         "3:41: cases[0].expect: 'maybe': expect must be allow, deny or would_deny"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny, reason: nope}\n",
         "3:55: cases[0].reason: 'nope' is not a reason code"),
        ("policy: policy.yaml\ncases:\n  - {url: 'a.example/', expect: deny}\n",
         "3:11: cases[0].url: 'a.example/': give a URL like"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny, expected: deny}\n",
         "3:47: cases[0].expected: unknown key"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny, sandbox: ci, source_ip: 10.8.0.1}\n",
         "3:5: cases[0]: give sandbox or source_ip, not both"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny, addresses: [nope]}\n",
         "3:59: cases[0].addresses: 'nope' is not an IP address"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny, addresses: []}\n",
         "3:58: cases[0].addresses: must not be empty"),
        ("policy: policy.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny, sandbox: nope}\n",
         "3:5: cases[0]: no sandbox 'nope' in the policy (known: ci, default)"),
        ("policy: missing.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny}\n",
         "1:9: policy: the policy"),
        ("policy: policy.yaml\ncases: [\n", "YAML syntax error"),
    ],
)
def test_invalid_test_files_exit_2(files, text, expected):
    path = write(files / "bad.test.yaml", text)
    ok = write(files / "ok.test.yaml", PASSING)
    result = run_cli("test", ok, path)
    assert result.status == 2, result.stdout
    assert f"{path}: INVALID\n" in result.stdout
    assert expected in result.stdout, result.stdout
    assert "1 test file invalid\n9 passed, 0 failed\n" in result.stdout


def test_a_policy_that_does_not_load_is_invalid(files):
    write(files / "broken.yaml", "version: 1\nrules:\n  - id: a\n    hosts: ['*']\n")
    path = write(files / "t.test.yaml", "policy: broken.yaml\ncases:\n  - {url: 'https://a.example/', expect: deny}\n")
    result = run_cli("test", path)
    assert result.status == 2
    assert f"{path}:1:9: policy: the policy {files / 'broken.yaml'} does not load:" in result.stdout
    assert f"{files / 'broken.yaml'}:4:13: rules[0].hosts[0]: '*': a wildcard needs a domain" in result.stdout


def test_policy_override(files):
    write(files / "open.yaml", "version: 1\nrules:\n  - id: all\n    hosts: [api.example.com]\n")
    path = write(files / "t.test.yaml", "policy: policy.yaml\ncases:\n  - {url: 'https://api.example.com/v2/', expect: deny}\n")
    assert run_cli("test", path).status == 0
    assert run_cli("test", "--policy", files / "open.yaml", path).status == 1


def test_json_output(files):
    path = write(files / "t.test.yaml", "policy: policy.yaml\ncases:\n"
                 "  - {url: 'https://api.example.com/v1/', expect: allow}\n"
                 "  - {url: 'https://api.example.com/v2/', expect: allow}\n")
    result = run_cli("test", "--format", "json", path)
    assert result.status == 1
    report = json.loads(result.stdout)
    assert (report["passed"], report["failed"], report["invalid"]) == (1, 1, 0)
    [f] = report["files"]
    assert (f["file"], f["policy"], f["ok"], f["errors"]) == (str(path), str(files / "policy.yaml"), False, [])
    assert [(c["line"], c["passed"], c["verdict"], c["decision"], c["rule"]) for c in f["cases"]] == [
        (3, True, "allow", "allowed", "api"), (4, False, "deny", "path_not_allowed", "api")]


def test_the_runner_is_pure_given_a_policy():
    policy = compile_policy(POLICY, "policy.yaml")
    suite = parse_cases(PASSING, "dir/x.test.yaml")
    assert suite.policy == "dir/policy.yaml"
    results, issues = run_cases(policy, suite.cases)
    assert issues == [] and all(r.passed for r in results) and len(results) == 9
    with pytest.raises(PolicyError):
        parse_cases("cases: 3\n", "x.test.yaml")


@pytest.mark.parametrize("path", sorted((POLICIES / "tests").glob("*.test.yaml")), ids=lambda p: p.name)
def test_shipped_test_files_have_no_invalid_cases(path):
    result = run_file(path)
    assert not result.errors


def test_report_mode_expectations(files):
    write(files / "report.yaml", POLICY.replace("    paths: [\"/v1/**\"]\n", "    paths: [\"/v1/**\"]\n    mode: report\n"))
    path = write(files / "r.test.yaml", """\
        policy: report.yaml
        cases:
          - {url: "https://api.example.com/v2/", expect: would_deny, reason: path_not_allowed}
          - {url: "https://api.example.com/v2/", expect: deny, reason: path_not_allowed}
          - {url: "https://api.example.com/v1/", expect: allow}
          - {url: "https://api.example.com/v2/", expect: allow}
          - {url: "https://api.example.com/v1/", expect: would_deny}
    """)
    result = run_cli("test", path)
    assert result.status == 1
    assert "...FF" in result.stdout
    assert "expected allow, got would_deny (path_not_allowed, rule api)" in result.stdout
    assert "expected would_deny, got allow (allowed, rule api)" in result.stdout
    assert result.stdout.endswith("3 passed, 2 failed\n")


def test_cases_with_headers(files):
    write(files / "headers.test.yaml", """\
policy: policy.yaml
cases:
  - url: https://api.example.com/v1/items
    headers: {X-HTTP-Method-Override: DELETE}
    expect: deny
    reason: method_not_allowed
  - url: https://api.example.com/v1/items
    headers: {X-HTTP-Method-Override: get}
    expect: allow
  - {url: "https://api.example.com/v1/items?_METHOD=put", expect: deny, reason: method_not_allowed}
""")
    result = run_file(files / "headers.test.yaml")
    assert (result.passed, result.failed, result.errors) == (3, 0, [])
    write(files / "bad.test.yaml", """\
policy: policy.yaml
cases:
  - {url: "https://api.example.com/", headers: {}, expect: allow}
  - {url: "https://api.example.com/", headers: {"X Y": a}, expect: allow}
  - {url: "https://api.example.com/", headers: {X: [a]}, expect: allow}
""")
    with pytest.raises(PolicyError) as info:
        parse_cases((files / "bad.test.yaml").read_text(), str(files / "bad.test.yaml"))
    assert [i.path for i in info.value.issues] == ["cases[0].headers", "cases[1].headers.X Y", "cases[2].headers.X"]
