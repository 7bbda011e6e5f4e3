"""compile_policy / load_policy: a full valid policy, and every error with file:line:column and key path."""

from __future__ import annotations

import hashlib
import ipaddress
import textwrap
from pathlib import Path

import pytest

from gateway.addresses import DEFAULT_DENY_RANGES
from gateway.hostnames import canonical_host
from gateway.matcher import HostPattern
from gateway.policy import (
    DEFAULT_PORTS,
    NETWORK_KEYS,
    RESOLVER_KEYS,
    RULE_KEYS,
    TOP_KEYS,
    FORBIDDEN_METHODS,
    STANDARD_METHODS,
    Policy,
    compile_policy,
    default_policy_text,
    load_default_policy,
    load_policy,
)
from gateway.yamlsource import ConfigIssue, Location, PolicyError

ip = ipaddress.ip_address
net = ipaddress.ip_network
POLICIES_DIR = Path(__file__).resolve().parents[2] / "policies"

FULL = textwrap.dedent(
    """\
    version: 1
    network:
      deny_ip_ranges: default
      allow_ip_ranges: [10.20.0.0/16, "fd12::/16"]
    resolver:
      static_hosts:
        Internal.Example.: [10.20.0.5, "2001:db8::5"]
        bücher.test: ["[fd12::7]"]
    rules:
      - id: minimal
        hosts: [example.com]
      - id: everything
        hosts: ["*.Example.ORG", api.example.net, 203.0.113.0/24, "[2001:db8::1]", 198.51.100.7, bücher.de]
        ports: [443, 8443]
        schemes: [https, HTTP]
        methods: [GET, POST, PROPFIND]
        paths: ["/v1/**", "/health"]
      - id: plain-http
        hosts: [internal.example]
        schemes: [http]
    """
)


def compile_text(text: str, source: str = "p.yaml") -> Policy:
    return compile_policy(textwrap.dedent(text), source)


def issues_of(text: str, source: str = "p.yaml") -> list[tuple[int, int, str, str]]:
    with pytest.raises(PolicyError) as info:
        compile_policy(textwrap.dedent(text), source)
    for issue in info.value.issues:
        assert issue.location.file == source
    return [(i.location.line, i.location.column, i.path, i.message) for i in info.value.issues]


def unknown(keys: set[str]) -> str:
    return f"unknown key (allowed: {', '.join(sorted(keys))})"


def only_issue(text: str) -> tuple[int, int, str, str]:
    found = issues_of(text)
    assert len(found) == 1, found
    return found[0]


# --------------------------------------------------------------------------------------------
# a full valid policy


def test_full_policy_compiles_with_exact_values():
    policy = compile_policy(FULL, "full.yaml")
    assert policy.version == 1
    assert policy.source == "full.yaml"
    assert policy.sha256 == hashlib.sha256(FULL.encode("utf-8")).hexdigest()
    assert [r.id for r in policy.rules] == ["minimal", "everything", "plain-http"]
    assert [r.index for r in policy.rules] == [0, 1, 2]
    assert set(policy.rules_by_id) == {"minimal", "everything", "plain-http"}
    assert policy.rules_by_id["everything"] is policy.rules[1]

    minimal = policy.rules[0]
    assert minimal.hosts == (HostPattern("exact", "example.com"),)
    assert minimal.schemes == frozenset({"https"})
    assert minimal.ports is None
    assert minimal.methods is None
    assert minimal.path_globs is None
    assert minimal.path_patterns is None
    assert minimal.location == Location("full.yaml", 10, 5)

    rule = policy.rules[1]
    assert rule.hosts == (
        HostPattern("wildcard", "example.org"),
        HostPattern("exact", "api.example.net"),
        HostPattern("network", "203.0.113.0/24", net("203.0.113.0/24")),
        HostPattern("exact", "2001:db8::1"),
        HostPattern("exact", "198.51.100.7"),
        HostPattern("exact", "xn--bcher-kva.de"),
    )
    assert rule.ports == frozenset({443, 8443})
    assert rule.schemes == frozenset({"https", "http"})
    assert rule.methods == frozenset({"GET", "POST", "PROPFIND"})
    assert rule.path_globs == ("/v1/**", "/health")
    assert [bool(p.match("/v1")) for p in rule.path_patterns] == [True, False]
    assert rule.location == Location("full.yaml", 12, 5)

    assert policy.rules[2].schemes == frozenset({"http"})

    assert policy.static_hosts == {
        "internal.example": (ip("10.20.0.5"), ip("2001:db8::5")),
        "xn--bcher-kva.test": (ip("fd12::7"),),
    }
    assert len(policy.deny_ranges) == len(DEFAULT_DENY_RANGES)
    assert policy.allow_ranges.lookup(ip("10.20.1.1")) == (net("10.20.0.0/16"), "network.allow_ip_ranges entry 10.20.0.0/16")
    assert policy.allow_ranges.lookup(ip("fd12::1"))[0] == net("fd12::/16")
    assert policy.allow_ranges.lookup(ip("10.21.0.1")) is None

    assert policy.index.candidates(canonical_host("example.com")) == [0]
    assert policy.index.candidates(canonical_host("a.b.example.org")) == [1]
    assert policy.index.candidates(canonical_host("example.org")) == []
    assert policy.index.candidates(canonical_host("203.0.113.200")) == [1]
    assert policy.index.candidates(canonical_host("[2001:db8::1]")) == [1]
    assert policy.index.candidates(canonical_host("internal.example")) == [2]


