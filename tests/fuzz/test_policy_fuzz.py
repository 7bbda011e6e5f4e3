"""Property/fuzz tests of the policy loader (gateway.policy.compile_policy).

Inputs: random YAML documents built from the policy's own key vocabulary (so they get past the
top-level checks and reach the deep validators), and mutations of valid policies (the shipped
examples and a policy using every key): line deletions and duplications, indentation shifts,
inserted YAML syntax (anchors, aliases, merge keys, tags, flow collections, tabs, BOM, NUL),
character flips and truncation.

Properties, for every input:
- the loader raises nothing but PolicyError;
- every error names the file, a line inside the document and a column (`FILE:LINE:COLUMN: `);
- an accepted policy is well formed: every rule has a non-empty host set of canonical patterns,
  ports in range, no TRACE/TRACK/CONNECT, unique ids, sandboxes naming existing rules.

Plus a regression test: YAML aliases cannot make a tiny file expensive to load (billion laughs).
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.hostnames import canonical_host
from gateway.policy import FORBIDDEN_METHODS, Policy, PolicyError, compile_policy

from .conftest import fuzz_settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SOURCE = "fuzz/policy.yaml"
LOCATED = re.compile(rf"^{re.escape(SOURCE)}:(\d+):(\d+): ")

FULL = textwrap.dedent("""\
    version: 1
    mode: enforce
    network:
      deny_ip_ranges: default
      allow_ip_ranges: [10.20.0.0/16, "fd12::/16"]
      strict_original_destination: false
    resolver:
      static_hosts:
        internal.example: [10.20.0.5, "2001:db8::5"]
        bücher.test: ["[fd12::7]"]
    secrets:
      TOKEN: {env: EGRESS_FUZZ_TOKEN}
      KEY: {file: /run/secrets/key}
    rules:
      - id: minimal
        hosts: [example.com]
      - id: everything
        hosts: ["*.example.org", API.Example.NET., 203.0.113.0/24, "[2001:db8::1]", 0xc6.51.100.7, bücher.de]
        ports: [443, 8443]
        schemes: [https, HTTP]
        methods: [GET, POST, PROPFIND]
        paths: ["/v1/**", /health, "/a/*/b?"]
        mode: report
      - id: creds
        hosts: [api.example.com]
        inject:
          - header: Authorization
            value: "Bearer ${secrets.TOKEN}"
          - query: key
            value: "$${literal} ${secrets.KEY}"
      - id: git-ssh
        protocol: tcp
        hosts: [203.0.113.7, 198.51.100.0/24, git.internal]
        ports: [22]
    sandboxes:
      - id: ci
        source_ips: [10.8.0.0/16]
        rules: [minimal, everything]
      - id: default
        rules: [minimal]
    """)
SEEDS = [FULL] + [p.read_text() for p in sorted((PROJECT_ROOT / "policies").glob("*.yaml"))]


def check(text: str) -> Policy | None:
    """Load `text`; assert the properties; return the policy if it loaded."""
    try:
        policy = compile_policy(text, SOURCE)
    except PolicyError as exc:
        lines = max(1, len(text.splitlines()))
        assert exc.issues, "a PolicyError without issues"
        for issue in exc.issues:
            assert issue.location.file == SOURCE, issue
            assert 1 <= issue.location.line <= lines + 1, (issue, lines)
            assert issue.location.column >= 1, issue
            assert issue.message, issue
        for line in str(exc).splitlines():
            if line.startswith(SOURCE):
                assert LOCATED.match(line), line
        first = str(exc).splitlines()[0]
        assert LOCATED.match(first), first
        return None
    assert_well_formed(policy)
    return policy


def assert_well_formed(policy: Policy) -> None:
    ids = [r.id for r in policy.rules]
    assert len(ids) == len(set(ids)), ids
    for rule in policy.rules:
        assert rule.hosts, f"rule {rule.id} was accepted with an empty host set"
        for pattern in rule.hosts:
            if pattern.kind == "exact":
                assert canonical_host(pattern.value if ":" not in pattern.value else f"[{pattern.value}]").value == pattern.value
            elif pattern.kind == "wildcard":
                host = canonical_host(pattern.value)
                assert host.value == pattern.value and not host.is_ip and "*" not in pattern.value
            else:
                assert isinstance(pattern.network, (ipaddress.IPv4Network, ipaddress.IPv6Network))
        if rule.ports is not None:
            assert rule.ports and all(type(p) is int and 1 <= p <= 65535 for p in rule.ports), rule.ports
        if rule.methods is not None:
            assert rule.methods and not rule.methods & FORBIDDEN_METHODS, rule.methods
        if rule.protocol == "http":
            assert rule.schemes and rule.schemes <= {"http", "https"}, rule.schemes
        else:
            assert rule.protocol == "tcp" and rule.ports
    for sandbox in policy.sandboxes or ():
        assert sandbox.rule_ids <= set(ids), sandbox
    for name, addresses in policy.static_hosts.items():
        assert canonical_host(name).value == name and addresses


# --------------------------------------------------------------------------------------------
# random documents from the policy's vocabulary

KEYS = ["version", "mode", "network", "resolver", "rules", "sandboxes", "secrets", "deny_ip_ranges",
        "allow_ip_ranges", "strict_original_destination", "static_hosts", "id", "hosts", "ports", "schemes",
        "methods", "paths", "protocol", "inject", "header", "query", "value", "env", "file", "source_ips",
        "allow_wildcard_credentials", "allow_plaintext_credentials", "<<"]
WORDS = ["default", "enforce", "report", "tcp", "http", "https", "HTTPS", "GET", "TRACE", "connect", "*",
         "*.", "*.*", "*.example.com", "a.*.com", "example.com", "EXAMPLE.com.", "bücher.de", "xn--a.com",
         "10.0.0.0/8", "10.0.0.1/8", "::/0", "[::1]", "::1", "0x7f.1", "127.1", "1.2.3.4:80", "a@b", "/v1/**",
         "v1", "/a/../b", "${secrets.TOKEN}", "${secrets.NOPE}", "$${x}", "Bearer ${secrets.A}", "TOKEN",
         "Host", "X-Api-Key", "/run/secrets/x", "relative/path", "", " ", "\t", "a\x00b", "\u3002", "\ud800x"]
SCALARS = st.one_of(
    st.sampled_from(WORDS), st.integers(-2, 70000), st.sampled_from([0, 1, 2, 22, 80, 443, 65535, 65536]),
    st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=12),
)


def documents():
    values = st.recursive(
        SCALARS,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6), st.integers(0, 3)), children,
                            max_size=5),
        ),
        max_leaves=25,
    )
    rule = st.fixed_dictionaries({"id": SCALARS, "hosts": st.one_of(values, st.lists(SCALARS, max_size=3))},
                                 optional={k: values for k in ("ports", "schemes", "methods", "paths", "protocol",
                                                               "mode", "inject")})
    return st.fixed_dictionaries(
        {"version": st.sampled_from([1, 1, 1, 2, "1", 1.0, None, True])},
        optional={"rules": st.one_of(st.lists(rule, max_size=4), values), "network": values, "resolver": values,
                  "sandboxes": values, "secrets": values, "mode": values},
    )


def dump(document) -> str | None:
    try:
        return yaml.safe_dump(document, allow_unicode=True, sort_keys=False)
    except (yaml.YAMLError, UnicodeEncodeError, TypeError, ValueError):
        return None


@fuzz_settings(150)
@given(documents())
def test_random_documents(document):
    text = dump(document)
    if text is not None:
        check(text)


@fuzz_settings(300)
@given(st.text(max_size=300))
@example("")
@example("\ufeffversion: 1\n")
@example("version: 1\nrules:\n  - id: a\n    hosts: []\n")
@example("version: 1\nrules:\n  - id: a\n    hosts: [!!python/object:os.system echo]\n")
@example("version: 1\n---\nversion: 1\n")
@example("version: 1\nrules:\n  - &x {id: a, hosts: [a.test]}\n  - <<: *x\n    id: b\n    hosts: []\n")
@example("version: 1\nrules:\n  - id: a\n    hosts: [\"\\x00\"]\n")
@example("version: 1\nrules:\n  - id: a\n    hosts: [\"*.\u3002com\"]\n")
@example("version: 1\n? [a, b]\n: c\n")
@example("version: 1\nrules:\n  - {id: a, hosts: [a.test], ports: [443.0]}\n")
def test_random_text(text):
    check(text)


# --------------------------------------------------------------------------------------------
# mutations of valid policies

INSERTS = ["&a ", "*a", "<<: *a", "!!python/object:os.system ", "!!binary ", "? ", "- ", ": ", "{", "}", "[", "]",
           "\t", "\ufeff", "\x00", "#", "'", '"', "|", ">", "---\n", "...\n", "%YAML 1.1\n", "*", ".", "/", "\\",
           "ü", "\u3002", "\n", "  ", "0x", "- id: dup\n", "hosts: []", "hosts: ['*']", "ports: [0]",
           "methods: [TRACE]", "id: minimal", "  - id: x\n    hosts: [\"\"]\n", "~", "null", "yes", "1e3", "0o17"]


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        op = draw(st.sampled_from(["delete", "duplicate", "indent", "dedent", "insert", "flip", "truncate",
                                   "swap", "empty-list"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "indent":
            lines[i] = "  " + lines[i]
        elif op == "dedent":
            lines[i] = lines[i][2:] if lines[i].startswith("  ") else lines[i].lstrip()
        elif op == "swap" and len(lines) > 1:
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "empty-list":
            lines[i] = re.sub(r"\[[^\]]*\]", "[]", lines[i])
        text = "\n".join(lines)
        if op == "insert":
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.sampled_from(INSERTS)) + text[at:]
        elif op == "flip" and text:
            at = draw(st.integers(0, len(text) - 1))
            text = text[:at] + chr(ord(text[at]) ^ (1 << draw(st.integers(0, 6)))) + text[at + 1 :]
        elif op == "truncate":
            text = text[: draw(st.integers(0, len(text)))]
    return text


@fuzz_settings(300)
@given(mutated())
def test_mutated_valid_policies(text):
    check(text)


def test_seeds_are_valid():
    for text in SEEDS:
        assert check(text) is not None


# --------------------------------------------------------------------------------------------
# alias expansion


def test_recursive_alias_is_a_policy_error():
    """An alias inside the node it names (`rules: &r [{hosts: *r}]`) is a cycle: a PolicyError with
    its location, not a RecursionError out of the loader (`check` would print a traceback)."""
    check("version: 1\nrules: &r\n  - id: a\n    hosts: *r\n")


def laughs(levels: int, width: int = 10) -> str:
    lines = ["version: 1", "rules:", "  - id: a", "    hosts: [a.test]", "x0: &a0 [" + ", ".join(["l"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_alias_expansion_is_bounded():
    """A 500-byte file whose aliases expand to 10^8 nodes: the loader must refuse it (or load it) in
    well under a second, not walk every expanded node (which takes minutes and gigabytes, during
    which `check` hangs, and a hot reload would freeze the gateway's event loop)."""
    text = laughs(8)
    assert len(text) <= 500
    code = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from gateway.policy import compile_policy, PolicyError
        try:
            compile_policy(sys.stdin.read(), "laughs.yaml")
        except PolicyError as exc:
            print("PolicyError", str(exc)[:200])
        except MemoryError:
            print("MemoryError")
            sys.exit(3)
    """)
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    try:
        result = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True,
                                timeout=3, env=env, cwd=PROJECT_ROOT)
    except subprocess.TimeoutExpired:
        raise AssertionError("BUG: a 500-byte policy with nested YAML aliases did not load within 3 s "
                             "(gateway/yamlsource.py _convert expands every alias)") from None
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-500:])
