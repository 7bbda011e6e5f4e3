"""`egress-gateway check`: the loader's errors exactly, lint warnings with location and code,
--strict, --format json, and every example policy passing --strict."""

from __future__ import annotations

import json
import textwrap

import pytest

from gateway.lint import WARNING_CODES, lint, multi_tenant_platform
from gateway.policy import PolicyError, compile_policy, load_policy

from .helpers import POLICIES, run_cli, write


def findings(text: str, source: str = "p.yaml"):
    text = textwrap.dedent(text)
    return lint(compile_policy(text, source), text)


def as_tuples(text: str):
    return [(f.code, f.location.line, f.location.column, f.path) for f in findings(text)]


# --------------------------------------------------------------------------------------------
# errors: exactly the loader's


BAD = """\
version: 1
rules:
  - id: pypi
    hosts: ["*"]
    ports: [0]
  - id: pypi
    hosts: [example.com]
"""


def test_errors_are_the_loaders_exactly(tmp_path):
    path = write(tmp_path / "bad.yaml", BAD)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    result = run_cli("check", path)
    assert result.status == 2
    assert result.stderr == str(info.value) + "\n"
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines == [
        f"{path}:4:13: rules[0].hosts[0]: '*': a wildcard needs a domain (\"*.example.com\")",
        f"{path}:5:13: rules[0].ports[0]: 0: a port is a number from 1 to 65535",
        f"{path}:6:9: rules[1].id: duplicate rule id 'pypi' (first at {path}:3:9)",
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("rules: []\n", "1:1: version: missing required key 'version' (use: version: 1)"),
        ("version: 1\nrulez: []\n", "2:1: rulez: unknown key (allowed: "),
        ("version: 1\nrules:\n  - id: a\n    hosts: [a.example]\n    hosts: [b.example]\n", "5:5: rules[0].hosts: duplicate key"),
        ("version: 1\nrules:\n  - id: a\n    hosts: [a.example]\n    methods: [TRACE]\n",
         "5:15: rules[0].methods[0]: 'TRACE' is always refused and cannot be allowed"),
        ("version: 1\nnetwork:\n  allow_ip_ranges: [10.0.0.1/8]\n", "3:21: network.allow_ip_ranges[0]: '10.0.0.1/8' is not a valid CIDR"),
        ("version: 1\nrules:\n  - id: a\n    hosts: [a.example]\nsandboxes:\n  - id: default\n    rules: [b]\n",
         "7:13: sandboxes[0].rules[0]: 'b': no rule has this id"),
        ("version: 1\nrules: [\n", "YAML syntax error"),
    ],
)
def test_each_error_names_line_column_and_key(tmp_path, text, expected):
    path = write(tmp_path / "p.yaml", text)
    result = run_cli("check", path)
    assert result.status == 2
    assert f"{path}:{expected}" in result.stderr or expected in result.stderr, result.stderr


def test_missing_file_is_an_error(tmp_path):
    result = run_cli("check", tmp_path / "nope.yaml")
    assert result.status == 2
    assert f"{tmp_path / 'nope.yaml'}:1:1: cannot read policy" in result.stderr


def test_json_errors(tmp_path):
    path = write(tmp_path / "bad.yaml", BAD)
    result = run_cli("check", "--format", "json", path)
    assert result.status == 2
    report = json.loads(result.stdout)
    assert report == {"files": [{
        "file": str(path), "ok": False, "warnings": [], "rules": None, "sha256": None, "secrets": None,
        "errors": [
            {"file": str(path), "line": 4, "column": 13, "path": "rules[0].hosts[0]",
             "message": "'*': a wildcard needs a domain (\"*.example.com\")"},
            {"file": str(path), "line": 5, "column": 13, "path": "rules[0].ports[0]",
             "message": "0: a port is a number from 1 to 65535"},
            {"file": str(path), "line": 6, "column": 9, "path": "rules[1].id",
             "message": f"duplicate rule id 'pypi' (first at {path}:3:9)"},
        ],
    }]}


# --------------------------------------------------------------------------------------------
# warnings, one code at a time


def test_warning_codes_are_documented():
    assert set(WARNING_CODES) == {"unused-rule", "unused-secret", "shadowed-rule", "multi-tenant-wildcard",
                                  "broad-credentials", "static-host-denied", "passthrough-shared-cdn",
                                  "passthrough-overlap", "bound-host-also-unbound", "byte-budget-bypassed"}