def test_rule_defaults_ports_methods_paths():
    policy = compile_policy(FULL, "full.yaml")
    minimal, everything, plain = policy.rules
    # ports None: the scheme's default port
    assert DEFAULT_PORTS == {"https": 443, "http": 80}
    assert minimal.allows_port(443) is True
    assert minimal.allows_port(443, "https") is True
    assert minimal.allows_port(80) is False
    assert minimal.allows_port(443, "http") is False
    assert plain.allows_port(80) is True
    assert plain.allows_port(80, "http") is True
    assert plain.allows_port(443) is False
    # explicit ports: any of them, for any of the rule's schemes
    assert everything.allows_port(8443, "http") is True
    assert everything.allows_port(80, "http") is False
    assert everything.allows_port(443) is True
    # methods None: the standard methods, never TRACE/TRACK/CONNECT
    assert STANDARD_METHODS == frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
    for method in STANDARD_METHODS:
        assert minimal.allows_method(method) is True
    for method in FORBIDDEN_METHODS | {"PROPFIND", "get", "BREW"}:
        assert minimal.allows_method(method) is False
    assert everything.allows_method("PROPFIND") is True
    assert everything.allows_method("PUT") is False
    # paths None: any path
    assert minimal.allows_path("/anything/at/all") is True
    assert everything.allows_path("/v1/x/y") is True
    assert everything.allows_path("/health") is True
    assert everything.allows_path("/healthz") is False
    assert everything.allows_path("/v10") is False


def test_explicit_deny_list_and_no_network_section():
    policy = compile_text(
        """\
        version: 1
        network:
          deny_ip_ranges: [192.0.2.0/24, "2001:db8::/32"]
        rules: []
        """
    )
    assert len(policy.deny_ranges) == 2
    assert policy.deny_ranges.lookup(ip("127.0.0.1")) is None
    assert policy.deny_ranges.lookup(ip("192.0.2.1"))[1] == "network.deny_ip_ranges entry 192.0.2.0/24"
    bare = compile_text("version: 1\n")
    assert bare.rules == ()
    assert len(bare.deny_ranges) == len(DEFAULT_DENY_RANGES)
    assert len(bare.allow_ranges) == 0
    assert bare.static_hosts == {}
    empty_deny = compile_text("version: 1\nnetwork:\n  deny_ip_ranges: []\n")
    assert len(empty_deny.deny_ranges) == 0


