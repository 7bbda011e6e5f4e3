"""The command line of bench/run.py: options, their quick and full defaults, and the checks on them."""

from __future__ import annotations

import argparse
from pathlib import Path

import streaming  # bench/streaming.py: the streaming group's options
from lib.configurations import CONFIGS, GROUP_ALIASES, GROUPS
from lib.names import RESULTS_DIR


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short run: 2 rounds of 2 s, 20,000-rule policy instead of 100,000 (~6 min)")
    p.add_argument("--only", action="append", metavar="GROUP[,GROUP]",
                   help=f"run only these figure groups, of {', '.join(GROUPS)} (repeatable or comma-separated; "
                        "default: all; transparent is skipped with a warning when namespaces are unavailable)")
    p.add_argument("--configs", metavar="KEY[,KEY]",
                   help=f"configurations for the configs and idle groups, of {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--duration", type=float, help="seconds per throughput run of hey (default 4, quick 2)")
    p.add_argument("--concurrency", type=int, default=32, help="hey -c for the throughput runs")
    p.add_argument("--latency-duration", type=float, help="seconds per latency run (default 3, quick 2)")
    p.add_argument("--latency-rate", type=float, default=50.0,
                   help="keep-alive requests/s in the latency runs (hey -c 1 -q RATE): well below saturation")
    p.add_argument("--latency-conn-rate", type=float, default=10.0,
                   help="new connections/s in the latency runs (hey -c 1 -q RATE -disable-keepalive)")
    p.add_argument("--idle-tunnels", type=int, help="idle tunnels opened for the RSS figure (default 1000, quick 500)")
    p.add_argument("--scaling-quota", type=float,
                   help="CPU quota per gateway worker in the scaling figure, in cores (default 0.9·(CPUs−1)/N: N "
                        "workers together get 90%% of all CPUs but one, which is left to hey and nginx; with "
                        "--scaling-pin 0.9/N)")
    p.add_argument("--scaling-pin", action="store_true",
                   help="scaling figure: pin every gateway process to CPU 0 (hey and nginx keep CPU 1) instead of "
                        "letting the throttled workers run on every CPU")
    p.add_argument("--bulk-mb", type=int, default=200, help="size of the bulk body, MB (10^6 bytes)")
    p.add_argument("--rules", type=int, help="size of the large policy (default 100000, quick 20000)")
    p.add_argument("--policy-number", type=int, help="check_request calls per timeit repeat (default 20000)")
    p.add_argument("--policy-repeats", type=int, help="timeit repeats per case (default 9, quick 5)")
    p.add_argument("--origin-ip", default="127.0.0.50", help="loopback address for the nginx origin (port 443)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs with taskset")
    p.add_argument("--nice", type=int, default=0,
                   help="run the benchmark's processes at this nice value (e.g. -10, as root) so that other "
                        "work on a shared machine disturbs them less")
    p.add_argument("--no-stream-baseline", action="store_true",
                   help="skip (a'), mitmdump with stream_large_bodies=1m, in the bulk figure")
    p.add_argument("--gateway-audit-log", action="store_true", help="run the gateway with --audit-log to a file")
    p.add_argument("--skip-proxy", action="store_true", help="only the policy decision figure (4): --only decision")
    p.add_argument("--skip-policy", action="store_true", help="skip the policy decision figure (4)")
    p.add_argument("--max-minutes", type=float,
                   help="stop starting new rounds after this many minutes (default 14, quick 3)")
    p.add_argument("--profile", action="store_true",
                   help="instead of the rounds: profile the gateway (1 worker) and bare mitmdump under keep-alive "
                        "and new-connection load, and group the samples (results/profile-*)")
    p.add_argument("--profile-tool", choices=("py-spy", "cprofile"), default="py-spy",
                   help="py-spy (attaches to the running proxy) or cProfile (runs the gateway under it)")
    p.add_argument("--profile-seconds", type=float, default=15.0, help="seconds recorded per profile")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames: OpenSSL, ...)")
    p.add_argument("--same-processes", action="store_true",
                   help="keep each proxy's process for the whole run instead of starting fresh ones every round")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temporary directory (logs, configs)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="where to write latest.md / latest.json")
    streaming.add_arguments(p)
    args = p.parse_args(argv)
    args.warmup = None
    q = args.quick
    defaults = {"rounds": (2, 5), "duration": (2.0, 4.0), "latency_duration": (2.0, 3.0),
                "rules": (20000, 100000), "policy_number": (20000, 20000),
                "policy_repeats": (5, 9), "max_minutes": (3.0, 14.0), "idle_tunnels": (500, 1000),
                "warmup": (0.5, 1.0)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.rounds < 1 or args.duration <= 0 or args.rules < 11 or args.policy_repeats < 1:
        p.error("--rounds, --duration and --policy-repeats must be positive and --rules above 10")
    if not args.origin_ip.startswith("127."):
        p.error("--origin-ip must be in 127.0.0.0/8: this benchmark sends traffic to loopback only")
    if args.latency_rate <= 0 or args.latency_conn_rate <= 0 or args.idle_tunnels < 1:
        p.error("--latency-rate, --latency-conn-rate and --idle-tunnels must be positive")
    args.only_given = bool(args.only)
    groups = [GROUP_ALIASES.get(g.strip(), g.strip()) for item in (args.only or [",".join(GROUPS)])
              for g in item.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"--only: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if args.skip_proxy:
        groups = [g for g in groups if g == "decision"]
    if args.skip_policy:
        groups = [g for g in groups if g != "decision"]
    if not groups and not args.profile:
        p.error("nothing to run (check --only, --skip-proxy and --skip-policy)")
    args.groups = [g for g in GROUPS if g in groups]
    configs = [c.strip() for c in (args.configs or ",".join(CONFIGS)).split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    args.configs = [c for c in CONFIGS if c in configs]
    args.profile_configs = ["gateway", "mitmdump"]
    return args
