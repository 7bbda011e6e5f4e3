"""Spec 8: fail closed. A policy that does not load stops the gateway before it listens (exit 2,
file:line on stderr); options that would weaken the gateway are forced back to safe values."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    assert_refused,
    assert_untouched,
    fresh_upstreams,
    get,
    start_tls,
    tls_tunnel,
    tunnel,
)
from tests.support.gateway import PROJECT_ROOT, free_port

GOOD_RULES = """\
version: 1
rules:
  - id: ok
    hosts: [allowed.test]
"""

# name -> (policy text, line of the first problem)
BAD_POLICIES = {
    "unknown-key": ("version: 1\nrules:\n  - id: a\n    hosts: [a.test]\n    hots: [b.test]\n", 5),
    "bad-cidr": ("version: 1\nnetwork:\n  deny_ip_ranges:\n    - 10.0.0.0/33\nrules: []\n", 4),
    "trace-allowed": ("version: 1\nrules:\n  - id: a\n    hosts: [a.test]\n    methods: [GET, TRACE]\n", 5),
    "duplicate-key": ("version: 1\nrules:\n  - id: a\n    hosts: [a.test]\n    hosts: [b.test]\n", 5),
    "yaml-syntax": ("version: 1\nrules:\n  - id: a\n    hosts: [a.test\n", 5),
    "bare-wildcard": ("version: 1\nrules:\n  - id: a\n    hosts: ['*']\n", 4),
    "bad-host": ("version: 1\nrules:\n  - id: a\n    hosts: ['a.test@b.test']\n", 4),
    "version-2": ("version: 2\nrules: []\n", 1),
    "bad-port": ("version: 1\nrules:\n  - id: a\n    hosts: [a.test]\n    ports: [0]\n", 5),
}


def _run(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, env=env,
                          cwd=PROJECT_ROOT, timeout=timeout)


def _nothing_listens(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


@pytest.mark.parametrize("name", sorted(BAD_POLICIES))
def test_bad_policy_stops_the_gateway_before_it_listens(tmp_path, name):
    text, line = BAD_POLICIES[name]
    policy = tmp_path / f"{name}.yaml"
    policy.write_text(text)
    port = free_port()
    audit = tmp_path / "audit.jsonl"
    started = time.monotonic()
    result = _run(["run", "--policy", str(policy), "--mode", f"regular@127.0.0.1:{port}",
                   "--confdir", str(tmp_path / "conf"), "--audit-log", str(audit)])
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert f"{policy}:{line}:" in result.stderr, result.stderr
    assert "listening" not in result.stdout + result.stderr
    assert _nothing_listens(port)
    assert time.monotonic() - started < 15


def test_check_reports_every_bad_policy_with_its_location(tmp_path):
    paths = []
    for name, (text, line) in sorted(BAD_POLICIES.items()):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        paths.append((path, line))
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_RULES)
    result = _run(["check", str(good), *(str(p) for p, _ in paths)])
    assert result.returncode == 2, result
    assert f"{good}: ok" in result.stdout
    for path, line in paths:
        assert f"{path}:{line}:" in result.stderr, (path, result.stderr)


def test_missing_policy_file_stops_the_gateway(tmp_path):
    port = free_port()
    missing = tmp_path / "nope.yaml"
    result = _run(["run", "--policy", str(missing), "--mode", f"regular@127.0.0.1:{port}", "--confdir", str(tmp_path)])
    assert result.returncode == 2, result
    assert str(missing) in result.stderr
    assert _nothing_listens(port)


def test_mode_without_pinning_is_refused(tmp_path):
    """A mode whose destination the gateway does not pin (a reverse proxy) must not run."""
    mode = "reverse:http://127.0.0.1:9@127.0.0.1:{port}"
    policy = tmp_path / "good.yaml"
    policy.write_text(GOOD_RULES)
    port = free_port()
    spec = mode.format(port=port)
    result = _run(["run", "--policy", str(policy), "--mode", spec, "--confdir", str(tmp_path)], timeout=20)
    assert result.returncode != 0, result
    assert "not supported" in result.stdout + result.stderr
    assert _nothing_listens(port)


def test_unwritable_audit_log_stops_the_gateway(tmp_path):
    policy = tmp_path / "good.yaml"
    policy.write_text(GOOD_RULES)
    port = free_port()
    result = _run(["run", "--policy", str(policy), "--mode", f"regular@127.0.0.1:{port}", "--confdir", str(tmp_path),
                   "--audit-log", str(tmp_path / "no" / "such" / "dir" / "audit.jsonl")])
    assert result.returncode != 0, result
    assert "audit" in result.stderr.lower()
    assert _nothing_listens(port)


WEAKENING = [
    "connection_strategy=eager",
    "rawtcp=true",
    "tcp_hosts=.*",
    "ignore_hosts=api.test",
    "validate_inbound_headers=false",
]


def test_weakening_options_are_forced_back(start_gateway, upstreams):
    args = [arg for option in WEAKENING for arg in ("--set", option)]
    gateway = start_gateway(
        """
        - id: allowed
          hosts: [allowed.test]
        - id: api
          hosts: [api.test]
          paths: ["/ok/**"]
        """,
        args=args,
    )
    # connection_strategy stays lazy: CONNECT and the client's TLS handshake open nothing upstream
    conn, answer = tunnel(gateway, "allowed.test:443")
    with conn:
        assert answer.status == 200
        tls = start_tls(conn, gateway, sni="allowed.test")  # eager would have connected by now
        assert_untouched(upstreams, *ALL_UPSTREAMS)  # (fenced at the upstreams' accept queues)
        assert get(tls, "/lazy", "allowed.test").status == 200

    # rawtcp / tcp_hosts stay off: bytes that are not HTTP are refused, not relayed
    conn, answer = tunnel(gateway, "api.test:443")
    with conn:
        conn.send(b"SSH-2.0-OpenSSH_9.0\r\n")
        assert_refused(conn.read_response(), 400, "non_http")

    # ignore_hosts stays empty: api.test is still inspected, its path rule still applies
    with tls_tunnel(gateway, "api.test:443") as tls:
        assert_refused(get(tls, "/admin", "api.test"), 403, "path_not_allowed", rule="api")

    # validate_inbound_headers stays on: smuggling-prone framing is refused
    with tls_tunnel(gateway, "api.test:443") as tls:
        tls.send(b"POST /ok/x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert tls.read_response().status == 400
    assert_untouched(upstreams, "api.test", "other.test")

    # The gateway says which options it overrode. (connection_strategy=eager and rawtcp=true are
    # mitmproxy's own defaults, forced silently, so only the others are named in the log.)
    log = gateway.log()
    for option in ("ignore_hosts", "tcp_hosts", "validate_inbound_headers"):
        assert f"ignoring {option}" in log, (option, log[-2000:])


def test_gateway_accepts_its_own_dns_timeout_option(start_gateway, upstreams):
    """`egress_dns_timeout` is the gateway's own option; setting it must not crash the gateway."""
    gateway = start_gateway(
        """
        - id: nowhere
          hosts: [nowhere.invalid]
        """,
        args=["--set", "egress_dns_timeout=2"],
    )
    conn, answer = tunnel(gateway, "nowhere.invalid:443")
    conn.close()
    assert_refused(answer, 502, "resolve_failed")