def test_load_policy_from_file(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(FULL, encoding="utf-8")
    policy = load_policy(path)
    assert policy.source == str(path)
    assert [r.id for r in policy.rules] == ["minimal", "everything", "plain-http"]
    assert policy.rules[0].location == Location(str(path), 10, 5)


def test_load_policy_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nrules:\n  - id: a\n", encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == f"{path}:3:5: rules[0]: missing required key 'hosts'"
    missing = tmp_path / "missing.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(missing)
    assert len(info.value.issues) == 1
    assert info.value.issues[0].location == Location(str(missing), 1, 1)
    assert "cannot read policy" in info.value.issues[0].message
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"version: 1\n# caf\xe9\n")
    with pytest.raises(PolicyError, match="cannot read policy"):
        load_policy(latin1)


def test_embedded_default_policy_compiles():
    policy = load_default_policy()
    assert policy.source == "<embedded policies/default.yaml>"
    assert policy.sha256 == hashlib.sha256(default_policy_text().encode()).hexdigest()
    assert len(policy.rules) >= 1
    assert "pypi" in policy.rules_by_id
    pypi = policy.rules_by_id["pypi"]
    assert pypi.methods == frozenset({"GET", "HEAD"})
    assert pypi.schemes == frozenset({"https"})
    assert pypi.ports is None
    assert policy.index.candidates(canonical_host("pypi.org")) == [pypi.index]
    assert len(policy.deny_ranges) == len(DEFAULT_DENY_RANGES)


@pytest.mark.parametrize("path", sorted(POLICIES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_policy_compiles(path):
    policy = load_policy(path)
    assert isinstance(policy, Policy)
    assert len(policy.rules) == len(policy.rules_by_id)


def test_there_is_at_least_one_shipped_policy():
    assert (POLICIES_DIR / "default.yaml").is_file()


# --------------------------------------------------------------------------------------------
# errors, each with its location and key path


def test_not_a_mapping():
    assert only_issue("- a\n- b\n") == (1, 1, "", "must be a mapping, not a list")
    assert only_issue("hello\n") == (1, 1, "", "must be a mapping, not a string")


def test_empty_file():
    assert only_issue("") == (1, 1, "", "the file is empty")
    assert only_issue("# only a comment\n\n") == (1, 1, "", "the file is empty")


def test_unknown_top_level_key():
    assert {"version", "network", "resolver", "rules"} <= TOP_KEYS
    assert only_issue("version: 1\nfoo: 1\nrules: []\n") == (2, 1, "foo", unknown(TOP_KEYS))


def test_unknown_network_and_resolver_keys():
    found = issues_of("version: 1\nnetwork:\n  deny: default\nresolver:\n  hosts: {}\n")
    assert found == [
        (3, 3, "network.deny", unknown(NETWORK_KEYS)),
        (5, 3, "resolver.hosts", unknown(RESOLVER_KEYS)),
    ]


def test_unknown_rule_key():
    text = """\
    version: 1
    rules:
      - id: a
        hosts: [a.com]
        bogus: 1
    """
    assert {"id", "hosts", "ports", "schemes", "methods", "paths"} <= RULE_KEYS
    assert only_issue(text) == (5, 5, "rules[0].bogus", unknown(RULE_KEYS))


def test_missing_id_and_missing_hosts():
    assert only_issue("version: 1\nrules:\n  - hosts: [a.com]\n") == (3, 5, "rules[0]", "missing required key 'id'")
    assert only_issue("version: 1\nrules:\n  - id: a\n") == (3, 5, "rules[0]", "missing required key 'hosts'")


def test_empty_hosts():
    assert only_issue("version: 1\nrules:\n  - id: a\n    hosts: []\n") == (4, 12, "rules[0].hosts", "must not be empty")


def test_hosts_not_a_list():
    assert only_issue("version: 1\nrules:\n  - id: a\n    hosts: a.com\n") == (
        4, 12, "rules[0].hosts", "must be a list, not a string"
    )


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("*", "'*': a wildcard needs a domain (\"*.example.com\")"),
        ("*.", "'*.': a wildcard needs a domain (\"*.example.com\")"),
        ("*.*", "'*.*': a wildcard needs a domain (\"*.example.com\")"),
        ("a.*.com", "'a.*.com': \"*\" is only allowed as a leading \"*.\" label"),
        ("foo*.com", "'foo*.com': \"*\" is only allowed as a leading \"*.\" label"),
        ("**.com", "'**.com': \"*\" is only allowed as a leading \"*.\" label"),
        ("*.*.com", "'*.*.com': only one leading \"*.\" is allowed"),
        ("*.1.2.3.4", "'*.1.2.3.4': a wildcard cannot cover an IP address"),
    ],
)
def test_bad_wildcards(pattern, message):
    text = f"version: 1\nrules:\n  - id: a\n    hosts: ['{pattern}']\n"
    assert only_issue(text) == (4, 13, "rules[0].hosts[0]", message)


