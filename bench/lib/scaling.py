"""The scaling figure: a gateway's workers each held to a CPU quota, so that N workers against one
measure what the workers add, not what the machine has left."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lib.load import run_hey
from lib.processes import restore_affinity, set_affinity
from lib.session import Proxy, Setup


@dataclass
class Throttle:
    """The scaling figure's set-up for one run: every worker of a gateway held to `cores_each` of CPU
    (cgroup quota) and, when pinning, every process of it on CPU 0 (the load generator keeps CPU 1)."""

    setup: Setup
    proxy: Proxy
    cores_each: float
    workers: list[int] = field(default_factory=list)
    previous_affinity: dict[int, set[int]] = field(default_factory=dict)
    stats0: dict[int, dict] = field(default_factory=dict)

    def __enter__(self) -> "Throttle":
        quota = self.setup.quota
        assert quota is not None and quota.available
        self.workers = self.proxy.worker_pids()
        for pid in self.workers:
            quota.limit(pid, self.cores_each)
        if self.setup.pin and self.setup.scaling_pin:
            self.previous_affinity = set_affinity(self.proxy.pids(), {0})
        elif self.setup.pin:  # every CPU: the quota alone bounds the gateway
            self.previous_affinity = set_affinity(self.proxy.pids(), set(range(os.cpu_count() or 1)))
        self.stats0 = {pid: quota.stats(pid) for pid in self.workers}
        return self

    def stats(self) -> dict:
        quota = self.setup.quota
        out = {}
        for pid in self.workers:
            now = quota.stats(pid)
            then = self.stats0.get(pid, {})
            out[str(pid)] = {k: now[k] - then.get(k, 0) for k in now if k in ("nr_periods", "nr_throttled",
                                                                              "throttled_usec", "usage_usec")}
        return out

    def __exit__(self, *exc) -> None:
        for pid in self.workers:
            self.setup.quota.unlimit(pid)
        restore_affinity(self.previous_affinity)


def run_scaling(setup: Setup, proxy: Proxy, duration: float, concurrency: int, keepalive: bool,
                cores_each: float) -> dict:
    with Throttle(setup, proxy, cores_each) as throttle:
        result = run_hey(setup, proxy, duration, concurrency, keepalive)
        result["throttle"] = throttle.stats()
        workers = throttle.workers
    wall = result["wall_s"]
    per_worker = [result["cpu_by_pid"].get(str(p), 0.0) for p in workers]
    result["workers"] = len(workers)
    result["cores_each"] = cores_each
    result["worker_cpu_s"] = per_worker
    # how much of its quota each worker used: ~1.0 means the worker, not the load generator, was the limit
    result["quota_used"] = [c / (cores_each * wall) for c in per_worker] if wall else None
    others = [c for p, c in result["cpu_by_pid"].items() if int(p) not in workers]
    result["supervisor_cpu_s"] = sum(others) if others else None  # None: one process, no supervisor
    gateway_cores = result["proxy_cpu_s"] / wall if wall else None
    result["gateway_cores"] = gateway_cores
    result["rps_per_gateway_core"] = result["rps"] / gateway_cores if gateway_cores else None
    return result