def test_byte_budget_bypassed_by_an_unread_rule():
    text = """\
    version: 1
    rules:
      - id: api
        hosts: [api.example.com]
      - id: raw
        hosts: [git.example.com]
        inspect: false
      - id: db
        hosts: [10.0.0.5]
        protocol: tcp
        ports: [5432]
    sandboxes:
      - id: capped
        source_ips: [10.8.0.0/16]
        rules: [api, raw, db]
        limits:
          download_bytes_per_hour: 1GiB
      - id: counted-only
        source_ips: [10.9.0.0/16]
        rules: [api, raw]
        limits:
          requests_per_minute: 100
    """
    got = [t for t in as_tuples(text) if t[0] == "byte-budget-bypassed"]
    assert got == [("byte-budget-bypassed", 16, 5, "sandboxes[0].limits")] * 2
    messages = [f.message for f in findings(text) if f.code == "byte-budget-bypassed"]
    assert "rule raw (inspect: false)" in messages[0] + messages[1]
    assert "rule db (protocol: tcp)" in messages[0] + messages[1]


def test_unused_rule():
    text = """\
    version: 1
    rules:
      - id: used
        hosts: [a.example]
      - id: unused
        hosts: [b.example]
    sandboxes:
      - id: ci
        source_ips: [10.8.0.0/16]
        rules: [used]
    """
    assert as_tuples(text) == [("unused-rule", 5, 9, "rules[1].id")]
    assert "rule unused is granted to no sandbox" in findings(text)[0].message


def test_no_unused_rule_without_sandboxes():
    assert as_tuples("version: 1\nrules:\n  - id: a\n    hosts: [a.example]\n") == []


def test_unused_secret():
    text = """\
    version: 1
    secrets:
      USED: {env: USED}
      SPARE: {file: /run/secrets/spare}
    rules:
      - id: api
        hosts: [api.example.com]
        methods: [POST]
        inject:
          - header: Authorization
            value: "Bearer ${secrets.USED}"
    """
    assert as_tuples(text) == [("unused-secret", 4, 3, "secrets.SPARE")]


SHADOW = """\
version: 1
rules:
  - id: wide
    hosts: ["*.example.com", api.other.test]
    methods: [GET, HEAD, POST]
    paths: ["/v1/**"]
  - id: narrow
    hosts: [api.example.com, "*.eu.example.com"]
    methods: [GET]
    paths: ["/v1/items/*", /v1/health]
"""


def test_shadowed_rule():
    assert as_tuples(SHADOW) == [("shadowed-rule", 7, 9, "rules[1]")]
    assert "rule narrow can never decide a request: earlier rule wide covers all its hosts" in findings(SHADOW)[0].message


def test_shadowed_by_several_earlier_rules_and_cidrs():
    text = """\
    version: 1
    rules:
      - id: a
        hosts: [a.example]
      - id: net
        hosts: [198.51.100.0/24]
      - id: both
        hosts: [a.example, 198.51.100.7, 198.51.100.128/25]
        methods: [GET]
    """
    [finding] = findings(text)
    assert (finding.code, finding.path) == ("shadowed-rule", "rules[2]")
    assert "earlier rules a, net cover all its hosts" in finding.message


@pytest.mark.parametrize(
    "later",
    [
        "hosts: [api.example.com, api.example.org]",  # one host not covered
        "hosts: [example.com]",  # the apex is not under *.example.com
        "hosts: [api.example.com]\n    methods: [GET, DELETE]",  # wider methods
        "hosts: [api.example.com]\n    methods: [GET]",  # no path restriction: wider paths
        "hosts: [api.example.com]\n    methods: [GET]\n    paths: [\"/v2/**\"]",  # other paths
        "hosts: [api.example.com]\n    methods: [GET]\n    paths: [\"/v1*\"]",  # /v1x is not under /v1/
        "hosts: [api.example.com]\n    methods: [GET]\n    paths: [\"/**/v1\"]",  # not certain: not reported
        "hosts: [api.example.com]\n    methods: [GET]\n    paths: [\"/v1/**\"]\n    schemes: [https, http]",
        "hosts: [api.example.com]\n    methods: [GET]\n    paths: [\"/v1/**\"]\n    ports: [443, 8443]",
        "hosts: [198.51.100.7]\n    protocol: tcp\n    ports: [22]",  # another protocol
    ],
)
def test_not_shadowed(later):
    text = SHADOW.split("  - id: narrow")[0] + "  - id: narrow\n    " + later + "\n"
    assert [f for f in findings(text) if f.code == "shadowed-rule"] == []


