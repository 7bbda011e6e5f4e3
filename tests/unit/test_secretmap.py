"""gateway/secretmap.py: which rules carry which secret where, and the proof that it goes nowhere else.

Several secrets, wildcards and CIDRs with their allowance, plain http with its allowance, sandboxes
granting subsets, report mode, unused and ungranted secrets, every overlap with an unbound rule,
foreign credentials turned off; and the load rules that make (b), (c) and passthrough failures
impossible, shown twice: the loader refuses them, and a policy built past the loader still gets
no credential there (the engine's credential_refusal), with the property failing loudly.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from gateway.lint import lint
from gateway.matcher import HostIndex, HostPattern
from gateway.policy import PolicyError, compile_policy
from gateway.secretmap import PROPERTIES, render_text, secret_map

POLICY = """\
version: 1
secrets:
  A: {env: A_TOKEN}
  B: {file: /run/secrets/b}
  C: {env: C_UNUSED}
  D: {env: D_HIDDEN}
rules:
  - id: api
    hosts: [api.example.com]
    methods: [GET]
    paths: ["/v1/**"]
    inject:
      - header: Authorization
        value: "Bearer ${secrets.A}"
      - query: sig
        value: "${secrets.B}"
    placeholders: {query: [key], path: true}
  - id: cdn
    hosts: ["*.cdn.example.net"]
    ports: [443, 8443]
    methods: [GET]
    allow_wildcard_credentials: true
    inject: [{header: X-Key, value: "${secrets.A}"}]
  - id: plain
    hosts: [plain.example.org]
    schemes: [http, https]
    methods: [POST]
    allow_plaintext_credentials: true
    inject: [{header: X-Key, value: "k=${secrets.B}"}]
  - id: lan
    hosts: [198.51.100.0/24]
    methods: [GET]
    allow_wildcard_credentials: true
    inject: [{header: X-Key, value: "${secrets.A}"}]
  - id: literal
    hosts: [203.0.113.7]
    methods: [GET]
    inject: [{header: X-Key, value: "${secrets.B}"}]
  - id: trial
    hosts: [trial.example.com]
    mode: report
    methods: [GET]
    inject: [{header: X-Key, value: "${secrets.A}"}]
  - id: hidden
    hosts: [hidden.example.com]
    methods: [GET]
    inject: [{header: X-Key, value: "${secrets.D}"}]
  - id: open
    hosts: [other.example.com]
sandboxes:
  - id: ci
    source_ips: [10.8.0.0/16]
    rules: [api, cdn, plain, lan, literal, trial, open]
  - id: default
    rules: [api]
