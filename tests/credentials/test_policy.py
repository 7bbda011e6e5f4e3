"""Policies that would hand a credential to more than one exact host, or send it in clear text,
do not load unless they say so explicitly; neither does a reference to an undeclared secret. The
gateway refuses to start with them (exit 2, the error naming file, line, column and key)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.gateway import PROJECT_ROOT, free_port

HEAD = """\
version: 1
secrets:
  token: {env: SOME_TOKEN}
rules:
"""

POLICIES = {
    "plaintext": ("""\
  - id: api
    hosts: [api.example.com]
    schemes: [http, https]
    inject:
      - header: Authorization
        value: "Bearer ${secrets.token}"
""", "rules[0].inject", "credentials would be sent over plain http; set allow_plaintext_credentials: true"),
    "plaintext-http-only": ("""\
  - id: api
    hosts: [api.example.com]
    schemes: [http]
    inject:
      - query: key
        value: "${secrets.token}"
""", "rules[0].inject", "allow_plaintext_credentials"),
    "wildcard": ("""\
  - id: wild
    hosts: [api.example.com, "*.example.com"]
    inject:
      - header: Authorization
        value: "Bearer ${secrets.token}"
""", "rules[0].inject", "credentials bound to *.example.com (not an exact host); "
                        "set allow_wildcard_credentials: true"),
    "unknown-secret": ("""\
  - id: api
    hosts: [api.example.com]
    inject:
      - header: Authorization
        value: "Bearer ${secrets.nope}"
""", "rules[0].inject[0].value", "unknown secret 'nope'"),
}

ALLOWED = """\
  - id: api
    hosts: [api.example.com]
    schemes: [http, https]
    allow_plaintext_credentials: true
    inject:
      - header: Authorization
        value: "Bearer ${secrets.token}"
  - id: wild
    hosts: ["*.example.org"]
    allow_wildcard_credentials: true
    inject:
      - header: X-Key
        value: "${secrets.token}"
"""


def gateway_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), SOME_TOKEN="value-never-printed-123")
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def policy_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("policies")
    files = {}
    for name, (rules, _, _) in POLICIES.items():
        files[name] = directory / f"{name}.yaml"
        files[name].write_text(HEAD + rules)
    files["allowed"] = directory / "allowed.yaml"
    files["allowed"].write_text(HEAD + ALLOWED)
    return files


def test_check_refuses_each_with_a_clear_error(policy_files):
    names = list(POLICIES)
    result = gateway_cli("check", *[str(policy_files[n]) for n in names])
    assert result.returncode == 2, result
    for name in names:
        _, key, message = POLICIES[name]
        lines = [line for line in result.stderr.splitlines() if line.startswith(str(policy_files[name]) + ":")]
        assert any(f": {key}: " in line and message in line for line in lines), (name, result.stderr)
    assert "value-never-printed-123" not in result.stdout + result.stderr


def test_check_json_names_the_key(policy_files):
    result = gateway_cli("check", "--format", "json", str(policy_files["wildcard"]))
    assert result.returncode == 2
    [entry] = json.loads(result.stdout)["files"]
    assert entry["ok"] is False
    [error] = entry["errors"]
    assert error["path"] == "rules[0].inject" and (error["line"], error["column"]) == (8, 7)
    assert POLICIES["wildcard"][2] in error["message"]


def test_explicit_flags_make_them_load(policy_files):
    result = gateway_cli("check", str(policy_files["allowed"]))
    assert result.returncode == 0, result.stderr
    assert ": ok (2 rules" in result.stdout


@pytest.mark.parametrize("name", ["plaintext", "wildcard"])
def test_gateway_does_not_start_with_them(policy_files, tmp_path, name):
    port = free_port()
    result = gateway_cli("run", "--policy", str(policy_files[name]), "--mode", f"regular@127.0.0.1:{port}",
                         "--confdir", str(tmp_path / "confdir"), "--audit-log", str(tmp_path / "audit.jsonl"))
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    _, key, message = POLICIES[name]
    output = result.stdout + result.stderr
    assert message in output and key in output and str(policy_files[name]) in output, output[-2000:]
    assert "value-never-printed-123" not in output
