"""`egress-gateway explain --secrets` and the `secrets` key of `check --format json`: the same map and
proof (gateway/secretmap.py), for a security team and for CI."""

from __future__ import annotations

import json

from gateway.policy import load_policy

from .helpers import POLICIES, run_cli, write

POLICY = """\
version: 1
secrets:
  GH: {env: GITHUB_TOKEN}
  MODEL: {file: /run/secrets/model}
  SPARE: {env: SPARE}
rules:
  - id: github
    hosts: [api.github.com]
    methods: [GET, POST]
    paths: ["/repos/example-org/**"]
    inject:
      - header: Authorization
        value: "Bearer ${secrets.GH}"
  - id: model
    hosts: [api.model.example]
    methods: [POST]
    paths: [/v1/messages]
    inject:
      - header: X-Api-Key
        value: "${secrets.MODEL}"
  - id: pypi
    hosts: [pypi.org]
sandboxes:
  - id: ci
    source_ips: [10.8.0.0/16]
    rules: [github, model, pypi]
  - id: default
    rules: [model]
"""

OVERLAP = POLICY.replace("    hosts: [pypi.org]\n", "    hosts: [pypi.org, api.github.com]\n")


def test_explain_secrets_prints_a_table_per_secret(tmp_path):
    path = write(tmp_path / "p.yaml", POLICY)
    result = run_cli("explain", "--secrets", "--policy", path)
    assert result.status == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"secrets in {path} ")
    assert "no secret is read" in out.splitlines()[0]
    assert "secret GH  (env GITHUB_TOKEN" in out and "secret MODEL  (file /run/secrets/model" in out
    github = load_policy(path).rules_by_id["github"]
    rows = [line for line in out.splitlines() if line.startswith("  github ")]
    assert rows and all(f"{path}:{github.location.line}" in line for line in rows)
    assert any("https://api.github.com:443" in line for line in rows)
    assert any("inject header Authorization: Bearer ${secrets.GH}" in line for line in rows)
    assert any("granted  ci" in line for line in rows)
    assert "secret SPARE" in out and "[unused-secret]" in out
    assert "proof, for the policy as written: holds" in out


def test_explain_secrets_for_one_sandbox(tmp_path):
    path = write(tmp_path / "p.yaml", POLICY)
    result = run_cli("explain", "--secrets", "--policy", path, "--sandbox", "default")
    assert result.status == 0, result.stderr
    assert ", for sandbox default:" in result.stdout
    assert not [line for line in result.stdout.splitlines() if line.startswith("  github ")]
    assert "carried by no rule granted to sandbox default: referenced by github" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("  model ")]


def test_explain_secrets_json_is_the_checks_secrets_key(tmp_path):
    path = write(tmp_path / "p.yaml", POLICY)
    explained = run_cli("explain", "--secrets", "--policy", path, "--format", "json")
    checked = run_cli("check", "--format", "json", path)
    assert explained.status == 0 and checked.status == 0
    doc = json.loads(explained.stdout)
    assert set(doc) == {"file", "sha256", "secrets"}
    [file_result] = json.loads(checked.stdout)["files"]
    assert file_result["secrets"] == doc["secrets"]
    secrets = doc["secrets"]
    assert secrets["version"] == 1 and secrets["holds"] is True and secrets["unused"] == ["SPARE"]
    gh = next(e for e in secrets["entries"] if e["name"] == "GH")
    [rule] = gh["rules"]
    assert rule["rule"] == "github" and rule["defined_at"]["file"] == str(path)
    assert rule["hosts"] == [{"host": "api.github.com", "kind": "name", "allowed_by": None}]
    assert rule["schemes"] == ["https"] and rule["ports"] == {"https": [443]}
    assert rule["methods"] == ["GET", "POST"] and rule["paths"] == ["/repos/example-org/**"]
    assert rule["sandboxes"] == ["ci"] and rule["mode"] == "enforce"


def test_findings_make_explain_secrets_exit_1_and_show_in_check_json(tmp_path):
    path = write(tmp_path / "p.yaml", OVERLAP)
    result = run_cli("explain", "--secrets", "--policy", path)
    assert result.status == 1
    assert "does NOT hold" in result.stdout
    assert "rule pypi" in result.stdout and "[bound-host-also-unbound]" in result.stdout
    checked = run_cli("check", "--format", "json", path)
    assert checked.status == 0  # warnings do not fail check without --strict
    [file_result] = json.loads(checked.stdout)["files"]
    overlap = next(p for p in file_result["secrets"]["properties"] if p["id"] == "no-unbound-overlap")
    assert overlap["holds"] is False
    [finding] = overlap["findings"]
    assert (finding["rule"], finding["other_rule"], finding["host"], finding["lint_warning"]) == (
        "github", "pypi", "api.github.com", True)
    assert any(w["code"] == "bound-host-also-unbound" for w in file_result["warnings"])


def test_check_json_secrets_is_null_for_a_file_that_does_not_load(tmp_path):
    path = write(tmp_path / "bad.yaml", "version: 1\nrules: [{id: a, hosts: ['*']}]\n")
    result = run_cli("check", "--format", "json", path)
    assert result.status == 2
    assert json.loads(result.stdout)["files"][0]["secrets"] is None


def test_check_text_output_is_unchanged_by_the_map(tmp_path):
    path = write(tmp_path / "p.yaml", POLICY)
    result = run_cli("check", path)
    assert result.status == 0
    assert result.stdout.startswith(f"{path}: ok (3 rules, sha256 ")


def test_bad_combinations_are_exit_2(tmp_path):
    path = write(tmp_path / "p.yaml", POLICY)
    assert run_cli("explain", "--policy", path).status == 2
    both = run_cli("explain", "--secrets", "--policy", path, "https://api.github.com/")
    assert both.status == 2 and "not both" in both.stderr
    unknown = run_cli("explain", "--secrets", "--policy", path, "--sandbox", "nope")
    assert unknown.status == 2 and "no sandbox 'nope'" in unknown.stderr
    method = run_cli("explain", "--secrets", "--policy", path, "-X", "POST")
    assert method.status == 2 and "does not take -X" in method.stderr


def test_explain_secrets_on_the_embedded_default_and_every_example():
    default = run_cli("explain", "--secrets")
    assert default.status == 0 and "0 declared" in default.stdout
    for path in sorted(POLICIES.glob("*.yaml")):
        result = run_cli("explain", "--secrets", "--policy", path)
        assert result.status == 0, (path, result.stdout)
        assert "proof, for the policy as written: holds" in result.stdout


def test_the_properties_and_every_json_key_are_documented(tmp_path):
    from gateway.secretmap import PROPERTIES

    docs = (POLICIES.parent / "docs" / "policy.md").read_text(encoding="utf-8")
    for prop in PROPERTIES:
        assert f"| `{prop}` |" in docs, prop
    path = write(tmp_path / "p.yaml", OVERLAP)
    doc = json.loads(run_cli("explain", "--secrets", "--policy", path, "--format", "json").stdout)["secrets"]
    entry = doc["entries"][0]
    rule = entry["rules"][0]
    prop = next(p for p in doc["properties"] if p["findings"])
    keys = set(doc) | set(entry) | set(rule) | set(rule["hosts"][0]) | set(rule["writes"][0]) | set(prop) \
        | set(prop["findings"][0])
    for key in keys:
        assert f'"{key}":' in docs, key