"""


def load(text: str = POLICY):
    text = textwrap.dedent(text)
    return compile_policy(text, "p.yaml"), text


def build(text: str = POLICY, **kw):
    policy, text = load(text)
    return secret_map(policy, text, **kw)


def rules_of(m, secret):
    return [b.rule.id for b in m.entry(secret).bindings]


def binding(m, secret, rule):
    return next(b for b in m.entry(secret).bindings if b.rule.id == rule)


def test_every_rule_that_carries_each_secret():
    m = build()
    assert [e.name for e in m.entries] == ["A", "B", "C", "D"]
    assert rules_of(m, "A") == ["api", "cdn", "lan", "trial"]
    assert rules_of(m, "B") == ["api", "plain", "literal"]
    assert m.entry("A").status == "bound" and m.entry("B").status == "bound"
    assert m.entry("C").status == "unused" and m.entry("C").referenced_by == ()
    assert m.entry("D").status == "ungranted" and m.entry("D").referenced_by == ("hidden",)
    assert m.entry("A").source == {"env": "A_TOKEN"} and m.entry("B").source == {"file": "/run/secrets/b"}
    assert m.entry("A").declared_at.line == 3 and m.entry("C").declared_at.line == 5
    doc = m.as_dict()
    assert doc["unused"] == ["C"] and doc["ungranted"] == ["D"] and doc["declared"] == ["A", "B", "C", "D"]


def test_destinations_are_exactly_what_the_engine_allows():
    m = build()
    api = binding(m, "A", "api")
    assert [h.as_dict() for h in api.hosts] == [{"host": "api.example.com", "kind": "name", "allowed_by": None}]
    assert api.ports == {"https": (443,)} and api.methods == ("GET",) and api.paths == ("/v1/**",)
    cdn = binding(m, "A", "cdn")
    assert [h.as_dict() for h in cdn.hosts] == [
        {"host": "*.cdn.example.net", "kind": "wildcard", "allowed_by": "allow_wildcard_credentials"}]
    assert cdn.ports == {"https": (443, 8443)}
    lan = binding(m, "A", "lan")
    assert [(h.kind, h.allowed_by) for h in lan.hosts] == [("cidr", "allow_wildcard_credentials")]
    literal = binding(m, "B", "literal")
    assert [(h.host, h.kind, h.allowed_by) for h in literal.hosts] == [("203.0.113.7", "ip", None)]
    plain = binding(m, "B", "plain")
    assert plain.schemes == ("https", "http") and plain.ports == {"https": (443,), "http": (80,)}
    assert all(b.refused == () for e in m.entries for b in e.bindings)


def test_default_methods_are_every_standard_method():
    m = build("""\
    version: 1
    secrets: {K: {env: K}}
    rules:
      - id: any
        hosts: [api.example.com]
        inject: [{header: X-Key, value: "${secrets.K}"}]
    """)
    b = binding(m, "K", "any")
    assert b.methods == ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT") and b.paths is None
    assert b.sandboxes is None and m.entry("K").sandboxes is None


def test_where_each_secret_is_written():
    m = build()
    a = [w.as_dict() for w in binding(m, "A", "api").writes]
    assert a[0] == {"via": "inject", "target": "header", "name": "Authorization", "template": "Bearer ${secrets.A}",
                    "defined_at": {"file": "p.yaml", "line": 13, "column": 9}}
    assert [(w["via"], w["target"], w["name"]) for w in a[1:]] == [
        ("placeholder", "header", None), ("placeholder", "query", "key"), ("placeholder", "path", None)]
    b = [(w.via, w.target, w.name, w.template) for w in binding(m, "B", "api").writes]
    assert b[0] == ("inject", "query", "sig", "${secrets.B}")
    # the injector swaps placeholders of every secret the rule is bound to, in the rule's positions
    assert [w[:3] for w in b[1:]] == [("placeholder", "header", None), ("placeholder", "query", "key"),
                                      ("placeholder", "path", None)]
    assert [(w.via, w.target) for w in binding(m, "A", "cdn").writes] == [("inject", "header"), ("placeholder", "header")]


def test_template_text_keeps_literal_dollar_braces():
    m = build("""\
    version: 1
    secrets: {K: {env: K}}
    rules:
      - id: r
        hosts: [api.example.com]
        methods: [GET]
        inject: [{header: X-Key, value: "$${literal} ${secrets.K}"}]
    """)
    assert binding(m, "K", "r").writes[0].template == "$${literal} ${secrets.K}"


def test_sandboxes_granted_each_rule_and_a_sandbox_scope():
    policy, text = load()
    m = secret_map(policy, text)
    assert binding(m, "A", "api").sandboxes == ("ci", "default")
    assert binding(m, "A", "cdn").sandboxes == ("ci",)
    assert m.entry("A").sandboxes == ("ci", "default")
    scoped = secret_map(policy, text, policy.scope_for(sandbox_id="default"))
    assert scoped.sandbox == "default"
    assert rules_of(scoped, "A") == ["api"] and rules_of(scoped, "B") == ["api"]
    assert scoped.entry("D").status == "ungranted"
    ci = secret_map(policy, text, policy.scope_for(sandbox_id="ci"))
    assert rules_of(ci, "A") == ["api", "cdn", "lan", "trial"]


def test_report_mode_is_stated_per_rule():
    m = build()
    assert binding(m, "A", "trial").mode == "report" and binding(m, "A", "api").mode == "enforce"
    text = render_text(m)
    assert "requests it would deny are let through (would_deny) with no credential" in text
    whole = build(POLICY.replace("version: 1\n", "version: 1\nmode: report\n", 1))
    assert {b.mode for e in whole.entries for b in e.bindings} == {"report"}


def test_the_proof_holds_and_names_the_allowances():
    m = build()
    props = {p.id: p for p in m.properties}
    assert list(props) == list(PROPERTIES)
    assert m.holds, [str(f) for p in m.properties for f in p.findings]
    assert any("rule plain" in x and "allow_plaintext_credentials" in x for x in props["https-only"].exceptions)
    wild = props["exact-hosts-only"].exceptions
    assert any("rule cdn" in x for x in wild) and any("rule lan" in x for x in wild)
    assert not any("rule literal" in x for x in wild)  # an IP literal is an exact host


# --------------------------------------------------------------------------------------------
# (d) overlaps with unbound rules


OVERLAP = """\
version: 1
secrets: {K: {env: K}}
rules:
  - id: bound
    hosts: [api.example.com]
    methods: [GET]
    inject: [{header: X-Key, value: "${secrets.K}"}]
  - id: wide-open
    hosts: ["*.example.com"]
