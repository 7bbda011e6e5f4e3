"""--profile: where the gateway's CPU time goes (py-spy or cProfile under load), instead of the rounds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import report  # bench/report.py
from lib.load import run_hey
from lib.log import BenchError, log
from lib.names import PROJECT_ROOT
from lib.processes import Service, wait_for_port
from lib.procfs import python_pid
from lib.proxies import start_proxy
from lib.results import RunMeta
from lib.session import Setup


def run_profile(setup: Setup, args, meta: RunMeta) -> dict:
    """Record the gateway (one worker) and bare mitmdump under load with py-spy (or, with
    --profile-tool cprofile or when py-spy cannot attach, the gateway under cProfile), and group the
    samples by what the code does (bench/profiling.py)."""
    import profiling

    out_dir = args.results / f"profile-{meta.stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    tool = args.profile_tool
    if tool == "py-spy" and not Path(pyspy).exists() and not shutil.which("py-spy"):
        raise BenchError("py-spy not found: /tmp/venv/bin/pip install py-spy (or --profile-tool cprofile)")
    results: dict = {"tool": tool, "duration": args.profile_seconds, "dir": str(out_dir), "runs": {}}
    for key in args.profile_configs:
        proxy = setup.proxies[key]
        for figure, keepalive in (("keepalive", True), ("newconn", False)):
            name = f"{key}-{figure}"
            raw_path = out_dir / f"{name}.raw"
            log(f"profile: {name} ({args.profile_seconds:g} s of hey -c {args.concurrency}, {tool})")
            hey = threading.Thread(target=lambda: results["runs"].setdefault(name, {}).update(
                hey=run_hey(setup, proxy, args.profile_seconds + 2, args.concurrency, keepalive)))
            hey.start()
            time.sleep(1.0)
            # --nonblocking: py-spy reads the stacks without stopping the process (stopping it 200 times
            # a second slowed the proxy under test by a third or more)
            spy = subprocess.run([pyspy, "record", "-p", str(proxy.pid), "-d", f"{args.profile_seconds:g}",
                                  "-r", "200", "-f", "raw", "-o", str(raw_path)]
                                 + (["--native"] if args.profile_native else ["--nonblocking"]),
                                 capture_output=True, text=True, timeout=args.profile_seconds + 60)
            hey.join()
            if spy.returncode != 0 or not raw_path.exists():
                raise BenchError(f"py-spy failed ({spy.returncode}): {(spy.stderr or spy.stdout).strip()[-800:]} "
                                 "— try --profile-tool cprofile")
            summary = profiling.summarise(raw_path.read_text())
            results["runs"][name].update(summary=summary, raw=str(raw_path))
            (out_dir / f"{name}.md").write_text(profiling.markdown(name, summary))
            h = results["runs"][name]["hey"]
            log(f"  {summary['samples']} samples; {h['rps']:.0f}/s during the recording; top groups: "
                + ", ".join(f"{g} {n / max(1, summary['samples']):.0%}" for g, n in list(summary["groups"].items())[:4]))
    return results


def run_cprofile(setup: Setup, args, meta: RunMeta, tools: dict[str, str]) -> dict:
    """The gateway (one worker) under `python -m cProfile`, for a keep-alive then a new-connection run;
    stats are written when it exits on SIGTERM."""
    import pstats

    import profiling

    out_dir = args.results / f"profile-{meta.stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"tool": "cprofile", "duration": args.profile_seconds, "dir": str(out_dir), "runs": {}}
    for figure, keepalive in (("keepalive", True), ("newconn", False)):
        name = f"gateway-{figure}"
        prof = out_dir / f"{name}.prof"
        proxy = start_proxy(setup, "gateway", tools)
        # restart the same command under cProfile
        proxy.service.stop()
        cmd = proxy.cmd
        profiled = cmd[:1] + ["-m", "cProfile", "-o", str(prof)] + cmd[1:]
        service = Service(f"{name}-cprofile", setup.cpu(0) + setup.wrap_hosts + profiled,
                          setup.workdir / f"{name}-cprofile.log", env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)),
                          cwd=PROJECT_ROOT)
        service.start()
        proxy.service, proxy.pid = service, service.pid
        wait_for_port(proxy.host, proxy.port, service.proc)
        proxy.pid = python_pid(service.pid)
        log(f"profile: {name} under cProfile ({args.profile_seconds:g} s)")
        hey = run_hey(setup, proxy, args.profile_seconds, args.concurrency, keepalive)
        service.stop()
        stats = pstats.Stats(str(prof))
        summary = profiling.summarise_pstats(stats)
        results["runs"][name] = {"hey": hey, "summary": summary, "raw": str(prof)}
        (out_dir / f"{name}.md").write_text(profiling.markdown(name, summary))
    return results


def write_profile(args, meta: RunMeta, result: dict | None, failed: bool) -> int:
    import profiling

    if not result:
        log("profile: nothing recorded")
        return 1
    L = [f"# Profile — {meta.started}", "",
         f"Commit {meta.commit}{' (+ uncommitted changes)' if meta.dirty else ''}; {meta.machine}; "
         f"load average at start {meta.loadavg_start}, at end {meta.loadavg_end}. Tool: {result['tool']}, "
         f"{result['duration']:g} s per recording, hey -c {args.concurrency}; the proxy pinned to CPU 0, hey and "
         f"nginx to CPU 1.", ""]
    for name, run in result["runs"].items():
        h = run.get("hey", {})
        L.append(f"{name}: {report.fmt(h.get('rps'))} requests/s during the recording, proxy CPU "
                 f"{report.fmt(h.get('cpu_us_per_req'), 0)} µs per request.")
        L.append("")
        L.append(profiling.markdown(name, run["summary"]))
    text = "\n".join(L)
    print(text)
    stamp = meta.stamp
    for name in ("profile-latest", f"profile-{stamp}"):
        (args.results / f"{name}.md").write_text(text)
        (args.results / f"{name}.json").write_text(json.dumps({"meta": meta.to_json(), "profile": result}, indent=2,
                                                              default=str) + "\n")
    log(f"profile: {args.results / 'profile-latest.md'} (raw stacks in {result['dir']})")
    return 1 if failed else 0
