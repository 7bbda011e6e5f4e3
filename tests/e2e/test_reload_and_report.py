"""Hot reload (file change, ConfigMap-style symlink swap, broken file, under traffic) and report mode."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import policy_text
from tests.e2e.helpers import assert_untouched, curl, get, tls_tunnel
from tests.support.waiting import wait_for
from tests.support.gateway import GatewayProcess

ALLOW_ALLOWED = """
- id: allowed
  hosts: [allowed.test]
"""
ALLOW_OTHER = """
- id: other
  hosts: [other.test]
"""
ALLOW_BOTH = ALLOW_ALLOWED + ALLOW_OTHER


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


RELOAD_WAIT = 8.0  # a policy reload polls its file: up to a poll interval (1 s here) after the write


def reloads(gateway: GatewayProcess, result: str) -> list[dict]:
    return [a for a in gateway.audit() if a["event"] == "policy_reload" and a.get("result") == result]


@pytest.fixture
def gateway_with_policy(tmp_path, pki, upstreams):
    started = []

    def start(rules: str, args: list[str] | None = None, policy_path: Path | None = None) -> tuple[GatewayProcess, Path]:
        policy = policy_path or tmp_path / "policy.yaml"
        if policy_path is None:
            policy.write_text(policy_text(upstreams, rules))
        args = args or ["--set", "egress_policy_poll=1"]
        gateway = GatewayProcess(policy, tmp_path / f"gw{len(started)}", upstream_ca=pki.ca_cert, extra_args=args)
        started.append(gateway.start())
        upstreams.reset()
        return gateway, policy

    yield start
    for gateway in started:
        gateway.stop()


def test_a_changed_file_is_reloaded_and_a_removed_rule_stops_at_once(gateway_with_policy, upstreams):
    gateway, policy = gateway_with_policy(ALLOW_BOTH)
    conn = tls_tunnel(gateway, "allowed.test:443")
    assert get(conn, "/one", "allowed.test").status == 200
    write_atomically(policy, policy_text(upstreams, ALLOW_OTHER))
    wait_for(lambda: reloads(gateway, "ok"), RELOAD_WAIT, "the reload", detail=lambda: gateway.log()[-2000:])
    # the same kept-alive tunnel: its pinned host is no longer allowed at all, so the reload closed it
    # (tests/e2e/test_revocation.py has every kind of open connection)
    wait_for(lambda: [a for a in gateway.audit() if a["reason"] == "revoked" and a["client"] == conn.client],
             RELOAD_WAIT, "the tunnel's revoked line")
    assert conn.closed()
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/one"]
    assert curl(gateway, "https://allowed.test/two").status == 0  # and a new one is refused at its CONNECT
    assert curl(gateway, "https://other.test/x").status == 200


def test_a_broken_file_changes_nothing(gateway_with_policy, upstreams):
    gateway, policy = gateway_with_policy(ALLOW_ALLOWED)
    write_atomically(policy, "version: 1\nrules:\n  - id: x\n    hosts: ['*']\n")
    errors = wait_for(lambda: reloads(gateway, "error"), RELOAD_WAIT, "the rejected reload")
    assert f"{policy}:4:" in errors[0]["message"]
    assert f"{policy}:4:" in gateway.log()
    assert curl(gateway, "https://allowed.test/still").status == 200
    assert curl(gateway, "https://other.test/x").status == 0  # still denied (CONNECT refused)
    assert_untouched(upstreams, "other.test")
    # deleting the file changes nothing either
    policy.unlink()  # the poller notices (the file's identity changed) and rejects the reload
    gone = wait_for(lambda: [a for a in reloads(gateway, "error") if "cannot read policy" in a["message"]],
                    RELOAD_WAIT, "the deleted file's rejected reload", detail=lambda: gateway.log()[-2000:])
    assert len(reloads(gateway, "error")) == 2 and gone[0]["reason"] == "policy_invalid"
    assert not reloads(gateway, "ok")
    assert curl(gateway, "https://allowed.test/after-delete").status == 200


def test_configmap_symlink_swap_is_picked_up(tmp_path, gateway_with_policy, upstreams):
    volume = tmp_path / "configmap"
    (volume / "..2026_11_30_v1").mkdir(parents=True)
    (volume / "..2026_11_30_v1" / "policy.yaml").write_text(policy_text(upstreams, ALLOW_ALLOWED))
    os.symlink("..2026_11_30_v1", volume / "..data")
    os.symlink("..data/policy.yaml", volume / "policy.yaml")
    gateway, _ = gateway_with_policy("", policy_path=volume / "policy.yaml")
    assert curl(gateway, "https://allowed.test/v1").status == 200
    # kubelet's update: write a new directory, then atomically repoint ..data
    (volume / "..2026_11_30_v2").mkdir()
    (volume / "..2026_11_30_v2" / "policy.yaml").write_text(policy_text(upstreams, ALLOW_OTHER))
    os.symlink("..2026_11_30_v2", volume / "..data_tmp")
    os.replace(volume / "..data_tmp", volume / "..data")
    wait_for(lambda: reloads(gateway, "ok"), RELOAD_WAIT, "the reload", detail=lambda: gateway.log()[-2000:])
    assert curl(gateway, "https://allowed.test/v2").status == 0
    assert curl(gateway, "https://other.test/v2").status == 200


def test_sighup_reloads_without_polling(gateway_with_policy, upstreams):
    gateway, policy = gateway_with_policy(ALLOW_ALLOWED, args=["--set", "egress_policy_poll=0"])
    policy.write_text(policy_text(upstreams, ALLOW_OTHER))
    # Not synchronisation: the thing under test is a poll that must not happen, and a poller (even
    # at egress_policy_poll=1, its minimum) would have reloaded within 1 s of the write.
    time.sleep(1.5)
    assert not reloads(gateway, "ok")  # no polling
    assert curl(gateway, "https://other.test/x").status == 0  # the old policy still judges
    gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads(gateway, "ok"), RELOAD_WAIT, "the SIGHUP reload", detail=lambda: gateway.log()[-2000:])
    assert curl(gateway, "https://other.test/x").status == 200


def test_reload_under_traffic_fails_no_request(gateway_with_policy, upstreams):
    gateway, policy = gateway_with_policy(ALLOW_BOTH)
    failures: list[str] = []
    done = threading.Event()
    count = [0]

    def hammer() -> None:
        conn = tls_tunnel(gateway, "allowed.test:443")
        while not done.is_set():
            try:
                response = get(conn, f"/n{count[0]}", "allowed.test")
                if response.status != 200:
                    failures.append(f"{response.status} {response.egress_reason}")
            except Exception as exc:  # a reset would be a failure caused by the reload
                failures.append(repr(exc))
                conn = tls_tunnel(gateway, "allowed.test:443")
            count[0] += 1

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for i in range(4):  # flip between two valid policies that both allow allowed.test
            rules = ALLOW_BOTH if i % 2 else ALLOW_ALLOWED + "- id: extra\n  hosts: [api.test]\n"
            write_atomically(policy, policy_text(upstreams, rules))
            # The bound is generous: the poll shares the event loop with the hammering client.
            wait_for(lambda n=i: len(reloads(gateway, "ok")) > n, 30.0, f"reload {i + 1}")
    finally:
        done.set()
        thread.join(10)
    assert failures == []
    assert count[0] > 20


REPORT_EXTRA = """\
# report mode policy
secrets:
  api_key: {env: EGRESS_TEST_REPORT_KEY}