@pytest.mark.parametrize(
    "pattern, fragment",
    [
        ("exa mple.com", "forbidden character"),
        ("user@example.com", "forbidden character"),
        ("example.com:443", "unexpected ':'"),
        ("[example.com]", "brackets around something that is not an IPv6 address"),
        ("10.0.0.1/8", "not a valid CIDR"),
        ("10.0.0.0/33", "not a valid CIDR"),
        ("example.com/24", "not a valid CIDR"),
        ("256.1.1.1", "out of range"),
    ],
)
def test_bad_host_patterns(pattern, fragment):
    line, column, path, message = only_issue(f"version: 1\nrules:\n  - id: a\n    hosts: ['{pattern}']\n")
    assert (line, column, path) == (4, 13, "rules[0].hosts[0]")
    assert message.startswith(repr(pattern) + ": ")
    assert fragment in message


def test_duplicate_rule_ids_name_the_first_location():
    text = """\
    version: 1
    rules:
      - id: a
        hosts: [a.com]
      - id: b
        hosts: [b.com]
      - id: a
        hosts: [c.com]
    """
    assert only_issue(text) == (7, 9, "rules[2].id", "duplicate rule id 'a' (first at p.yaml:3:9)")


@pytest.mark.parametrize("rule_id", ["bad id", "-a", "a/b", "x" * 64, "é"])
def test_bad_rule_ids(rule_id):
    line, column, path, message = only_issue(f"version: 1\nrules:\n  - id: '{rule_id}'\n    hosts: [a.com]\n")
    assert (line, column, path) == (3, 9, "rules[0].id")
    assert message == f"{rule_id!r}: use letters, digits, '_', '.', '-' (max 63)"


def test_rule_id_must_be_a_string():
    assert only_issue("version: 1\nrules:\n  - id: 7\n    hosts: [a.com]\n") == (
        3, 9, "rules[0].id", "must be a non-empty string, not a number"
    )


def test_duplicate_yaml_keys():
    text = """\
    version: 1
    rules:
      - id: a
        hosts: [a.com]
        hosts: [b.com]
    """
    assert only_issue(text) == (5, 5, "rules[0].hosts", "duplicate key")
    assert only_issue("version: 1\nversion: 1\n") == (2, 1, "version", "duplicate key")


def test_non_string_mapping_key():
    assert only_issue("version: 1\n7: x\n") == (2, 1, "", "mapping key 7 must be a string")


def test_bad_ports():
    text = "version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    ports: [0, 65536, '80', true, 443, 1.5, null]\n"
    assert issues_of(text) == [
        (5, 13, "rules[0].ports[0]", "0: a port is a number from 1 to 65535"),
        (5, 16, "rules[0].ports[1]", "65536: a port is a number from 1 to 65535"),
        (5, 23, "rules[0].ports[2]", "'80': a port is a number from 1 to 65535"),
        (5, 29, "rules[0].ports[3]", "True: a port is a number from 1 to 65535"),
        (5, 40, "rules[0].ports[5]", "1.5: a port is a number from 1 to 65535"),
        (5, 45, "rules[0].ports[6]", "None: a port is a number from 1 to 65535"),
    ]


def test_good_port_bounds():
    policy = compile_text("version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    ports: [1, 65535]\n")
    assert policy.rules[0].ports == frozenset({1, 65535})


def test_empty_lists_refused():
    text = "version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    ports: []\n    schemes: []\n    methods: []\n    paths: []\n"
    assert issues_of(text) == [
        (5, 12, "rules[0].ports", "must not be empty"),
        (6, 14, "rules[0].schemes", "must not be empty"),
        (7, 14, "rules[0].methods", "must not be empty"),
        (8, 12, "rules[0].paths", "must not be empty"),
    ]


