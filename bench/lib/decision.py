"""The policy decision figure: check_request against a small and a large policy, timed in process."""

from __future__ import annotations

import os
import statistics
import time
import timeit

from lib.log import BenchError, log
from lib.names import ORIGIN_NAME, SMALL_PATH
from lib.results import Figures, RunMeta


def policy_yaml(rule_count: int, origin_ip: str) -> str:
    """A policy with `rule_count` rules, one host each; the bench origin's rule comes last."""
    lines = [
        "version: 1",
        "network:",
        "  deny_ip_ranges: default",
        "  allow_ip_ranges: [127.0.0.0/8]",
        "resolver:",
        "  static_hosts:",
        f"    {ORIGIN_NAME}: [{origin_ip}]",
        "rules:",
    ]
    for i in range(rule_count - 1):
        # nine exact names for one wildcard; the wildcards share suffixes with nothing we look up
        host = f'"*.svc{i}.example.net"' if i % 10 == 0 else f"host{i}.zone{i % 97}.example.com"
        lines.append(f"  - id: r{i}\n    hosts:\n      - {host}")
    lines.append(f"  - id: bench-origin\n    hosts: [{ORIGIN_NAME}]\n    methods: [GET, HEAD]")
    return "\n".join(lines) + "\n"


def bench_policy(rule_counts: list[int], number: int, repeats: int, origin_ip: str, deadline: float) -> dict:
    from gateway.engine import Engine, RequestFacts
    from gateway.hostnames import canonical_host
    from gateway.policy import compile_policy

    engines = {}
    compile_s = {}
    for n in rule_counts:
        text = policy_yaml(n, origin_ip)
        t0 = time.perf_counter()
        policy = compile_policy(text, f"<bench {n} rules>")
        compile_s[n] = time.perf_counter() - t0
        if len(policy.rules) != n:
            raise BenchError(f"policy with {n} rules compiled to {len(policy.rules)}")
        engines[n] = Engine.build(policy)
        log(f"policy with {n} rules: compiled in {compile_s[n]:.2f}s")

    cases = {
        "match": RequestFacts(host=canonical_host(ORIGIN_NAME), port=443, scheme="https", method="GET",
                              target=SMALL_PATH),
        "no_match": RequestFacts(host=canonical_host("nomatch.example.org"), port=443, scheme="https", method="GET",
                                 target=SMALL_PATH),
    }
    for n, engine in engines.items():
        if not engine.check_request(cases["match"]).allowed or engine.check_request(cases["no_match"]).allowed:
            raise BenchError(f"policy with {n} rules decided wrongly")

    samples: dict[str, dict[int, list[float]]] = {c: {n: [] for n in rule_counts} for c in cases}
    for r in range(repeats):
        if time.monotonic() > deadline and r >= 1:
            log("time limit reached: fewer policy repeats")
            break
        order = rule_counts if r % 2 == 0 else list(reversed(rule_counts))
        for case, facts in cases.items():
            for n in order:
                timer = timeit.Timer(lambda e=engines[n], f=facts: e.check_request(f))
                samples[case][n].append(timer.timeit(number) / number * 1e9)
    small, large = min(rule_counts), max(rule_counts)
    result: dict = {"rule_counts": rule_counts, "number": number, "compile_s": compile_s, "cases": {}}
    for case in cases:
        med = {n: statistics.median(samples[case][n]) for n in rule_counts}
        result["cases"][case] = {
            "ns_median": med,
            "ns_min": {n: min(samples[case][n]) for n in rule_counts},
            "ns_samples": samples[case],
            "ratio_large_small": med[large] / med[small],
        }
    return result


def run_figure(args, meta: RunMeta, measured: Figures, deadline: float) -> bool:
    """The decision group, after the proxies are stopped (the timing has the machine to itself); True if
    it was interrupted."""
    try:
        if args.nice:
            os.nice(args.nice)
        log(f"policy decision cost: 10 and {args.rules:,} rules")
        measured.policy = bench_policy([10, args.rules], args.policy_number, args.policy_repeats, args.origin_ip,
                                       deadline + 6 * 60)
    except KeyboardInterrupt:
        meta.warnings.append("interrupted during the policy figure")
        return True
    return False
