#!/usr/bin/env python3
"""What a second worker adds: the gateway with 2 workers against 1, each worker held to the same CPU
quota, interleaved in one run (issue 18's scaling target). Needs neither nginx nor hey.

    python bench/worker_scaling.py                         # 3 rounds, 0.4 core per worker
    python bench/worker_scaling.py --rounds 5 --cores-each 0.3 --seconds 10

The origin, the policy and the gateway's command line are bench/tunnel_memory.py's (a Python TLS
origin named origin.bench on --port-base, `run -q --workers 1` or `--workers 2` on the next ports),
the load is bench/request_load.py's (CONNECT, TLS through the tunnel, GET), as in
bench/cpu_per_request.py. Why a quota: this machine has two cores, and the load client and the origin
need some of them; unthrottled, two workers would measure what the machine has left, not what a
worker adds. So every worker process is held to --cores-each CPU-seconds per second (bench/cpuquota.py:
a cgroup of its own, root), free to run on any CPU, and 2 workers ideally do twice what 1 does. The
supervisor of the 2-worker gateway is not held (it serves no connection: it forwards audit lines) and
its CPU is reported.

Each round starts both configurations fresh, in alternating order. For each: a warm-up with the
workers unthrottled (certificates, caches, lazy imports), then the quota, then `newconn`
(--concurrency loops of CONNECT, TLS, one GET, close, for --seconds) and `keepalive` (--concurrency
tunnels opened first, then GET after GET on each for --seconds). Reported per load: completed per
second, the ratio 2 workers / 1 worker per round (median, min-max), how much of its quota each worker
used (about 1 for every worker: the workers, not the load, set the pace; one worker well below 1
while the other is at 1: the kernel's SO_REUSEPORT hash gave it fewer connections), completed per
worker CPU-second (efficiency: below the 1-worker figure means a worker does more per connection when
there are two), and the CPU of the supervisor and of the load client.

Not a test: pytest does not collect bench/ (tests/load/test_bench_scripts.py runs one short round).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tunnel_memory
from cpu_per_request import CpuRun
from cpuquota import CpuQuota
from lib.procfs import process_tree
from tunnel_memory import cpu_seconds, log, own_pid, stop

CONFIGS = ("gateway", "gateway_w2")
KINDS = (("newconn", "new TLS connections"), ("keepalive", "keep-alive requests"))


class ScalingRun(CpuRun):
    def __init__(self, args, quota: CpuQuota) -> None:
        super().__init__(args, list(CONFIGS))
        self.quota = quota

    def load(self, proc, ca: str, kind: str, seconds: float) -> subprocess.Popen:
        client = super().load(proc, ca, kind, seconds)
        os.sched_setaffinity(client.pid, os.sched_getaffinity(0))  # (CpuRun pins it: here the quota bounds the workers)
        return client

    def _window(self, proc, ca: str, kind: str, seconds: float, pids: list[int]) -> dict:
        """One load of `kind` for `seconds`: completed, and the CPU of each of `pids` and of the client over
        the window's wall time (the client's start and its last replies included: CPU over `seconds`
        alone would read as more than a quota)."""
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        client = self.load(proc, ca, kind, seconds)
        if kind == "keepalive":  # its tunnels are opened before the window
            if json.loads(client.stdout.readline() or "{}").get("ready") is not True:
                self.finish(client)
        cpu = {pid: cpu_seconds(pid) for pid in pids}
        started = time.monotonic()
        if kind == "keepalive":
            client.stdin.write("go\n")
            client.stdin.flush()
        report = self.finish(client)
        wall = time.monotonic() - started
        cpu = {pid: cpu_seconds(pid) - cpu[pid] for pid in pids}
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
        return {"done": report["done"], "seconds": seconds, "wall": wall, "cpu": cpu, "client_cpu": client_cpu}

    def measure(self, key: str) -> dict:
        proc, ca = self.start(key)
        try:
            root = own_pid(proc)
            tree = process_tree(root)
            workers = [pid for pid in tree if pid != root] or [root]
            supervisor = [root] if workers != [root] else []
            for kind, _ in KINDS:  # warm-up, unthrottled
                self._window(proc, ca, kind, self.args.warmup_seconds, workers)
            for pid in workers:
                self.quota.limit(pid, self.args.cores_each)
            try:
                out = {"workers": len(workers)}
                for kind, _ in KINDS:
                    w = self._window(proc, ca, kind, self.args.seconds, workers + supervisor)
                    worker_cpu = [w["cpu"][pid] for pid in workers]
                    out[kind] = {
                        "per_s": w["done"] / w["seconds"], "done": w["done"],
                        "quota_used": [round(c / (self.args.cores_each * w["wall"]), 3) for c in worker_cpu],
                        "per_worker_cpu_s": w["done"] / sum(worker_cpu) if sum(worker_cpu) else None,
                        "supervisor_cores": sum(w["cpu"][pid] for pid in supervisor) / w["wall"] if supervisor else None,
                        "client_cores": w["client_cpu"] / w["wall"]}
            finally:
                for pid in workers:
                    self.quota.unlimit(pid)
            return out
        finally:
            stop(proc)


def _ratios(results: dict, kind: str) -> list[float]:
    return [r["gateway_w2"][kind]["per_s"] / r["gateway"][kind]["per_s"] for r in results["rounds"]]


def report(results: dict) -> str:
    out = [f"# 2 workers / 1 worker, {results['cores_each']:g} core per worker ({len(results['rounds'])} rounds of "
           f"{results['seconds']:g} s, concurrency {results['concurrency']}, commit {results['commit']}, "
           f"{results['started']})", "",
           "| load | 1 worker, per s | 2 workers, per s | ratio, median (min–max) | per round | quota used, 1 / 2 | "
           "per worker CPU-s, 1 / 2 | supervisor cores | load client cores, 1 / 2 |",
           "|---|---:|---:|---|---|---|---|---:|---|"]
    med = statistics.median
    for kind, title in KINDS:
        one = [r["gateway"][kind] for r in results["rounds"]]
        two = [r["gateway_w2"][kind] for r in results["rounds"]]
        ratios = _ratios(results, kind)
        used1 = med(u for x in one for u in x["quota_used"])
        used2 = " + ".join(f"{med(x['quota_used'][i] for x in two):.2f}" for i in range(len(two[0]["quota_used"])))
        out.append(f"| {title} | {med(x['per_s'] for x in one):.1f} | {med(x['per_s'] for x in two):.1f} | "
                   f"**{med(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f}) | "
                   + ", ".join(f"{x:.2f}" for x in ratios) + " | "
                   f"{used1:.2f} / {used2} | {med(x['per_worker_cpu_s'] for x in one):.0f} / "
                   f"{med(x['per_worker_cpu_s'] for x in two):.0f} | {med(x['supervisor_cores'] for x in two):.3f} | "
                   f"{med(x['client_cores'] for x in one):.2f} / {med(x['client_cores'] for x in two):.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="seconds of each load")
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--cores-each", type=float, default=0.4, help="CPU quota of each worker, in cores")
    p.add_argument("--port-base", type=int, default=31700, help="the origin's port; the gateways' follow it")
    p.add_argument("--port-last", type=int, default=31999, help="the highest port the run may take")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--keep-workdir", action="store_true")
    args = p.parse_args(argv)
    args.details, args.sse, args.mitmdump, args.baseline = False, False, None, None  # (what Run reads)
    quota = CpuQuota()
    if not quota.available:
        print(f"worker_scaling: CPU quotas are {quota.describe()}", file=sys.stderr)
        return 2
    tunnel_memory._raise_nofile(20000)
    run = None
    results: dict = {"rounds": [], "seconds": args.seconds, "concurrency": args.concurrency,
                     "cores_each": args.cores_each, "quota": quota.describe(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              cwd=tunnel_memory.PROJECT_ROOT).stdout.strip()}
    try:
        run = ScalingRun(args, quota)
        for r in range(args.rounds):
            this = {}
            for key in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
                log(f"round {r + 1}: {key}")
                this[key] = run.measure(key)
                log(f"  {json.dumps(this[key])}")
            results["rounds"].append(this)
    finally:
        if run is not None:
            run.close()
        left = quota.destroy()
        if left:
            log(f"cgroups left behind: {left}")
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