"""


def _overlaps(m):
    return next(p for p in m.properties if p.id == "no-unbound-overlap").findings


def test_an_unbound_rule_covering_a_bound_host_is_a_finding_the_lint_also_reports():
    policy, text = load(OVERLAP)
    m = secret_map(policy, text)
    [f] = _overlaps(m)
    assert (f.rule, f.host, f.other_rule, f.shared, f.code, f.lint_warning) == (
        "bound", "api.example.com", "wide-open", ("https:443",), "bound-host-also-unbound", True)
    assert f.defined_at.line == 4 and f.other_defined_at.line == 8 and f.secrets == ("K",)
    assert not m.holds
    assert any(w.code == "bound-host-also-unbound" for w in lint(policy, text))


def test_a_partial_overlap_the_lint_misses_is_still_a_finding():
    text = """\
    version: 1
    secrets: {K: {env: K}}
    rules:
      - id: bound
        hosts: ["*.example.com"]
        methods: [GET]
        allow_wildcard_credentials: true
        inject: [{header: X-Key, value: "${secrets.K}"}]
      - id: one-name
        hosts: [upload.example.com]
    """
    policy, source = load(text)
    [f] = _overlaps(secret_map(policy, source))
    assert f.other_rule == "one-name" and f.lint_warning is False
    assert not [w for w in lint(policy, source) if w.code == "bound-host-also-unbound"]


def test_other_ports_passthrough_and_raw_tcp_rules_overlap_too():
    text = """\
    version: 1
    secrets: {K: {env: K}}
    rules:
      - id: bound
        hosts: [api.example.com, 203.0.113.7]
        methods: [GET]
        inject: [{header: X-Key, value: "${secrets.K}"}]
      - id: other-port
        hosts: [api.example.com]
        ports: [8443]
      - id: relay
        hosts: [api.example.com]
        inspect: false
      - id: ssh
        protocol: tcp
        hosts: [203.0.113.0/24]
        ports: [22, 443]
    """
    found = {(f.other_rule, f.host): f for f in _overlaps(build(text))}
    assert set(found) == {("other-port", "api.example.com"), ("relay", "api.example.com"), ("ssh", "203.0.113.7")}
    assert found[("other-port", "api.example.com")].shared == ()
    assert "other ports or schemes only" in found[("other-port", "api.example.com")].message
    assert found[("relay", "api.example.com")].shared == ("https:443",)
    assert "inspect: false" in found[("relay", "api.example.com")].message
    assert found[("ssh", "203.0.113.7")].shared == ("tcp:443",)
    assert found[("ssh", "203.0.113.7")].lint_warning is False


def test_an_unbound_rule_no_sandbox_is_granted_is_no_overlap():
    text = OVERLAP + "sandboxes:\n  - id: ci\n    source_ips: [10.8.0.0/16]\n    rules: [bound]\n"
    assert _overlaps(build(text)) == ()
    granted = OVERLAP + ("sandboxes:\n  - id: ci\n    source_ips: [10.8.0.0/16]\n    rules: [bound]\n"
                         "  - id: other\n    source_ips: [10.9.0.0/16]\n    rules: [wide-open]\n")
    policy, source = load(granted)
    assert len(_overlaps(secret_map(policy, source))) == 1
    # within one sandbox's scope, only the rules it is granted count
    assert _overlaps(secret_map(policy, source, policy.scope_for(sandbox_id="ci"))) == ()


# --------------------------------------------------------------------------------------------
# (e) foreign credentials


def test_foreign_credentials_turned_off_is_a_finding():
    text = """\
    version: 1
    secrets: {K: {env: K}}
    rules:
      - id: quiet
        hosts: [api.example.com]
        methods: [GET]
        inject: [{header: X-Key, value: "${secrets.K}"}]
        foreign_credentials: {headers: []}
      - id: fine
        hosts: [b.example.com]
        methods: [GET]
        inject: [{header: X-Key, value: "${secrets.K}"}]
        foreign_credentials: {headers: [Authorization]}
    """
    m = build(text)
    [f] = next(p for p in m.properties if p.id == "foreign-credentials-on").findings
    assert f.rule == "quiet" and "foreign_credentials.headers: []" in f.message
    assert binding(m, "K", "quiet").as_dict()["foreign_credentials"] == {
        "headers": [], "query": ["key", "api_key", "access_token"]}


# --------------------------------------------------------------------------------------------
# (a), (b), (c), passthrough: impossible by load rules, and refused again at request time


BOUND = """\
version: 1
secrets: {K: {env: K}}
rules:
  - id: r
    hosts: [api.example.com]
    methods: [GET]
    inject: [{header: X-Key, value: "${secrets.K}"}]
