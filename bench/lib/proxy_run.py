"""The part of a run with processes up: bring-up, then the profile or the warm-up, the interleaved rounds,
the idle-tunnel figure and the streaming group, then tear-down, whatever happened. A failure is a
warning in the meta and `failed`, never an exception, so that the report is still written."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import streaming  # bench/streaming.py: the streaming group
from lib import bringup, figures
from lib.bringup import Plan
from lib.environment import loadavg
from lib.log import BenchError, log
from lib.profile_runs import run_cprofile, run_profile
from lib.results import Figures, RunMeta
from lib.rounds import restart_proxies, warm_up
from lib.session import Setup
from lib.transparent import transparent_unavailable


def run_with_proxies(args, meta: RunMeta, measured: Figures, groups: list[str], workdir: Path,
                     deadline: float) -> tuple[Setup | None, bool]:
    """Every group but the decision figure; returns the Setup (None if none was made) and whether it failed."""
    setup: Setup | None = None
    failed = False
    try:
        drop_unavailable_transparent(args, meta, groups)
        proxy_groups = [g for g in groups if g != "decision"]
        if proxy_groups or args.profile:
            setup, tools = bringup.prepare(args, meta, groups, workdir)
            plan = bringup.start(setup, args, meta, groups, tools)
            if args.profile:
                measured.profile = (run_cprofile(setup, args, meta, tools) if args.profile_tool == "cprofile"
                                   else run_profile(setup, args, meta))
            else:
                measure(setup, args, meta, measured, groups, plan, tools, deadline)
            figures.check_proxy_logs(setup, meta)
        else:
            meta.nginx = "n/a"
            meta.pinned = False
    except KeyboardInterrupt:
        meta.warnings.append("interrupted")
        failed = True
    except (BenchError, RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"ERROR: {exc}")
        meta.warnings.append(f"error: {exc}".splitlines()[0])
        failed = True
    finally:
        bringup.tear_down(setup, meta)
    return setup, failed


def drop_unavailable_transparent(args, meta: RunMeta, groups: list[str]) -> None:
    """Without network namespaces the transparent group is skipped with a warning, or, when it was asked
    for by name (--only), the run fails."""
    if "transparent" not in groups or args.profile:
        return
    reason = transparent_unavailable()
    if reason:
        if args.only_given:
            raise BenchError(f"transparent mode cannot run here: {reason}")
        meta.warnings.append(f"transparent figures skipped: {reason}")
        log(f"transparent figures skipped: {reason}")
        groups.remove("transparent")
        meta.groups = groups


def measure(setup: Setup, args, meta: RunMeta, measured: Figures, groups: list[str], plan: Plan,
            tools: dict[str, str], deadline: float) -> None:
    if plan.warm:
        warm_up(setup, args, plan.warm)
    run_rounds(setup, args, meta, measured, plan, tools, deadline)
    if plan.idle_configs:
        figures.idle(setup, args, meta, measured, plan)
    if "streaming" in groups:
        measured.streaming = streaming.run(setup, args, meta, tools)


def run_rounds(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan, tools: dict[str, str],
               deadline: float) -> None:
    """The interleaved rounds: each figure once per round, fresh proxy processes before each but the first."""
    per_round = [(plan.configs, figures.throughput), (plan.configs, figures.latency), (plan.scaling, figures.scaling),
                 (plan.transparent_keys, figures.transparent), (plan.bulk_keys, figures.bulk)]
    for rnd in range(args.rounds):
        if time.monotonic() > deadline:
            meta.warnings.append(f"time limit reached: stopped after {rnd} rounds")
            break
        if not (plan.configs or plan.scaling or plan.transparent_keys or plan.bulk_keys):
            break
        if rnd and not args.same_processes:
            restart_proxies(setup, tools, plan.warm, plan.bulk_keys, args)
        meta.loadavg_rounds.append(loadavg())
        log(f"round {rnd + 1}/{args.rounds}; load average {meta.loadavg_rounds[-1]}")
        for keys, one_round in per_round:
            if keys:
                one_round(setup, args, meta, measured, plan, rnd)
        meta.rounds_done = rnd + 1
