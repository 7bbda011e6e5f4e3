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
    run.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    run.set_defaults(func=main)


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
