"""The issue-18 benchmark scripts still run from end to end (a short run of each, one configuration):
bench/cpu_per_request.py broke silently when bench/tunnel_memory.py's `Run` grew arguments, and
nothing noticed until the next measurement. This measures nothing: it checks that each script
completes and prints its report line. Loopback only (the scripts' own origin on 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.load

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _free_block(size: int = 12) -> int:
    """A port with `size` free ports after it (the scripts take consecutive ports from --port-base)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size > 65535:
            continue
        taken = False
        for port in range(base, base + size):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    taken = True
                    break
        if not taken:
            return base
    pytest.skip("no block of free loopback ports")


def _run(*argv: str) -> str:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the benchmark scripts give their proxies a private /etc/hosts (root, unshare)")
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_cpu_per_request_completes_a_round():
    base = _free_block()
    out = _run(str(BENCH / "cpu_per_request.py"), "--rounds", "1", "--seconds", "1", "--warmup-seconds", "0.5",
               "--configs", "gateway,floor", "--port-base", str(base), "--port-last", str(base + 11))
    assert "| gateway |" in out and "| floor |" in out, out


@pytest.mark.parametrize("sse", [False, True], ids=["idle", "sse"])
def test_tunnel_memory_completes_a_round(sse):
    base = _free_block()
    out = _run(str(BENCH / "tunnel_memory.py"), "--count", "20", "--rounds", "1", "--warmup", "2", "--settle", "0.2",
               "--configs", "gateway", "--port-base", str(base), *(["--sse"] if sse else []))
    assert "median KiB per" in out, out


def test_worker_scaling_completes_a_round():
    sys.path.insert(0, str(BENCH))
    try:
        from cpuquota import CpuQuota
    finally:
        sys.path.remove(str(BENCH))
    quota = CpuQuota()
    if not quota.available:
        pytest.skip(f"CPU quotas are {quota.describe()}")
    base = _free_block()
    out = _run(str(BENCH / "worker_scaling.py"), "--rounds", "1", "--seconds", "1", "--warmup-seconds", "0.5",
               "--concurrency", "8", "--port-base", str(base), "--port-last", str(base + 11))
    assert "| new TLS connections |" in out and "| keep-alive requests |" in out, out
