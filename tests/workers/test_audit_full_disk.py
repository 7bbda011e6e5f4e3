"""`--workers N` with a full audit disk: no request leaves unrecorded.

The supervisor writes the workers' lines; a worker has already let its request go when its line
reaches the supervisor. Before the fix, the supervisor logged "worker N's line lost" and every
worker went on allowing, unrecorded. Now the supervisor holds the lines it cannot write and raises
a shared flag: every worker then refuses (500 internal_error) as one process does, /readyz says
why, the held lines are written once there is room, followed by an `audit_log` line, and every
request that reached the upstream has its line.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway.audit import verify_chain
from tests.faults.test_audit_faults import fill

from . import procs
from .harness import make_gateway, probe_http, probe_until_every_worker

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount)")


def readyz(gateway) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_full_audit_disk_with_workers_fails_closed_and_loses_no_line(tmp_path, upstreams, pki, slow_upstream):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], check=True)
    gateway = make_gateway(tmp_path / "gw", upstreams, pki, workers=2, args=["--audit-chain"], metrics=True)
    gateway.audit_path = tiny / "audit.jsonl"
    try:
        gateway.start()
        probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/warm"))
        filler = fill(tiny)
        upstreams.reset()

        # While the supervisor has not failed a write yet, requests pass (their lines fit in the
        # file's last page, or are held); from its first failure on, every worker refuses.
        before = [probe_http(gateway, "allowed.test", f"/full/{n}") for n in range(40)]
        assert any(p.status == 500 for p in before), f"the disk never filled up: {before}"
        assert all((p.status, p.reason) in ((200, None), (500, "internal_error")) for p in before), before
        procs.wait_for(lambda: readyz(gateway)[0] == 503, 10, what="/readyz to say not ready")
        status, body = readyz(gateway)
        assert "audit_log: FAIL" in body and "No space left on device" in body, body
        after = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/flagged"))
        assert all((p.status, p.reason) == (500, "internal_error") for p in after), after
        assert "/flagged" not in {r.path for r in upstreams.plain["allowed.test"].requests}
        forwarded = {r.path for r in upstreams.plain["allowed.test"].requests}

        # Room again: held lines written, the outage recorded, workers decide again.
        filler.unlink()
        procs.wait_for(lambda: readyz(gateway)[0] == 200, 10, what="/readyz to say ready again")
        assert probe_http(gateway, "allowed.test", "/again").status == 200
        procs.wait_for(lambda: any(e.get("path") == "/again" for e in gateway.audit_entries()), 10,
                       what="the line of /again")
        entries = gateway.audit_entries()
        recorded = {e["path"] for e in entries if e["event"] == "request" and e["decision"] == "allow"}
        assert forwarded <= recorded, f"BUG: forwarded without an audit line: {sorted(forwarded - recorded)}"
        [outage] = [e for e in entries if e["event"] == "audit_log"]
        assert outage["late_lines"] >= 0 and outage["failed_writes"] >= 1, outage
        assert verify_chain([str(gateway.audit_path)]).ok
        assert "line lost" not in gateway.log()
    finally:
        gateway.stop()
        subprocess.run(["umount", "-l", str(tiny)], capture_output=True)
