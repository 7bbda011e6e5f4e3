"""The bulk figure: one large download through a proxy, its speed and the proxy's RSS meanwhile."""

from __future__ import annotations

import subprocess
import threading
import time

from lib.log import BenchError
from lib.names import BIG_PATH, ORIGIN_NAME
from lib.procfs import cpu_seconds, rss_kib
from lib.session import Proxy, Setup


def run_bulk(setup: Setup, proxy: Proxy, bulk_bytes: int) -> dict:
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            value = rss_kib(proxy.pid)
            if value is not None:
                samples.append(value)
            stop.wait(0.05)

    before = [v for v in (rss_kib(proxy.pid) for _ in range(3)) if v is not None]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = cpu_seconds(proxy.pid)
    cmd = setup.cpu(1) + ["curl", "-sS", "--fail", "--max-time", "180", "-x", proxy.url,
                          "--cacert", str(proxy.client_ca), "-o", "/dev/null",
                          "-w", "%{http_code} %{size_download} %{time_total}", f"https://{ORIGIN_NAME}{BIG_PATH}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    finally:
        stop.set()
        sampler.join()
    cpu1 = cpu_seconds(proxy.pid)
    time.sleep(0.5)
    after = rss_kib(proxy.pid)
    if out.returncode != 0:
        raise BenchError(f"bulk download through {proxy.key} failed: {out.stderr.strip()}")
    code, size, seconds = out.stdout.split()
    size_i, seconds_f = int(size), float(seconds)
    if code != "200" or size_i != bulk_bytes:
        raise BenchError(f"bulk download through {proxy.key}: status {code}, {size_i} of {bulk_bytes} bytes")
    rss_before = before[-1] if before else 0
    peak = max(samples + before) if samples or before else 0
    return {
        "mb_per_s": size_i / seconds_f / 1e6,
        "seconds": seconds_f,
        "rss_before_mib": rss_before / 1024,
        "rss_peak_mib": peak / 1024,
        "rss_growth_mib": (peak - rss_before) / 1024,
        "rss_after_mib": (after or 0) / 1024,
        "rss_samples": len(samples),
        "cpu_ms_per_mb": (cpu1 - cpu0) * 1000 / (size_i / 1e6) if cpu0 is not None and cpu1 is not None else None,
    }
