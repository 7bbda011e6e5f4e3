"""The audit log cannot be written: its disk is full, or it became read-only and the gateway is
asked to reopen it (SIGHUP, as logrotate does).

The audit log is the security team's record; a decision that takes effect without its line is an
unrecorded allow. The gateway must fail closed: refuse (500 internal_error) rather than forward a
request it could not record, say so in its log, and recover once the log is writable again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.helpers import connect_proxy, get, tunnel
from tests.support.gateway import free_port
from tests.support.waiting import value_when

from .harness import drain, make_gateway

RULES = """
- id: allowed
  hosts: [allowed.test]
  schemes: [http, https]
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount)")


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill a filesystem to the last byte; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"f" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def audit_lines(path: Path) -> tuple[list[dict], list[bytes]]:
    """(parsed records, lines that are not one JSON object)."""
    good, bad = [], []
    for line in path.read_bytes().split(b"\n"):
        if not line:
            continue
        try:
            record = json.loads(line)
            assert isinstance(record, dict)
            good.append(record)
        except (ValueError, AssertionError):
            bad.append(line)
    return good, bad


def endpoint(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(port: int, name: str) -> float | None:
    for line in endpoint(port, "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def wait_ready(port: int, ready: bool, wait: float = 10.0) -> tuple[int, str]:
    """/readyz once it says `ready` (or the last answer, after `wait` s)."""
    return value_when(lambda: endpoint(port, "/readyz"), lambda answer: (answer[0] == 200) == ready, wait,
                      interval=0.1)


def fetch(gateway, n: int, host: str = "allowed.test"):
    with connect_proxy(gateway) as conn:
        return get(conn, f"http://{host}/req/{n}", host)


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory, upstreams, pki):
    """One gateway whose audit log lives on a 64 KiB tmpfs; the disk is filled while it runs, traffic
    is sent, then space is freed. Returns what happened, for the tests below to judge."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount)")
    base = tmp_path_factory.mktemp("full-disk")
    tiny = base / "tiny"
    tiny.mkdir()
    mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny))
    audit = tiny / "audit.jsonl"
    port = free_port()
    gateway = make_gateway(base, upstreams, pki, RULES, audit_path=audit,
                           args=["--set", "tcp_timeout=5", "--metrics", f"127.0.0.1:{port}"])
    seen: dict = {}
    try:
        assert fetch(gateway, 0).status == 200
        seen["ready_before"] = wait_ready(port, True)
        filler = fill(tiny)
        upstreams.reset()
        # The file's last page still has room for a few lines; then every write fails.
        started = time.monotonic()
        seen["statuses"] = {n: (r.status, r.egress_reason) for n in range(1, 41) for r in [fetch(gateway, n)]}
        seen["seconds_full"] = time.monotonic() - started
        seen["forwarded"] = {r.path for r in upstreams.plain["allowed.test"].requests}
        seen["recorded_while_full"] = {r["path"] for r in audit_lines(audit)[0]
                                       if r["event"] == "request" and r["decision"] == "allow"}
        # Other kinds of decision: a denial, a CONNECT, bytes that are not HTTP, a malformed request.
        seen["denied"] = fetch(gateway, 99, "other.test")
        conn, seen["connect"] = tunnel(gateway, "allowed.test:443")
        conn.close()
        for name, raw in (("non_http", b"SSH-2.0-OpenSSH_9.6\r\n"),
                          ("malformed", b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nBad Header\r\n\r\n")):
            with connect_proxy(gateway) as conn:
                conn.send(raw)
                seen[name] = drain(conn.sock, 3)
        seen["untouched"] = upstreams.untouched("other.test") and not upstreams.tls["allowed.test"].touched
        seen["log_while_full"] = gateway.log()
        seen["ready_while_full"] = wait_ready(port, False)
        seen["writable_while_full"] = metric(port, "egress_audit_writable")
        seen["failures_while_full"] = metric(port, "egress_audit_write_failures_total")
        # Space again: the gateway notices by itself, without a request (a pod out of its Service
        # gets none), and the first line after the outage says what happened.
        filler.unlink()
        seen["ready_after"] = wait_ready(port, True)
        seen["writable_after"] = metric(port, "egress_audit_writable")
        seen["after"] = fetch(gateway, 100)
        seen["records"], seen["bad_lines"] = audit_lines(audit)
        seen["alive"] = gateway.process.poll() is None
    finally:
        gateway.stop()
        umount(tiny)
    return seen


def test_disk_full_refuses_instead_of_allowing_unrecorded(full_disk):
    statuses = full_disk["statuses"]
    refused = [n for n, s in statuses.items() if s == (500, "internal_error")]
    assert refused, f"the disk never filled up: {statuses}"
    assert all(s in ((200, None), (500, "internal_error")) for s in statuses.values()), statuses
    assert all(statuses[n][0] == 500 for n in range(refused[0], 41)), statuses  # no allow once full
    # Nothing reached the upstream without its audit line.
    forwarded = full_disk["forwarded"]
    assert forwarded <= full_disk["recorded_while_full"], forwarded - full_disk["recorded_while_full"]
    assert forwarded == {f"/req/{n}" for n, s in statuses.items() if s[0] == 200}
    # Denials and CONNECTs fail closed too (500), bytes that are not HTTP are closed at once
    # (the layer guard's fallback refuses without speaking HTTP); nothing else was reached.
    assert (full_disk["denied"].status, full_disk["denied"].egress_reason) == (500, "internal_error")
    assert (full_disk["connect"].status, full_disk["connect"].egress_reason) == (500, "internal_error")
    non_http = full_disk["non_http"]
    assert not non_http.timed_out and non_http.closed and all(s >= 400 for s in non_http.statuses), non_http
    assert full_disk["untouched"]
    # The log says why: the audit log is not writable, with how many decisions were refused.
    log = full_disk["log_while_full"]
    assert "audit log is not writable (No space left on device)" in log and "refused (500" in log, log[-3000:]
    # And with space again, requests are recorded and allowed, without a restart.
    assert full_disk["alive"] and full_disk["after"].status == 200
    assert any(r["path"] == "/req/100" and r["decision"] == "allow" for r in full_disk["records"]) or \
        full_disk["bad_lines"], full_disk["records"][-3:]


def test_disk_full_refusals_log_no_traceback_and_at_most_a_warning_a_second(full_disk):
    """Each refusal used to log two tracebacks (`failed closed: OSError`, `fallback ... failed`):
    165,373 log lines in 8 s with --workers 2, on the disk that was already full."""
    log = full_disk["log_while_full"]
    refused = sum(1 for s in full_disk["statuses"].values() if s == (500, "internal_error"))
    assert refused >= 10, full_disk["statuses"]
    assert "Traceback" not in log and "failed closed" not in log and "fallback for" not in log, log[-3000:]
    warnings = log.count("audit log is not writable")
    assert 1 <= warnings <= full_disk["seconds_full"] + 4, (warnings, full_disk["seconds_full"])


def test_disk_full_is_said_in_readyz_and_metrics_and_recovers_without_traffic(full_disk):
    assert full_disk["ready_before"][0] == 200, full_disk["ready_before"]
    status, body = full_disk["ready_while_full"]
    assert status == 503 and "audit_log: FAIL" in body and "500 internal_error" in body, (status, body)
    assert full_disk["writable_while_full"] == 0
    assert full_disk["failures_while_full"] and full_disk["failures_while_full"] >= 1
    status, body = full_disk["ready_after"]
    assert status == 200 and "audit_log: ok" in body, (status, body)
    assert full_disk["writable_after"] == 1
    [outage] = [r for r in full_disk["records"] if r["event"] == "audit_log"]
    assert outage["failed_writes"] >= 1 and outage["failing_since"], outage
    # It comes before the first decision recorded after the outage.
    paths = [r["event"] if r["event"] == "audit_log" else r["path"] for r in full_disk["records"]]
    assert paths.index("audit_log") < paths.index("/req/100"), paths[-5:]


def test_disk_full_leaves_the_audit_log_one_record_per_line(full_disk):
    """A line cut short by the full disk must not swallow the next record once there is space."""
    bad = [line[:160] + b" ... " + line[-120:] for line in full_disk["bad_lines"]]
    assert bad == [], f"BUG: audit lines that are not one JSON object after the disk filled up: {bad}"
    assert any(r["path"] == "/req/100" and r["decision"] == "allow" for r in full_disk["records"])


def test_disk_full_malformed_request_is_answered_not_left_hanging(full_disk):
    """A request mitmproxy's parser refuses is recorded from inside the HTTP layer; a failed write
    there must still end in a refusal or a close, not a connection left open until tcp_timeout."""
    outcome = full_disk["malformed"]
    crashed = "mitmproxy has crashed" in full_disk["log_while_full"]
    assert not outcome.timed_out, (
        f"BUG: no answer and no close within 3 s (the connection is held until tcp_timeout; "
        f"layer crashed: {crashed}): {outcome}")
    assert all(s >= 400 for s in outcome.statuses), outcome


def test_audit_log_that_cannot_be_reopened_stops_allowing(tmp_path, upstreams, pki):
    """logrotate moves the file and sends SIGHUP, but the path cannot be opened any more (here: a
    read-only bind mount over it). The gateway must not carry on deciding without a log."""
    audit = tmp_path / "audit.jsonl"
    gateway = make_gateway(tmp_path / "gw", upstreams, pki, RULES, audit_path=audit)
    readonly = tmp_path / "readonly-audit"
    readonly.write_text("")
    mounted = False
    try:
        assert fetch(gateway, 1).status == 200
        mount("--bind", str(readonly), str(audit))
        mounted = True
        mount("-o", "remount,bind,ro", str(audit))
        gateway.process.send_signal(signal.SIGHUP)
        # the reopen is logged once it has been tried (reopened, or the error)
        value_when(gateway.log, lambda log: "reopen" in log or "SIGHUP" in log)
        upstreams.reset()

        response = fetch(gateway, 2)
        forwarded = [r.path for r in upstreams.plain["allowed.test"].requests]
        umount(audit)
        mounted = False
        recorded = [r["path"] for r in audit_lines(audit)[0]]
        assert "/req/2" in recorded or (response.status >= 500 and forwarded == []), (
            f"BUG: after a failed reopen the gateway forwarded {forwarded} with status {response.status} "
            f"and wrote no audit line (audit has {recorded}); log:\n{gateway.log()[-1500:]}")
    finally:
        if mounted:
            umount(audit)
        gateway.stop()
