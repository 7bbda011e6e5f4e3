"""One round of each figure (throughput, latency, scaling, transparent, bulk) and the idle-tunnel figure
after the rounds: which runs make it, in which order, and the progress line each prints."""

from __future__ import annotations

import re
import time

import report  # bench/report.py
from lib.bringup import Plan
from lib.bulk import run_bulk
from lib.idle import run_idle
from lib.load import run_hey
from lib.log import BenchError, log
from lib.results import Figures, RunMeta
from lib.rounds import note_failures, rotated
from lib.scaling import run_scaling
from lib.session import Setup

fmtn = report.fmt


def _each(meta: RunMeta, rnd: int, figure: str, keys, measure, line, pause: float) -> dict:
    """One figure of one round through every configuration in `keys`: each measured, its failures
    noted, its progress line logged, then a pause; the results by configuration."""
    results = {}
    for key in keys:
        res = measure(key)
        note_failures(meta, rnd, figure, key, res)
        results[key] = res
        log(line(key, res))
        time.sleep(pause)
    return results


def _rates(setup: Setup, args, measured: Figures, meta: RunMeta, rnd: int, keys, figures, width: int,
           more=lambda res: "") -> None:
    """Requests (keep-alive) and new TLS connections a second through each configuration in `keys`."""
    for figure, keepalive in figures:
        results = _each(
            meta, rnd, figure, rotated(keys, rnd),
            lambda key: run_hey(setup, setup.proxies[key], args.duration, args.concurrency, keepalive),
            lambda key, res: f"  {figure:{width}s} {key:22s} {res['rps']:9.1f}/s  cpu "
                             f"{fmtn(res.get('cpu_us_per_req'), 0)} µs/req{more(res)}",
            0.3)
        if results:
            measured.raw.setdefault(figure, []).append(results)


def throughput(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan, rnd: int) -> None:
    _rates(setup, args, measured, meta, rnd, plan.configs, (("keepalive", True), ("newconn", False)), 9,
           lambda res: f"  load-generator CPU {fmtn(res['loadgen_cpu_fraction'], 2)}")


def latency(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan, rnd: int) -> None:
    for figure, keepalive, rate in (("latency_keepalive", True, args.latency_rate),
                                    ("latency_newconn", False, args.latency_conn_rate)):
        def line(key: str, res: dict) -> str:
            s = sorted(res["samples_ms"])
            return (f"  {figure:17s} {key:22s} {len(s):4d} at {rate:g}/s  p50 "
                    f"{fmtn(report.percentile(s, 50), 2)} ms  p99 {fmtn(report.percentile(s, 99), 2)} ms")

        results = _each(
            meta, rnd, figure, rotated(plan.configs, rnd + 1),
            lambda key: run_hey(setup, setup.proxies[key], args.latency_duration, 1, keepalive, rate=rate),
            line, 0.2)
        if results:
            measured.raw.setdefault(figure, []).append(results)


def scaling(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan, rnd: int) -> None:
    cores_each = meta.scaling["cores_each"]
    for figure, keepalive in (("scaling_keepalive", True), ("scaling_newconn", False)):
        results = _each(
            meta, rnd, figure, rotated(plan.scaling, rnd),
            lambda key: run_scaling(setup, setup.proxies[key], args.duration, args.concurrency, keepalive, cores_each),
            lambda key, res: f"  {figure:17s} {key:22s} {res['rps']:9.1f}/s  quota used "
                             f"{', '.join(fmtn(q, 2) for q in res['quota_used'] or [])}  load-generator CPU "
                             f"{fmtn(res['loadgen_cpu_fraction'], 2)}",
            0.3)
        measured.raw.setdefault(figure, []).append(results)


def transparent(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan, rnd: int) -> None:
    _rates(setup, args, measured, meta, rnd, plan.transparent_keys,
           (("transparent_keepalive", True), ("transparent_newconn", False)), 21)


def bulk(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan, rnd: int) -> None:
    results = {}
    for key in rotated(plan.bulk_keys, rnd):
        res = run_bulk(setup, setup.proxies[key], plan.bulk_bytes)
        results[key.removesuffix("_bulk")] = res
        log(f"  bulk                  {key:22s} {res['mb_per_s']:8.1f} MB/s  RSS "
            f"{res['rss_before_mib']:.0f} → peak {res['rss_peak_mib']:.0f} MiB "
            f"(after {res['rss_after_mib']:.0f})")
        time.sleep(0.5)
    measured.raw.setdefault("bulk", []).append(results)


def idle(setup: Setup, args, meta: RunMeta, measured: Figures, plan: Plan) -> None:
    """RSS with idle tunnels, once per configuration after the rounds (a failure is a warning)."""
    log(f"idle tunnels: {args.idle_tunnels} per configuration")
    for key in plan.idle_configs:
        try:
            res = run_idle(setup, setup.proxies[key], args.idle_tunnels)
        except BenchError as exc:
            meta.warnings.append(f"idle tunnels through {key}: {exc}")
            log(f"  idle {key}: {exc}")
            continue
        measured.idle[key] = res
        if res["failed"]:
            meta.warnings.append(f"idle tunnels through {key}: {res['failed']} of "
                                 f"{args.idle_tunnels} failed: {res['errors']}")
        log(f"  idle {key:22s} {res['tunnels']} open in {res['open_seconds']:.1f}s: RSS "
            f"{res['rss_idle_mib']:.0f} → {res['rss_tunnels_mib']:.0f} MiB "
            f"({fmtn(res['kib_per_tunnel'])} KiB/tunnel, {res['processes']} process(es))")


def check_proxy_logs(setup: Setup, meta: RunMeta) -> None:
    """A proxy that exited, or logged errors, during the run: a warning in the report."""
    for proxy in setup.proxies.values():
        if proxy.service is None:
            continue
        if proxy.service.proc.poll() is not None:
            meta.warnings.append(f"{proxy.key} exited during the run ({proxy.service.proc.returncode})")
        problems = [ln for ln in proxy.service.tail(200).splitlines()
                    if re.search(r"error|exception|traceback", ln, re.I)]
        if problems:
            meta.warnings.append(f"{proxy.key} logged {len(problems)} error lines, e.g. {problems[-1][:200]!r}")
