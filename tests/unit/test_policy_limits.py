"""The policy's `limits:` keys (gateway/policy.py): parsed values, and errors naming file:line:key."""

from __future__ import annotations

import pytest

from gateway.policy import NO_LIMITS, Limits, PolicyError, compile_policy

BASE = """version: 1
secrets:
  TOKEN: {env: TOKEN}
rules:
  - id: api
    hosts: [api.example.com]
    inject:
      - header: Authorization
        value: "Bearer ${secrets.TOKEN}"
    limits:
      requests_per_minute: 600
      upload_bytes_per_hour: 100MiB
      download_bytes_per_hour: 1.5GB
      requests_per_credential_per_minute: 50
  - id: plain
    hosts: [example.com]
sandboxes:
  - id: agent
    source_ips: [10.1.0.0/16]
    rules: [api, plain]
    limits:
      requests_per_minute: 1000
      download_bytes_per_hour: 1073741824
"""


def test_limits_parse_with_sizes():
    policy = compile_policy(BASE, "p.yaml")
    api = policy.rules_by_id["api"]
    assert api.limits == Limits(600, 100 * 2**20, 1_500_000_000, 50)
    assert policy.rules_by_id["plain"].limits is NO_LIMITS and not policy.rules_by_id["plain"].limits
    assert policy.sandbox_limits("agent") == Limits(requests_per_minute=1000, download_bytes_per_hour=2**30)
    assert policy.sandbox_limits(None) is NO_LIMITS and policy.sandbox_limits("nobody") is NO_LIMITS
    assert api.limits.items()[0] == ("requests_per_minute", 600)


@pytest.mark.parametrize("old, new, path, line, words", [
    ("requests_per_minute: 600", "requests_per_minute: ten", "rules[0].limits.requests_per_minute", 11,
     "whole number"),
    ("requests_per_minute: 600", "requests_per_minute: 0", "rules[0].limits.requests_per_minute", 11,
     "at least 1"),
    ("requests_per_minute: 600", "requests_per_minute: 1.5", "rules[0].limits.requests_per_minute", 11,
     "whole number"),
    ("upload_bytes_per_hour: 100MiB", "upload_bytes_per_hour: 100 MiBs", "rules[0].limits.upload_bytes_per_hour",
     12, "size"),
    ("upload_bytes_per_hour: 100MiB", "upload_bytes_per_hour: true", "rules[0].limits.upload_bytes_per_hour",
     12, "bytes"),
    ("download_bytes_per_hour: 1.5GB", "downloads_per_hour: 1", "rules[0].limits.downloads_per_hour", 13,
     "unknown key"),
    ("  requests_per_minute: 1000", "  requests_per_minute: -1", "sandboxes[0].limits.requests_per_minute", 22,
     "at least 1"),
])
def test_errors_name_file_line_and_key(old, new, path, line, words):
    text = BASE.replace(old, new, 1)
    with pytest.raises(PolicyError) as info:
        compile_policy(text, "p.yaml")
    issues = [i for i in info.value.issues if i.path == path]
    assert issues, [str(i) for i in info.value.issues]
    assert issues[0].location.line == line
    assert str(issues[0]).startswith(f"p.yaml:{line}:") and words in str(issues[0])


def test_a_credential_budget_needs_a_rule_that_injects():
    text = BASE.replace("    hosts: [example.com]\n", "    hosts: [example.com]\n    limits:\n"
                        "      requests_per_credential_per_minute: 5\n")
    with pytest.raises(PolicyError) as info:
        compile_policy(text, "p.yaml")
    assert [i.path for i in info.value.issues] == ["rules[1].limits.requests_per_credential_per_minute"]


@pytest.mark.parametrize("extra, path", [
    ("    inspect: false\n", "rules[1].limits"),
    ("    protocol: tcp\n    ports: [5432]\n", "rules[1].limits"),
])
def test_limits_need_requests_to_count(extra, path):
    text = BASE.replace("    hosts: [example.com]\n", "    hosts: [example.com]\n" + extra
                        + "    limits:\n      requests_per_minute: 5\n")
    with pytest.raises(PolicyError) as info:
        compile_policy(text, "p.yaml")
    assert path in [i.path for i in info.value.issues]


def test_an_empty_limits_mapping_is_an_error():
    with pytest.raises(PolicyError) as info:
        compile_policy(BASE.replace("      requests_per_minute: 1000\n      download_bytes_per_hour: 1073741824\n",
                                    "      {}\n").replace("    limits:\n      {}", "    limits: {}"), "p.yaml")
    assert "sandboxes[0].limits" in [i.path for i in info.value.issues]


def test_explain_and_policy_test_show_the_limits_that_count_a_request(tmp_path):
    from gateway.explain import explain, render_text
    from gateway.policytest import render_text as test_text, run_file

    policy = compile_policy(BASE, "p.yaml")
    e = explain(policy, "https://api.example.com/v1", "POST", sandbox="agent", addresses=[])
    assert [(x.owner, x.key, x.value, x.reason) for x in e.limits] == [
        ("sandbox agent", "requests_per_minute", 1000, "rate_limited"),
        ("sandbox agent", "download_bytes_per_hour", 2**30, "download_quota_exceeded"),
        ("rule api", "requests_per_minute", 600, "rate_limited"),
        ("rule api", "upload_bytes_per_hour", 100 * 2**20, "upload_quota_exceeded"),
        ("rule api", "download_bytes_per_hour", 1_500_000_000, "download_quota_exceeded"),
        ("rule api", "requests_per_credential_per_minute", 50, "credential_rate_limited"),
    ]
    assert "secrets.TOKEN: one count shared by every rule that injects it and every sandbox" in render_text(e)
    assert e.as_dict()["limits"][0]["key"] == "requests_per_minute"
    refused = explain(policy, "https://nowhere.example.com/", sandbox="agent", addresses=[])
    assert refused.limits == []  # a refused request counts against nothing

    (tmp_path / "policy.yaml").write_text(BASE)
    (tmp_path / "cases.yaml").write_text("policy: policy.yaml\ncases:\n  - url: https://example.com/\n"
                                         "    sandbox: agent\n    expect: allow\n")
    text = test_text([run_file(tmp_path / "cases.yaml")], verbose=True)
    assert "limit: sandbox agent: requests_per_minute 1000 requests" in text


def test_a_credential_counter_is_one_per_secret_and_survives_while_any_rule_limits_it():
    """The rule-level credential counter is keyed by the secret alone (not the rule): every rule that
    injects it shares it, and a reload keeps it while some rule still limits that secret."""
    from addons.rate_limits import limit_of

    two = """version: 1
secrets:
  TOKEN: {env: TOKEN}
rules:
  - id: a
    hosts: [a.example.com]
    inject: [{header: Authorization, value: "Bearer ${secrets.TOKEN}"}]
    limits: {requests_per_credential_per_minute: 5}
  - id: b
    hosts: [b.example.com]
    inject: [{header: Authorization, value: "Bearer ${secrets.TOKEN}"}]
    limits: {requests_per_credential_per_minute: 3}
"""
    key = ("credential", None, None, "TOKEN", "requests_per_credential_per_minute", None)
    assert limit_of(compile_policy(two, "p.yaml"), key) == 3  # the strictest rule's, until a rule uses it
    one = two.replace("    limits: {requests_per_credential_per_minute: 3}\n", "")
    assert limit_of(compile_policy(one, "p.yaml"), key) == 5
    none = one.replace("    limits: {requests_per_credential_per_minute: 5}\n", "")
    assert limit_of(compile_policy(none, "p.yaml"), key) is None