@pytest.mark.parametrize("scheme", ["ftp", "ws", "wss", "https:", "http/1.1"])
def test_bad_scheme(scheme):
    assert only_issue(f"version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    schemes: ['{scheme}']\n") == (
        5, 15, "rules[0].schemes[0]", f"{scheme!r}: scheme must be one of http, https"
    )


@pytest.mark.parametrize("method", ["get", "Get", "G ET", "GET/1", "1GET", "X" * 33])
def test_bad_method_tokens(method):
    assert only_issue(f"version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    methods: ['{method}']\n") == (
        5, 15, "rules[0].methods[0]", f"{method!r}: methods are upper-case tokens like GET"
    )


@pytest.mark.parametrize("method", ["TRACE", "TRACK", "CONNECT"])
def test_forbidden_methods_cannot_be_allowed(method):
    text = f"version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    methods: [GET, {method}]\n"
    assert only_issue(text) == (5, 20, "rules[0].methods[1]", f"{method!r} is always refused and cannot be allowed")


@pytest.mark.parametrize("key, item, message", [
    ("ports", "0", "0: a port is a number from 1 to 65535"),
    ("ports", "true", "True: a port is a number from 1 to 65535"),
    ("schemes", "ftp", "'ftp': scheme must be one of http, https"),
    ("schemes", "1", "must be a non-empty string, not a number"),
    ("methods", "get", "'get': methods are upper-case tokens like GET"),
    ("methods", "TRACE", "'TRACE' is always refused and cannot be allowed"),
])
def test_a_grantable_reads_its_lists_as_a_rule_does(key, item, message):
    """One parser for a rule's and a profile's `grantable:` ports, schemes and methods: the same
    values refused with the same words, each naming its file, line, column and key."""
    rule = f"version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    {key}: [{item}]\n"
    grantable = ("version: 1\nrules:\n  - id: a\n    hosts: [a.com]\nsandboxes:\n  - id: agent\n    rules: [a]\n"
                 f"    grantable:\n      hosts: [a.com]\n      {key}: [{item}]\n")
    assert only_issue(rule)[2:] == (f"rules[0].{key}[0]", message)
    line, column, path, said = only_issue(grantable)
    assert (line, column, path, said) == (10, len(f"      {key}: [") + 1, f"sandboxes[0].grantable.{key}[0]", message)


def test_a_grantable_takes_schemes_in_any_case_as_a_rule_does():
    policy = compile_policy("version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    schemes: [HTTPS, Http]\n"
                            "sandboxes:\n  - id: agent\n    rules: [a]\n"
                            "    grantable: {hosts: [a.com], schemes: [HTTPS, Http]}\n", "p.yaml")
    assert policy.rules[0].schemes == policy.sandboxes_by_id["agent"].grantable.schemes == frozenset({"https", "http"})


@pytest.mark.parametrize("glob", ["api/*", "*", "**/x", "", "?"])
def test_path_glob_must_start_with_slash(glob):
    line, column, path, message = only_issue(
        f"version: 1\nrules:\n  - id: a\n    hosts: [a.com]\n    paths: ['{glob}']\n"
    )
    assert (line, column, path) == (5, 13, "rules[0].paths[0]")
    if glob:
        assert message == f"{glob!r}: a path glob must start with '/'"
    else:
        assert message == "must be a non-empty string, not a string"


def test_bad_cidrs():
    text = """\
    version: 1
    network:
      deny_ip_ranges: [10.0.0.1/8, 10.0.0.0/8]
      allow_ip_ranges: [nope, "::1/129", 7]
    """
    found = issues_of(text)
    assert [(l, c, p) for l, c, p, _ in found] == [
        (3, 20, "network.deny_ip_ranges[0]"),
        (4, 21, "network.allow_ip_ranges[0]"),
        (4, 27, "network.allow_ip_ranges[1]"),
        (4, 38, "network.allow_ip_ranges[2]"),
    ]
    assert found[0][3] == "'10.0.0.1/8' is not a valid CIDR: 10.0.0.1/8 has host bits set"
    assert found[1][3].startswith("'nope' is not a valid CIDR")
    assert found[3][3] == "must be a non-empty string, not a number"