"""


@pytest.mark.parametrize("extra, message", [
    ("    hosts: [\"*.example.com\"]\n", "allow_wildcard_credentials"),
    ("    hosts: [198.51.100.0/24]\n", "allow_wildcard_credentials"),
    ("    schemes: [http]\n", "allow_plaintext_credentials"),
    ("    inspect: false\n", "cannot be injected into an uninspected"),
    ("    protocol: tcp\n    ports: [22]\n", "cannot inject credentials"),
])
def test_the_loader_refuses_what_the_properties_rule_out(extra, message):
    text = BOUND.replace("    hosts: [api.example.com]\n", "") + extra
    if "hosts" not in extra:
        text = BOUND + extra
    with pytest.raises(PolicyError) as info:
        compile_policy(text, "p.yaml")
    assert message in str(info.value)


def _past_the_loader(**changes):
    policy, text = load(BOUND)
    rule = dataclasses.replace(policy.rules[0], **changes)
    index = HostIndex.build((p, rule.index) for p in rule.hosts)
    return secret_map(dataclasses.replace(policy, rules=(rule,), index=index), text)


def _failing(m):
    return {p.id: p.findings for p in m.properties if not p.holds}


def test_plain_http_past_the_loader_fails_https_only_and_gets_no_credential():
    m = _past_the_loader(schemes=frozenset({"http", "https"}))
    assert list(_failing(m)) == ["https-only"]
    b = binding(m, "K", "r")
    assert b.schemes == ("https",)  # credential_refusal: plaintext_credentials
    assert [x.as_dict() for x in b.refused] == [
        {"host": "api.example.com", "scheme": "http", "reason": "plaintext_credentials"}]


def test_a_wildcard_past_the_loader_fails_exact_hosts_only_and_gets_no_credential():
    m = _past_the_loader(hosts=(HostPattern("exact", "api.example.com"), HostPattern.wildcard("example.com")))
    assert list(_failing(m)) == ["exact-hosts-only"]
    b = binding(m, "K", "r")
    assert [h.host for h in b.hosts] == ["api.example.com"]  # credential_refusal: credential_host
    assert [x.reason for x in b.refused] == ["credential_host"]


def test_passthrough_past_the_loader_fails_inspected_only():
    assert list(_failing(_past_the_loader(inspect=False))) == ["inspected-only"]


def test_a_duplicate_id_past_the_loader_fails_only_bound_rules():
    policy, text = load(BOUND + "  - id: r\n    hosts: [b.example.com]\n".replace("  - id: r", "  - id: s"))
    twin = dataclasses.replace(policy.rules[1], id="r")
    broken = dataclasses.replace(policy, rules=(policy.rules[0], twin))
    [f] = _failing(secret_map(broken, text))["only-bound-rules"]
    assert "rules_by_id" in f.message


def test_an_index_that_is_not_the_rules_hosts_fails_only_bound_rules():
    policy, text = load(BOUND)
    extra = HostIndex.build([(p, 0) for p in policy.rules[0].hosts] + [(HostPattern.wildcard("evil.example"), 0)])
    failing = _failing(secret_map(dataclasses.replace(policy, index=extra), text))
    assert "host index" in failing["only-bound-rules"][0].message


# --------------------------------------------------------------------------------------------
# text and JSON


def test_every_table_line_names_the_rule_and_where_it_is_defined():
    m = build()
    lines = render_text(m).splitlines()
    for e in m.entries:
        for b in e.bindings:
            rows = [line for line in lines if line.startswith(f"  {b.rule.id} ")]
            assert rows, b.rule.id
            assert all(f"p.yaml:{b.rule.location.line}" in line for line in rows)
            assert any("to " in line for line in rows)
    text = "\n".join(lines)
    assert "https://api.example.com:443" in text and "https://*.cdn.example.net:{443,8443}" in text
    assert "http://plain.example.org:80" in text and "https://{198.51.100.0/24}:443" in text
    assert "secret C" in text and "[unused-secret]" in text
    assert "secret D" in text and "referenced by hidden" in text
    assert "proof, for the policy as written: holds" in text


def test_json_schema_keys_are_stable():
    doc = build().as_dict()
    assert set(doc) == {"version", "sandbox", "holds", "declared", "unused", "ungranted", "entries", "properties"}
    assert doc["version"] == 1
    entry = doc["entries"][0]
    assert set(entry) == {"name", "source", "declared_at", "status", "referenced_by", "sandboxes", "rules"}
    assert set(entry["rules"][0]) == {
        "rule", "index", "defined_at", "mode", "sandboxes", "hosts", "schemes", "ports", "methods", "paths",
        "writes", "foreign_credentials", "allow_wildcard_credentials", "allow_plaintext_credentials", "inspect",
        "protocol", "refused"}
    assert set(doc["properties"][0]) == {"id", "holds", "statement", "enforced_by", "exceptions", "findings"}
    finding = _overlaps(build(OVERLAP))[0].as_dict()
    assert set(finding) == {"property", "secrets", "rule", "defined_at", "message", "code", "host", "other_rule",
                            "other_defined_at", "shared", "lint_warning"}


def test_without_text_there_are_no_declaration_locations_but_rule_locations_remain():
    policy, _ = load()
    m = secret_map(policy)
    assert m.entry("A").declared_at is None
    assert binding(m, "A", "api").rule.location.line == 8
    assert binding(m, "A", "api").writes[0].defined_at is None