def test_not_shadowed_when_a_sandbox_grants_only_the_later_rule():
    text = SHADOW + "sandboxes:\n  - id: ci\n    source_ips: [10.8.0.0/16]\n    rules: [wide, narrow]\n" \
                    "  - id: default\n    rules: [narrow]\n"
    assert [f.code for f in findings(text)] == []
    text = SHADOW + "sandboxes:\n  - id: ci\n    source_ips: [10.8.0.0/16]\n    rules: [wide, narrow]\n"
    assert [f.code for f in findings(text)] == ["shadowed-rule"]


def test_shadowed_tcp_rules():
    text = """\
    version: 1
    rules:
      - id: ssh
        protocol: tcp
        hosts: [198.51.100.0/24]
        ports: [22, 2222]
      - id: one
        protocol: tcp
        hosts: [198.51.100.7]
        ports: [22]
    """
    assert as_tuples(text) == [("shadowed-rule", 7, 9, "rules[1]")]


@pytest.mark.parametrize(
    "host, platform",
    [
        ("*.s3.amazonaws.com", "s3.amazonaws.com"),
        ("*.amazonaws.com", "amazonaws.com"),
        ("*.execute-api.us-east-1.amazonaws.com", "amazonaws.com"),
        ("*.blob.core.windows.net", "blob.core.windows.net"),
        ("*.core.windows.net", "blob.core.windows.net"),
        ("*.cloudfront.net", "cloudfront.net"),
        ("*.herokuapp.com", "herokuapp.com"),
        ("*.github.io", "github.io"),
        ("*.githubusercontent.com", "githubusercontent.com"),
        ("*.appspot.com", "appspot.com"),
        ("*.azurewebsites.net", "azurewebsites.net"),
        ("*.vercel.app", "vercel.app"),
        ("*.netlify.app", "netlify.app"),
        ("*.pages.dev", "pages.dev"),
        ("*.workers.dev", "workers.dev"),
        ("*.fly.dev", "fly.dev"),
        ("*.onrender.com", "onrender.com"),
        ("*.ngrok.io", "ngrok.io"),
        ("*.ngrok-free.app", "ngrok-free.app"),
        ("*.trycloudflare.com", "trycloudflare.com"),
        ("*.r2.dev", "r2.dev"),
        ("*.firebaseapp.com", "firebaseapp.com"),
        ("*.web.app", "web.app"),
        ("*.run.app", "run.app"),
        ("*.cloudfunctions.net", "cloudfunctions.net"),
        ("*.googleusercontent.com", "googleusercontent.com"),
        ("*.storage.googleapis.com", "storage.googleapis.com"),
        ("*.googleapis.com", "storage.googleapis.com"),
        ("*.dev", "deno.dev"),
    ],
)
def test_multi_tenant_wildcard(host, platform):
    text = f'version: 1\nrules:\n  - id: r\n    hosts: [a.example, "{host}"]\n'
    assert as_tuples(text) == [("multi-tenant-wildcard", 4, 24, "rules[0].hosts[1]")]
    assert multi_tenant_platform(host[2:]) == platform
    message = findings(text)[0].message
    assert "multi-tenant platform" in message
    assert message.startswith(f"{host} is a" if host[2:] == platform else f"{host} covers {platform}, which is a")


@pytest.mark.parametrize("host", ["*.example.com", "*.mybucket.s3-website.example.com", "*.myapp.herokuapp.com",
                                  "*.docs.github.io", "*.pythonhosted.org"])
def test_wildcards_within_one_tenant_or_elsewhere_are_fine(host):
    assert as_tuples(f'version: 1\nrules:\n  - id: r\n    hosts: ["{host}"]\n') == []


def test_exact_names_on_platforms_are_not_wildcards():
    assert as_tuples("version: 1\nrules:\n  - id: r\n    hosts: [mybucket.s3.amazonaws.com]\n") == []


CREDENTIALS = """\
version: 1
secrets:
  TOKEN: {env: TOKEN}
rules:
  - id: r
    hosts: %s
%s    inject:
      - header: Authorization
        value: "Bearer ${secrets.TOKEN}"
"""


