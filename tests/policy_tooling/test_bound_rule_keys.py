"""The policy keys of the two bound-rule leak classes (issue 13): `foreign_credentials` (top level and
per rule) and `placeholders` (per rule). The loader resolves defaults and overrides and names
file:line:column and key for every mistake; `check` warns when a bound host is also reachable
through an unbound rule; `explain` and `replay` judge a URL as the gateway would."""

from __future__ import annotations

import json
import textwrap

import pytest

from gateway.explain import explain
from gateway.foreign import DEFAULT_HEADERS, DEFAULT_QUERY
from gateway.lint import lint
from gateway.policy import PolicyError, compile_policy
from gateway.replay import parse_audit, replay

from .helpers import run_cli, write
from .test_replay import audit, request

PH = "egress-placeholder-K-" + "3f" * 20

BASE = """\
version: 1
secrets:
  K: {env: K}
"""


def source(text: str) -> str:
    return BASE + textwrap.dedent(text)


def load(text: str):
    return compile_policy(source(text), "p.yaml")


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load(text)
    return [f"{i.location.line}:{i.location.column}: {i.path}: {i.message}" for i in info.value.issues]


def test_defaults_apply_to_every_bound_rule():
    policy = load("""\
    rules:
      - id: api
        hosts: [api.example.com]
        inject: [{header: X-Api-Key, value: "${secrets.K}"}]
    """)
    rule = policy.rules_by_id["api"]
    assert rule.foreign_credentials.headers == DEFAULT_HEADERS
    assert rule.foreign_credentials.query == DEFAULT_QUERY
    assert rule.placeholders.query == frozenset() and rule.placeholders.path is False


def test_a_rules_list_replaces_the_policys_list_by_list():
    policy = load("""\
    foreign_credentials:
      headers: [Authorization, X-Partner-Token]
    rules:
      - id: inherits
        hosts: [a.example.com]
        inject: [{header: X-Api-Key, value: "${secrets.K}"}]
      - id: own-query
        hosts: [b.example.com]
        inject: [{header: X-Api-Key, value: "${secrets.K}"}]
        foreign_credentials: {query: [token]}
        placeholders: {query: [api_key, sig], path: true}
      - id: nothing
        hosts: [c.example.com]
        inject: [{header: X-Api-Key, value: "${secrets.K}"}]
        foreign_credentials: {headers: [], query: []}
    """)
    inherits, own, off = (policy.rules_by_id[i] for i in ("inherits", "own-query", "nothing"))
    assert inherits.foreign_credentials.headers == ("Authorization", "X-Partner-Token")
    assert inherits.foreign_credentials.query == DEFAULT_QUERY
    assert own.foreign_credentials.headers == ("Authorization", "X-Partner-Token")
    assert own.foreign_credentials.query == ("token",)
    assert own.placeholders.query == frozenset({"api_key", "sig"}) and own.placeholders.path
    assert off.foreign_credentials.headers == () and off.foreign_credentials.query == ()


def test_mistakes_name_file_line_column_and_key():
    found = errors("""\
    foreign_credentials:
      headers: [Authorization, "X Api", x_api_key, X-Api-Key]
      query: [key, "a=b"]
      cookie: [s]
    rules:
      - id: unbound
        hosts: [a.example.com]
        foreign_credentials: {query: []}
        placeholders: {path: true}
      - id: bound
        hosts: [b.example.com]
        inject: [{header: X-Api-Key, value: "${secrets.K}"}]
        placeholders: {query: [api_key, api_key], path: "no"}
        foreign_credentials: [Authorization]
    """)
    assert found == [
        "5:28: foreign_credentials.headers[1]: 'X Api' is not a valid header name",
        "5:48: foreign_credentials.headers[3]: 'X-Api-Key' is listed twice (as 'x_api_key': names are compared "
        "case-insensitively, '_' as '-')",
        "6:16: foreign_credentials.query[1]: 'a=b': a query parameter name is 1-64 printable ASCII characters, "
        "without '&', '=', '#', '?' or spaces",
        "7:3: foreign_credentials.cookie: unknown key (allowed: headers, query)",
        "11:26: rules[0].foreign_credentials: applies only to a rule that injects credentials (inject)",
        "12:19: rules[0].placeholders: applies only to a rule that injects credentials (inject)",
        "16:37: rules[1].placeholders.query[1]: 'api_key' is listed twice (as 'api_key')",
        "16:53: rules[1].placeholders.path: must be true or false",
        "17:26: rules[1].foreign_credentials: must be a mapping, not a list",
    ]


