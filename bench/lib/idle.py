"""The idle-tunnel figure: the proxy's memory with many idle tunnels open through it."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time

from lib.log import BenchError
from lib.names import BENCH_DIR, IDLE_SOURCES, ORIGIN_NAME, SMALL_PATH
from lib.processes import clean_env
from lib.procfs import memory
from lib.session import Proxy, Setup


def run_idle(setup: Setup, proxy: Proxy, count: int) -> dict:
    """RSS of the proxy (all its processes) with `count` idle tunnels open through it, each with TLS
    established through the tunnel and one request answered (bench/idle_tunnels.py, on the client CPU)."""
    before = memory(proxy.pids())
    cmd = setup.cpu(1) + [sys.executable, str(BENCH_DIR / "idle_tunnels.py"), "--proxy", f"{proxy.host}:{proxy.port}",
                          "--target", f"{ORIGIN_NAME}:443", "--cafile", str(proxy.client_ca), "--path", SMALL_PATH,
                          "--count", str(count), "--concurrency", "32", "--sources", IDLE_SOURCES]
    t0 = time.monotonic()
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env())
    try:
        ready, _, _ = select.select([client.stdout], [], [], 240)
        line = client.stdout.readline() if ready else ""
        if not line:
            client.kill()
            raise BenchError(f"idle tunnels through {proxy.key}: no report from the client "
                             f"({client.stderr.read()[-500:] if client.poll() is not None else 'timed out'})")
        opened = json.loads(line)
        time.sleep(1.0)  # let the proxy settle (buffers, lazy upstream work)
        with_tunnels = memory(proxy.pids())
        time.sleep(0.5)
        again = memory(proxy.pids())
        if again["rss_kib"] > with_tunnels["rss_kib"]:
            with_tunnels = again
    finally:
        if client.poll() is None:
            client.stdin.close()
            try:
                client.wait(60)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(5)
    tail = client.stdout.read() if client.stdout else ""
    still = None
    for ln in tail.splitlines():
        try:
            still = json.loads(ln).get("still_open_at_end", still)
        except ValueError:
            pass
    time.sleep(1.5)  # the proxy closes both sides before the next configuration opens its own
    after = memory(proxy.pids())
    n = opened["open"]
    return {
        "tunnels": n, "failed": opened["failed"], "errors": opened.get("errors"), "open_seconds": opened["seconds"],
        "still_open_at_end": still, "wall_s": round(time.monotonic() - t0, 1),
        "rss_idle_mib": before["rss_kib"] / 1024, "rss_tunnels_mib": with_tunnels["rss_kib"] / 1024,
        "rss_after_mib": after["rss_kib"] / 1024,
        "pss_idle_mib": before["pss_kib"] / 1024 if before["pss_kib"] is not None else None,
        "pss_tunnels_mib": with_tunnels["pss_kib"] / 1024 if with_tunnels["pss_kib"] is not None else None,
        "kib_per_tunnel": (with_tunnels["rss_kib"] - before["rss_kib"]) / n if n else None,
        "processes": with_tunnels["processes"],
    }