@pytest.mark.parametrize(
    "hosts, extra, why",
    [
        ("[api.example.com]", "", "any method to any path"),
        ("[a.example.com, b.example.com, c.example.com]", "    methods: [GET]\n", "3 hosts"),
        ('["*.example.com"]', "    allow_wildcard_credentials: true\n    paths: [/v1/**]\n",
         "non-exact hosts (*.example.com)"),
        ('["198.51.100.0/24"]', "    allow_wildcard_credentials: true\n    methods: [GET]\n",
         "non-exact hosts (198.51.100.0/24)"),
    ],
)
def test_broad_credentials(hosts, extra, why):
    text = CREDENTIALS % (hosts, extra)
    result = findings(text)
    assert [(f.code, f.location.line, f.location.column, f.path) for f in result] == [
        ("broad-credentials", extra.count("\n") + 7, 5, "rules[0].inject")]
    assert why in result[0].message
    assert "injects TOKEN" in result[0].message


@pytest.mark.parametrize("extra", ["    methods: [POST]\n", "    paths: [/v1/**]\n"])
def test_narrow_credentials_are_fine(extra):
    assert findings(CREDENTIALS % ("[api.example.com, api2.example.com]", extra)) == []


def test_static_host_denied():
    text = """\
    version: 1
    network:
      allow_ip_ranges: [10.20.30.0/24]
    resolver:
      static_hosts:
        mirror.internal: [10.20.30.5, 10.20.31.5]
        metadata.internal: ["fd00:ec2::254"]
        public.example: [151.101.0.223]
    """
    result = findings(text)
    assert [(f.code, f.location.line, f.location.column, f.path) for f in result] == [
        ("static-host-denied", 6, 35, "resolver.static_hosts.mirror.internal[1]"),
        ("static-host-denied", 7, 25, "resolver.static_hosts.metadata.internal[0]"),
    ]
    assert "10.20.31.5: in deny range 10.0.0.0/8" in result[0].message


def test_static_host_in_an_explicit_deny_list():
    text = "version: 1\nnetwork:\n  deny_ip_ranges: [151.101.0.0/16]\nresolver:\n  static_hosts:\n    a.example: [151.101.0.1]\n"
    assert as_tuples(text) == [("static-host-denied", 6, 17, "resolver.static_hosts.a.example[0]")]


# --------------------------------------------------------------------------------------------
# the command: text, --strict, json


def test_warnings_in_text_and_exit_status(tmp_path):
    path = write(tmp_path / "shadow.yaml", SHADOW)
    result = run_cli("check", path)
    assert result.status == 0
    assert result.stderr == (
        f"{path}:7:9: rules[1]: warning: rule narrow can never decide a request: earlier rule wide covers all its "
        "hosts with at least as wide schemes, ports, methods and paths [shadowed-rule]\n"
    )
    assert result.stdout.startswith(f"{path}: ok (2 rules, sha256 ")
    assert result.stdout.rstrip().endswith(", 1 warning")


def test_strict_turns_warnings_into_errors(tmp_path):
    shadow = write(tmp_path / "shadow.yaml", SHADOW)
    clean = write(tmp_path / "clean.yaml", "version: 1\nrules:\n  - id: a\n    hosts: [a.example]\n")
    result = run_cli("check", "--strict", clean, shadow)
    assert result.status == 1
    assert f"{clean}: ok (1 rules" in result.stdout
    assert f"{shadow}: FAILED (2 rules" in result.stdout
    assert "[shadowed-rule]" in result.stderr
    bad = write(tmp_path / "bad.yaml", BAD)
    assert run_cli("check", "--strict", clean, shadow, bad).status == 2
    assert run_cli("check", "--strict", clean).status == 0


def test_json_warnings(tmp_path):
    shadow = write(tmp_path / "shadow.yaml", SHADOW)
    clean = write(tmp_path / "clean.yaml", "version: 1\nrules:\n  - id: a\n    hosts: [a.example]\n")
    result = run_cli("check", "--format", "json", clean, shadow)
    assert result.status == 0
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert [f["file"] for f in report["files"]] == [str(clean), str(shadow)]
    assert [f["ok"] for f in report["files"]] == [True, True]
    assert report["files"][0]["warnings"] == [] and report["files"][0]["errors"] == []
    assert report["files"][0]["rules"] == 1 and len(report["files"][0]["sha256"]) == 64
    [warning] = report["files"][1]["warnings"]
    assert warning == {"file": str(shadow), "line": 7, "column": 9, "path": "rules[1]", "code": "shadowed-rule",
                       "message": findings(SHADOW, str(shadow))[0].message}
    strict = json.loads(run_cli("check", "--format", "json", "--strict", clean, shadow).stdout)
    assert [f["ok"] for f in strict["files"]] == [True, False]


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_passes_check_strict(path):
    result = run_cli("check", "--strict", path)
    assert result.status == 0, result.stderr
    assert result.stderr == ""