def test_deny_ip_ranges_must_be_default_or_list():
    assert only_issue("version: 1\nnetwork:\n  deny_ip_ranges: all\n") == (
        3, 19, "network.deny_ip_ranges", 'must be "default" or a list of CIDRs'
    )


def test_static_hosts_errors():
    text = """\
    version: 1
    resolver:
      static_hosts:
        a.test: [example.org]
        1.2.3.4: [1.2.3.4]
        b.test: []
        c.test: 10.0.0.1
        "bad host.test": [10.0.0.1]
        A.Test.: [10.0.0.2]
        d.test: ["[::1", 0x7f.1, "fe80::1%eth0"]
    """
    found = issues_of(text)
    assert [(l, c, p) for l, c, p, _ in found] == [
        (4, 14, "resolver.static_hosts.a.test[0]"),
        (5, 5, "resolver.static_hosts.1.2.3.4"),
        (6, 13, "resolver.static_hosts.b.test"),
        (7, 13, "resolver.static_hosts.c.test"),
        (8, 5, "resolver.static_hosts.bad host.test"),
        (9, 5, "resolver.static_hosts.A.Test."),
        (10, 14, "resolver.static_hosts.d.test[0]"),
        (10, 30, "resolver.static_hosts.d.test[2]"),
    ]
    messages = [m for *_, m in found]
    assert messages[0] == "'example.org': not an IP address"
    assert messages[1] == "static_hosts maps names, not IP addresses"
    assert messages[2] == "must not be empty"
    assert messages[3] == "must be a list, not a string"
    assert messages[5] == "this name is listed twice (after canonicalisation)"


def test_static_hosts_accepts_legacy_and_bracketed_forms():
    policy = compile_text('version: 1\nresolver:\n  static_hosts:\n    a.test: [0x7f.1, "[::1]", "::2"]\n')
    assert policy.static_hosts == {"a.test": (ip("127.0.0.1"), ip("::1"), ip("::2"))}


def test_static_hosts_not_a_mapping():
    assert only_issue("version: 1\nresolver:\n  static_hosts: [a]\n") == (
        3, 17, "resolver.static_hosts", "must be a mapping of name to addresses, not a list"
    )


def test_yaml_syntax_error_has_a_line():
    text = "version: 1\nrules:\n  - id: a\n    hosts: [a.com\n"
    line, column, path, message = only_issue(text)
    assert (line, path) == (5, "")
    assert message.startswith("YAML syntax error: ")
    line, column, path, message = only_issue("version: 1\nrules:\n  - id: a\n   hosts: [a.com]\n")
    assert line == 4
    assert message.startswith("YAML syntax error: ")
    line, _, _, message = only_issue("version: 1\nx: 'unterminated\n")
    assert line == 3
    assert message.startswith("YAML syntax error: ")


@pytest.mark.parametrize(
    "value, message",
    [("2", "2: only version 1 is supported"), ("true", "True: only version 1 is supported"),
     ("'1'", "'1': only version 1 is supported"), ("0", "0: only version 1 is supported")],
)
def test_bad_version(value, message):
    assert only_issue(f"version: {value}\nrules: []\n") == (1, 10, "version", message)


def test_missing_version():
    assert only_issue("rules: []\n") == (1, 1, "version", "missing required key 'version' (use: version: 1)")


def test_wrong_types_for_sections():
    assert issues_of("version: 1\nnetwork: []\nresolver: x\nrules: {}\n") == [
        (2, 10, "network", "must be a mapping, not a list"),
        (3, 11, "resolver", "must be a mapping, not a string"),
        (4, 8, "rules", "must be a list, not a mapping"),
    ]
    assert only_issue("version: 1\nrules:\n  - just-a-string\n") == (3, 5, "rules[0]", "must be a mapping, not a string")


