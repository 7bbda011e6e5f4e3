"""`egress-gateway run`: the gateway itself (mitmproxy embedded with the egress addons)."""

from __future__ import annotations

import argparse
import sys

from ..policy import PolicyError, load_default_policy, load_policy
from . import EXIT_INVALID

DEFAULT_MODE = "regular@127.0.0.1:8080"
DEFAULT_CONFDIR = "~/.mitmproxy"


def register(sub) -> None:
    run = sub.add_parser(
        "run",
        help="run the gateway",
        description="Run the gateway (mitmproxy embedded, with the egress addons) until SIGINT/SIGTERM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument(
        "--policy", metavar="PATH", default=None,
        help="policy YAML file; without it the embedded default policy (policies/default.yaml) is used",
    )
    run.add_argument(
        "--mode", metavar="SPEC", action="append", default=None,
        help=f"mitmproxy mode spec, repeatable (default: {DEFAULT_MODE}); supported: regular@HOST:PORT "
        "(explicit proxy), transparent@HOST:PORT (redirected traffic), dns@HOST:PORT (the sandbox's resolver)",
    )
    run.add_argument(
        "--confdir", metavar="DIR", default=DEFAULT_CONFDIR,
        help="where the gateway's CA lives (created on first start): DIR/mitmproxy-ca-cert.pem is the "
        "certificate sandboxes must trust",
    )
    run.add_argument(
        "--audit-log", metavar="PATH|-", default=None,
        help="append one JSON line per decision to PATH ('-' for stdout)",
    )
    run.add_argument(
        "--set", metavar="NAME=VALUE", action="append", default=[], dest="setoptions",
        help="set any mitmproxy option, e.g. ssl_verify_upstream_trusted_ca=PATH (repeatable); options "
        "that would weaken the gateway (connection_strategy, rawtcp, ssl_insecure, ignore_hosts, ...) are "
        "forced back to safe values",
    )
    run.add_argument(
        "--metrics", metavar="HOST:PORT", default=None,
        help="serve /metrics (Prometheus), /healthz and /readyz on HOST:PORT (an IP address, [::1]:PORT for "
        "IPv6); the address is never reachable through the proxy (docs/metrics.md)",
    )
    run.add_argument(
        "--audit-chain", action="store_true",
        help="hash-chain the audit log: each line carries 'prev', the SHA-256 of the previous line "
        "(check with `egress-gateway audit verify`)",
    )
    run.add_argument(
        "--audit-max-bytes", metavar="N", type=_non_negative_int, default=0,
        help="rotate the audit log file before it would exceed N bytes (PATH -> PATH.1 -> ...); 0: never",
    )
    run.add_argument(
        "--audit-backups", metavar="K", type=_positive_int, default=5,
        help="rotated audit log files to keep with --audit-max-bytes",
    )
    run.add_argument(
        "--drain-timeout", metavar="SECONDS", type=_non_negative_float, default=10.0,
        help="on SIGTERM/SIGINT, stop accepting and wait up to SECONDS for in-flight requests, then exit 0",
    )
    run.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    run.set_defaults(func=main)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return value


def main(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy) if args.policy else load_default_policy()
    except PolicyError as exc:
        print(f"egress-gateway: invalid policy:\n{exc}", file=sys.stderr)
        return EXIT_INVALID
    from addons.runner import run_gateway  # mitmproxy is imported only when running

    return run_gateway(
        policy_path=args.policy or "",
        modes=args.mode or [DEFAULT_MODE],
        confdir=args.confdir,
        audit_log=args.audit_log,
        set_options=args.setoptions,
        quiet=args.quiet,
        policy_sha256=policy.sha256,
        extra=args,
    )
