"""`egress-gateway check` on passthrough rules: what `inspect: false` cannot be combined with (load
errors naming file:line and the key), and the domain-fronting warning for hosts on shared CDNs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.support.gateway import PROJECT_ROOT


def check(path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    return subprocess.run([sys.executable, "-m", "gateway", "check", *flags, str(path)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=PROJECT_ROOT)


def write(tmp_path, rule: str, header: str = "") -> tuple[object, str]:
    text = "version: 1\n" + textwrap.dedent(header) + "rules:\n" + textwrap.indent(textwrap.dedent(rule).strip(), "  ") + "\n"
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path, text


def line_of(text: str, key: str) -> int:
    """1-based line of the first `key:` in the rule (after `rules:`)."""
    lines = text.splitlines()
    start = lines.index("rules:")
    for number, line in enumerate(lines[start:], start + 1):
        if re.match(rf"\s*(- )?{re.escape(key)}:", line):
            return number
    raise AssertionError(f"{key} not in {text}")


SECRETS = """\
secrets:
  tok: {env: EGRESS_TEST_PASSTHROUGH_TOKEN}
"""

FORBIDDEN = {
    "inject": ("""
        - id: p
          hosts: [pass.example.com]
          inspect: false
          inject:
            - header: Authorization
              value: "Bearer ${secrets.tok}"
        """, SECRETS),
    "methods": ("""
        - id: p
          hosts: [pass.example.com]
          inspect: false
          methods: [GET]
        """, ""),
    "paths": ("""
        - id: p
          hosts: [pass.example.com]
          inspect: false
          paths: ["/simple/**"]
        """, ""),
    "protocol": ("""
        - id: p
          protocol: tcp
          hosts: [git.example.com]
          ports: [22]
          inspect: false
        """, ""),
    "schemes-http": ("""
        - id: p
          hosts: [pass.example.com]
          schemes: [http]
          inspect: false
        """, ""),
    "schemes-both": ("""
        - id: p
          hosts: [pass.example.com]
          schemes: [https, http]
          inspect: false
        """, ""),
    "hosts-ipv4": ("""
        - id: p
          hosts: [203.0.113.7]
          inspect: false
        """, ""),
    "hosts-cidr": ("""
        - id: p
          hosts: [198.51.100.0/24]
          inspect: false
        """, ""),
    "hosts-ipv6": ("""
        - id: p
          hosts: ["[2001:db8::1]"]
          inspect: false
        """, ""),
    "hosts-ip-among-names": ("""
        - id: p
          hosts: [pass.example.com, 203.0.113.7]
          inspect: false
        """, ""),
}


@pytest.mark.parametrize("case", sorted(FORBIDDEN))
def test_what_inspect_false_cannot_be_combined_with(tmp_path, case):
    rule, header = FORBIDDEN[case]
    path, text = write(tmp_path, rule, header)
    result = check(path)
    assert result.returncode == 2, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    key = case.split("-")[0]
    # the key's line, or the next one where a block value (a list under the key) starts
    lines = {line_of(text, key), line_of(text, key) + 1, line_of(text, "inspect")}
    wanted = re.compile(rf"^{re.escape(str(path))}:(\d+):\d+: rules\[0\]\.({key}|inspect)\b")
    found = [m for m in map(wanted.match, result.stderr.splitlines()) if m]
    assert found, f"no error naming rules[0].{key} or rules[0].inspect:\n{result.stderr}"
    assert any(int(m.group(1)) in lines for m in found), (
        f"the error is not on the line of {key} (or its value) or inspect ({sorted(lines)}):\n{result.stderr}")
    assert "inspect" in result.stderr


@pytest.mark.parametrize("rule", [
    """
    - id: p
      hosts: [pass.example.com, "*.cdn.example.com"]
      inspect: false
    """,
    """
    - id: p
      hosts: [pass.example.com]
      schemes: [https]
      ports: [443, 8443]
      inspect: false
    """,
    """
    - id: p
      hosts: [pass.example.com]
      inspect: true
      methods: [GET]
      paths: ["/x/**"]
    """,
])
def test_valid_passthrough_rules_load(tmp_path, rule):
    path, _ = write(tmp_path, rule)
    result = check(path)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"
    assert "fronting" not in result.stderr.lower()


def test_inspect_must_be_a_boolean(tmp_path):
    path, text = write(tmp_path, """
        - id: p
          hosts: [pass.example.com]
          inspect: "no"
        """)
    result = check(path)
    assert result.returncode == 2, result.stderr
    assert f"{path}:{line_of(text, 'inspect')}:" in result.stderr and "rules[0].inspect" in result.stderr


@pytest.mark.parametrize("host", [
    "d111111abcdef8.cloudfront.net",
    "*.cloudfront.net",
    "files.pythonhosted.org",
    "example.global.ssl.fastly.net",
    "myendpoint.azureedge.net",
    "a248.e.akamaized.net",
])
def test_a_passthrough_host_on_a_shared_cdn_gets_a_domain_fronting_warning(tmp_path, host):
    path, text = write(tmp_path, f"""
        - id: p
          hosts: ["{host}"]
          inspect: false
        """)
    result = check(path)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    warnings = [line for line in result.stderr.splitlines() if "fronting" in line.lower()]
    assert warnings, f"no domain-fronting warning for {host}:\n{result.stderr}"
    assert any(line.startswith(f"{path}:") and "warning" in line for line in warnings), warnings
    strict = check(path, "--strict")
    assert strict.returncode == 1, f"--strict: exit {strict.returncode}"


@pytest.mark.parametrize("rule", [
    """
    - id: p
      hosts: [pass.example.com]
      inspect: false
    """,
    """
    - id: inspected
      hosts: [files.pythonhosted.org]
    """,
])
def test_no_domain_fronting_warning_when_it_does_not_apply(tmp_path, rule):
    """A passthrough host on no known CDN, or a CDN host that is inspected (its Host header is pinned)."""
    path, _ = write(tmp_path, rule)
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert "fronting" not in result.stderr.lower(), result.stderr
