#!/usr/bin/env python3
"""CPU per keep-alive request and per new TLS connection: the gateway (one worker) against bare
mitmdump, interleaved in one run (issue 18). Needs neither nginx nor hey.

    python bench/cpu_per_request.py                              # 3 rounds, mitmdump and this tree's gateway
    python bench/cpu_per_request.py --baseline /tmp/gw-before --configs mitmdump,gateway,baseline
    python bench/cpu_per_request.py --profile --configs mitmdump,gateway    # py-spy instead of the rounds

The origin, the policy and the proxies' command lines are bench/tunnel_memory.py's (a Python TLS origin
named origin.bench on --port-base, the proxies on the next ports; mitmdump bare, intercepting, lazy;
the gateway `run --workers 1 -q`). Each proxy is pinned to CPU 0, the origin and the load client
(bench/request_load.py) to CPU 1; every round starts fresh proxies, in alternating order. For each:
a warm-up, then `keepalive` (--concurrency tunnels opened first, then GET after GET on each for
--seconds: the proxy's CPU time over that span / requests answered) and `newconn` (--concurrency
loops of CONNECT, TLS, one GET, close, for --seconds: CPU / tunnels completed). CPU is the proxy
process's utime + stime from /proc. Ratios to mitmdump are taken per round, the report gives their
median (min-max).

--profile records each configuration with py-spy (--nonblocking, 200 Hz) during the same two loads
and groups the samples with bench/profiling.py; --pyspy names the binary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import profiling
import tunnel_memory
from tunnel_memory import BENCH_DIR, ORIGIN_NAME, Run, cpu_seconds, log, own_pid, stop

PROXY_CPU, LOAD_CPU = {0}, {1}


def _pin(pid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(pid, cpus & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    except OSError:
        pass


class CpuRun(Run):
    def load(self, proc, ca: str, kind: str, seconds: float) -> subprocess.Popen:
        cmd = [self.python, str(BENCH_DIR / "request_load.py"), "--proxy", f"127.0.0.1:{proc.port}",
               "--target", f"{ORIGIN_NAME}:{self.origin_port}", "--cafile", ca,
               "--concurrency", str(self.args.concurrency), "--seconds", str(seconds), kind]
        client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _pin(client.pid, LOAD_CPU)
        return client

    @staticmethod
    def finish(client: subprocess.Popen) -> dict:
        out, err = client.communicate(timeout=120)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if client.returncode != 0 or not lines:
            raise RuntimeError(f"load client failed ({client.returncode}): {err[-800:]}")
        report = json.loads(lines[-1])
        if report["failed"]:
            raise RuntimeError(f"load client: {report}")
        return report

    def keepalive(self, proc, pid: int, ca: str, seconds: float, during=None) -> dict:
        client = self.load(proc, ca, "keepalive", seconds)
        if json.loads(client.stdout.readline() or "{}").get("ready") is not True:
            self.finish(client)
        cpu = cpu_seconds(pid)
        client.stdin.write("go\n")
        client.stdin.flush()
        extra = during() if during else None
        report = self.finish(client)
        cpu = cpu_seconds(pid) - cpu
        return {"done": report["done"], "per_s": report["done"] / seconds, "cpu_us": 1e6 * cpu / report["done"],
                "extra": extra}

    def newconn(self, proc, pid: int, ca: str, seconds: float, during=None) -> dict:
        cpu = cpu_seconds(pid)
        client = self.load(proc, ca, "newconn", seconds)
        extra = during() if during else None
        report = self.finish(client)
        cpu = cpu_seconds(pid) - cpu
        return {"done": report["done"], "per_s": report["done"] / seconds, "cpu_us": 1e6 * cpu / report["done"],
                "extra": extra}

    def started(self, key: str):
        for attempt in range(5):
            try:
                proc, ca = self.start(key)
                break
            except RuntimeError:  # its port was taken meanwhile (a client's ephemeral port): another one
                if attempt == 4:
                    raise
                self.ports[key] = next(port for port in range(self.args.port_last, self.args.port_base, -1)
                                       if port not in self.ports.values() and tunnel_memory.port_free(port))
        pid = own_pid(proc)
        _pin(pid, PROXY_CPU)
        self.keepalive(proc, pid, ca, self.args.warmup_seconds)  # certificates, caches, lazy imports
        self.newconn(proc, pid, ca, self.args.warmup_seconds)
        return proc, pid, ca

    def measure(self, key: str) -> dict:
        proc, pid, ca = self.started(key)
        try:
            return {"keepalive": self.keepalive(proc, pid, ca, self.args.seconds),
                    "newconn": self.newconn(proc, pid, ca, self.args.seconds)}
        finally:
            stop(proc)

    def profile(self, key: str, out: Path) -> dict:
        proc, pid, ca = self.started(key)
        found = {}
        try:
            for kind in ("keepalive", "newconn"):
                raw = out / f"{key}-{kind}.raw"

                def record() -> None:
                    time.sleep(0.5)
                    subprocess.run([self.args.pyspy, "record", "-p", str(pid), "-d", f"{self.args.seconds - 1:g}",
                                    "-r", "200", "-f", "raw", "-o", str(raw),
                                    "--native" if self.args.native else "--nonblocking"],
                                   capture_output=True, check=True, timeout=self.args.seconds + 60)

                figure = getattr(self, kind)(proc, pid, ca, self.args.seconds, during=record)
                summary = profiling.summarise(raw.read_text())
                (out / f"{key}-{kind}.md").write_text(profiling.markdown(f"{key}-{kind}", summary))
                found[kind] = {"figure": figure, "raw": str(raw), "groups": summary["groups"],
                               "samples": summary["samples"]}
                log(f"  {key} {kind}: {figure['per_s']:.0f}/s, {figure['cpu_us']:.0f} µs CPU each, "
                    f"profile {out / f'{key}-{kind}.md'}")
        finally:
            stop(proc)
        return found


def _first_free(args, configs: list[str]) -> CpuRun:
    """A run on --port-base or, when one of its ports is taken (a client's ephemeral port, on a shared
    machine), on the next ten ports up, up to --port-last."""
    while True:
        try:
            return CpuRun(args, configs)
        except RuntimeError as exc:
            if "is taken" not in str(exc) or args.port_base + 14 > args.port_last:
                raise
            args.port_base += 10


def _paired(results: dict, key: str, other: str, kind: str) -> str:
    """Median (min-max) of the per-round ratios of `key`'s CPU to `other`'s, then each round's."""
    ratios = [r[key][kind]["cpu_us"] / r[other][kind]["cpu_us"] for r in results["rounds"]]
    return (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}): "
            + ", ".join(f"{x:.2f}" for x in ratios))