"""


def test_report_mode_lets_allowlist_denials_through_as_would_deny(start_gateway, upstreams, monkeypatch):
    monkeypatch.setenv("EGRESS_TEST_REPORT_KEY", "sk-report-mode-secret-0123456789")
    gateway = start_gateway(
        """
        - id: api
          hosts: [api.test]
          methods: [GET]
          paths: ["/ok/**"]
          mode: report
          inject:
            - header: Authorization
              value: "Bearer ${secrets.api_key}"
        - id: allowed
          hosts: [allowed.test]
          paths: ["/ok/**"]
        """,
        extra=REPORT_EXTRA,
    )
    # rule in report mode: a path it does not allow goes through, marked would_deny, WITHOUT the credential
    result = curl(gateway, "https://api.test/not-ok")
    assert result.status == 200
    received = upstreams.tls["api.test"].requests[-1]
    assert received.path == "/not-ok"
    assert not [v for k, v in received.headers if k.lower() == "authorization"]
    lines = [a for a in gateway.audit() if a["event"] == "request" and a["path"] == "/not-ok"]
    assert [(a["decision"], a["reason"], a["rule"]) for a in lines] == [("would_deny", "path_not_allowed", "api")]
    # an allowed path in the same rule gets the credential
    assert curl(gateway, "https://api.test/ok/1").status == 200
    assert ("Authorization", "Bearer sk-report-mode-secret-0123456789") in upstreams.tls["api.test"].requests[-1].headers
    # a rule in enforce mode still refuses
    refused = curl(gateway, "https://allowed.test/nope")
    assert (refused.status, refused.header("X-Egress-Reason")) == (403, "path_not_allowed")


def test_global_report_mode_never_relaxes_pinning_or_addresses(start_gateway, upstreams):
    gateway = start_gateway(
        """
        - id: allowed
          hosts: [allowed.test]
        """,
        extra="mode: report\n",
    )
    # no rule at all for other.test: through, as would_deny
    assert curl(gateway, "https://other.test/x").status == 200
    assert any(a["decision"] == "would_deny" and a["reason"] == "no_rule" for a in gateway.audit())
    # restating the destination is still 421
    conn = tls_tunnel(gateway, "allowed.test:443")
    response = get(conn, "/x", "other.test")
    assert (response.status, response.egress_reason) == (421, "host_mismatch")
    # TRACE is still refused
    conn = tls_tunnel(gateway, "allowed.test:443")
    assert get(conn, "/x", "allowed.test", method="TRACE").egress_reason == "method_forbidden"
    # the deny list still holds (localhost resolves to loopback, outside allow_ip_ranges? it is
    # inside 127.0.0.0/8 here, so use the gateway's own listener instead)
    conn_result = curl(gateway, f"https://127.0.0.1:{gateway.port}/")
    assert conn_result.status == 0 and conn_result.connect_status == 403