def test_check_warns_about_a_bound_host_an_unbound_rule_also_allows(tmp_path):
    text = """\
    rules:
      - id: openai
        hosts: [api.openai.com]
        methods: [POST]
        paths: [/v1/chat/completions]
        inject: [{header: Authorization, value: "Bearer ${secrets.K}"}]
      - id: openai-files
        hosts: ["*.openai.com"]
        methods: [GET]
      - id: bound-too
        hosts: [api.openai.com]
        paths: [/v1/models]
        inject: [{header: X-Other, value: "${secrets.K}"}]
    """
    findings = lint(load(text), source(text))
    bound = [f for f in findings if f.code == "bound-host-also-unbound"]
    assert [(f.location.line, f.location.column, f.path) for f in bound] == [(6, 13, "rules[0].hosts[0]"),
                                                                             (14, 13, "rules[2].hosts[0]")]
    assert "rule openai-files also allows it without any" in bound[0].message
    # not when no sandbox may use the unbound rule (unused-rule says that), nor for other hosts
    scoped = source(text) + "sandboxes:\n  - id: ci\n    source_ips: [10.0.0.0/8]\n    rules: [openai]\n"
    assert not [f for f in lint(compile_policy(scoped, "p.yaml"), scoped) if f.code == "bound-host-also-unbound"]
    path = write(tmp_path / "p.yaml", source(text))
    result = run_cli("check", "--strict", "--format", "json", path)
    assert result.status == 1
    codes = [w["code"] for w in json.loads(result.stdout)["files"][0]["warnings"]]
    assert codes.count("bound-host-also-unbound") == 2


MAPS = """\
rules:
  - id: maps
    hosts: [maps.example.com]
    methods: [GET]
    inject: [{header: X-Goog-Api-Key, value: "${secrets.K}"}]
    placeholders: {query: [api_key]}
  - id: maps-report
    hosts: [report.example.com]
    mode: report
    paths: [/ok]
    inject: [{header: X-Goog-Api-Key, value: "${secrets.K}"}]
"""


@pytest.mark.parametrize("url, verdict, reason", [
    ("https://maps.example.com/geo?q=1", "allow", "allowed"),
    ("https://maps.example.com/geo?api_key=" + PH, "allow", "allowed"),
    ("https://maps.example.com/geo?key=mine", "deny", "foreign_credential"),
    ("https://maps.example.com/geo?Access_Token=mine", "deny", "foreign_credential"),
    ("https://maps.example.com/geo?q=%2" + PH, "deny", "placeholder_misuse"),
    ("https://maps.example.com/geo?key=" + PH, "deny", "placeholder_misuse"),
    ("https://maps.example.com/" + PH, "deny", "placeholder_misuse"),
    ("https://report.example.com/other?key=mine", "deny", "foreign_credential"),  # report mode is no way around
    ("https://report.example.com/other?q=" + PH, "would_deny", "path_not_allowed"),  # nothing is swapped there
])
def test_explain_judges_the_url_as_the_gateway_would(url, verdict, reason):
    e = explain(load(MAPS), url)
    assert (e.verdict, e.decision.reason) == (verdict, reason), e.decision.message
    if reason == "foreign_credential":
        assert "query parameter" in e.decision.message and "mine" not in e.decision.message
    if e.decision.rule == "maps":
        assert any("placeholders: rule maps swaps them only as" in n for n in e.notes)
        assert any("foreign credentials: rule maps refuses" in n for n in e.notes)


def test_replay_redecides_recorded_urls_and_skips_header_refusals(tmp_path):
    policy = load(MAPS)
    log = audit(tmp_path,
                request("/geo?key=mine", host="maps.example.com", rule="maps", injected=["K"]),
                request("/geo?q=1", host="maps.example.com", rule="maps", injected=["K"]),
                request("/geo", host="maps.example.com", rule="maps", decision="deny", reason="foreign_credential"),
                request("/geo", host="maps.example.com", rule="maps", decision="deny", reason="placeholder_misuse"))
    records, result = parse_audit(log.read_text().splitlines())
    result = replay(policy, records, result)
    summary = result.summary()
    assert summary["newly_denied"] == 1 and summary["unchanged"] == 1
    assert [c.new.reason for c in result.changes] == ["foreign_credential"]
    assert summary["skipped_by_cause"] == {
        "reason foreign_credential (depends on request headers, which are not recorded)": 1,
        "reason placeholder_misuse (depends on request headers, which are not recorded)": 1,
    }