def test_several_errors_all_reported_sorted_by_line():
    text = """\
    rules:
      - id: 'bad id'
        hosts: ['*']
        ports: [0]
      - id: ok
        hosts: [a.com]
        methods: [get]
    version: 2
    foo: 1
    network:
      allow_ip_ranges: [nope]
    """
    found = issues_of(text)
    assert [(l, c, p) for l, c, p, _ in found] == [
        (2, 9, "rules[0].id"),
        (3, 13, "rules[0].hosts[0]"),
        (4, 13, "rules[0].ports[0]"),
        (7, 15, "rules[1].methods[0]"),
        (8, 10, "version"),
        (9, 1, "foo"),
        (11, 21, "network.allow_ip_ranges[0]"),
    ]


def test_policy_error_str_lists_every_issue():
    with pytest.raises(PolicyError) as info:
        compile_policy("version: 2\nfoo: 1\n", "x.yaml")
    assert str(info.value) == (
        "x.yaml:1:10: version: 2: only version 1 is supported\n"
        f"x.yaml:2:1: foo: {unknown(TOP_KEYS)}"
    )


def test_policy_error_sorts_issues():
    issues = [
        ConfigIssue(Location("f", 9, 1), "b", "second"),
        ConfigIssue(Location("f", 2, 7), "a", "first"),
        ConfigIssue(Location("f", 9, 0), "", "between"),
    ]
    error = PolicyError(issues)
    assert [i.message for i in error.issues] == ["first", "between", "second"]
    assert str(error) == "f:2:7: a: first\nf:9:0: between\nf:9:1: b: second"
    assert isinstance(error, ValueError)


def test_yaml_tags_never_construct_python_objects():
    found = issues_of('version: !!python/object/apply:os.system ["echo hi"]\n')
    assert len(found) == 1
    assert found[0][:3] == (1, 10, "version")
    with pytest.raises(PolicyError):
        compile_policy("version: !!python/name:os.system ''\n", "p.yaml")


def test_more_than_one_document_refused():
    line, _, path, message = only_issue("---\nversion: 1\n---\nversion: 1\n")
    assert (line, path) == (3, "")
    assert message.startswith("YAML syntax error: ")


def test_yaml_merge_keys_with_overrides():
    # YAML merge keys: explicit keys override merged ones; that is not a duplicate key.
    text = """\
    version: 1
    rules:
      - &base
        id: a
        hosts: [a.com]
        methods: [GET]
      - <<: *base
        id: b
    """
    policy = compile_text(text)
    assert [r.id for r in policy.rules] == ["a", "b"]
    assert policy.rules[1].hosts == (HostPattern("exact", "a.com"),)
    assert policy.rules[1].methods == frozenset({"GET"})


# --- inspect: false (passthrough) ---------------------------------------------------------------


def test_passthrough_rule_compiles():
    policy = compile_text("""\
        version: 1
        rules:
          - id: files
            hosts: [files.example, "*.cdn.example"]
            ports: [443, 8443]
            inspect: false
          - id: api
            hosts: [api.example]
        """)
    assert [r.inspect for r in policy.rules] == [False, True]


def test_passthrough_rule_cannot_restrict_what_it_cannot_see():
    found = issues_of("""\
        version: 1
        secrets:
          TOKEN: {env: TOKEN}
        rules:
          - id: files
            hosts: [files.example, 10.0.0.0/8, 192.0.2.1]
            schemes: [https, http]
            methods: [GET]
            paths: ["/a/**"]
            inject:
              - header: Authorization
                value: "Bearer ${secrets.TOKEN}"
            inspect: false
          - id: ssh
            protocol: tcp
            hosts: [192.0.2.1]
            ports: [22]
            inspect: false
          - id: odd
            hosts: [x.example]
            inspect: "no"
        """)
    paths = [(line, path) for line, _column, path, _message in found]
    assert (6, "rules[0].hosts") in paths and sum(p == "rules[0].hosts" for _, p in paths) == 2
    for line, path in [(7, "rules[0].schemes"), (8, "rules[0].methods"), (9, "rules[0].paths"),
                       (11, "rules[0].inject"), (18, "rules[1].inspect"), (21, "rules[2].inspect")]:
        assert (line, path) in paths, found
    messages = " ".join(m for *_, m in found)
    assert "uninspected" in messages and "https only" in messages and "host names" in messages