def report(results: dict, configs: list[str]) -> str:
    others = [c for c in ("mitmdump", "baseline") if c in configs]
    out = [f"# CPU per request ({len(results['rounds'])} rounds of {results['seconds']:g} s, concurrency "
           f"{results['concurrency']}, commit {results['commit']}, {results['started']})", ""]
    for kind, title in (("keepalive", "keep-alive requests"), ("newconn", "new TLS connections (tunnels)")):
        out += [f"{title}:", "", "| " + " | ".join(["configuration", "per s", "CPU µs each"]
                                                   + [f"× {o} (per round)" for o in others]) + " |",
                "|---|---:|---:|" + "---|" * len(others)]
        for key in configs:
            rounds = [r[key][kind] for r in results["rounds"]]
            row = [key, f"{statistics.median(r['per_s'] for r in rounds):.0f}",
                   f"{statistics.median(r['cpu_us'] for r in rounds):.0f}"]
            row += [_paired(results, key, o, kind) if o != key else "1" for o in others]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0, help="seconds of each load (and of each profile)")
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--configs", default="mitmdump,gateway",
                   help="mitmdump, gateway (this tree's), baseline (the gateway of the tree --baseline names), floor "
                        "(mitmproxy with only the addons serving needs: bench/mitmproxy_floor.py)")
    p.add_argument("--baseline", help="another checkout of the gateway (e.g. `git archive` of an older commit)")
    p.add_argument("--profile", action="store_true", help="py-spy profiles of each configuration instead of the rounds")
    p.add_argument("--native", action="store_true",
                   help="py-spy --native: C frames too (OpenSSL, the garbage collector); stops the process per sample")
    p.add_argument("--pyspy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument("--port-base", type=int, default=31600, help="the origin's port; the proxies' follow it")
    p.add_argument("--port-last", type=int, default=31999, help="the highest port the run may take")
    p.add_argument("--mitmdump", help="mitmdump to run (default: next to this Python)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--keep-workdir", action="store_true")
    args = p.parse_args(argv)
    args.details, args.sse = False, False  # (what tunnel_memory's Run reads that this run does not set)
    tunnel_memory._raise_nofile(20000)
    configs = [c for c in args.configs.split(",") if c]
    run = _first_free(args, configs)
    _pin(run.origin.pid, LOAD_CPU)
    results: dict = {"rounds": [], "seconds": args.seconds, "concurrency": args.concurrency,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              cwd=tunnel_memory.PROJECT_ROOT).stdout.strip()}
    try:
        if args.profile:
            out = run.work / "profiles"
            out.mkdir()
            args.keep_workdir = True
            results["profiles"] = {key: run.profile(key, out) for key in configs}
        else:
            for r in range(args.rounds):
                this = {}
                for key in (configs if r % 2 == 0 else configs[::-1]):
                    log(f"round {r + 1}: {key}")
                    this[key] = run.measure(key)
                    log(f"  {json.dumps(this[key])}")
                results["rounds"].append(this)
    finally:
        run.close()
    if results["rounds"]:
        print(report(results, configs))
    for key, kinds in results.get("profiles", {}).items():
        for kind, found in kinds.items():
            shares = ", ".join(f"{g} {n / max(1, found['samples']):.1%}" for g, n in list(found["groups"].items())[:8])
            print(f"- {key} {kind}: {found['figure']['cpu_us']:.0f} µs CPU each; {shares}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
