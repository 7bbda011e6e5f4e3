"""`egress-gateway`: run the gateway, or check a policy file.

The command-line contract (other tooling depends on it; add flags, never rename):

    egress-gateway run [--policy PATH] [--mode SPEC]... [--confdir DIR]
                       [--audit-log PATH|-] [--set NAME=VALUE]...
    egress-gateway check FILE...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .policy import PolicyError, load_default_policy, load_policy

DEFAULT_MODE = "regular@127.0.0.1:8080"
DEFAULT_CONFDIR = "~/.mitmproxy"

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_POLICY = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egress-gateway",
        description=(
            "Egress gateway for untrusted code: a forward proxy that pins each connection's "
            "destination, checks it against a YAML allowlist, resolves and connects upstream "
            "itself, and refuses any later attempt to restate the destination."
        ),
    )
    parser.add_argument("--version", action="version", version=f"egress-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
        help=f"mitmproxy mode spec, repeatable (default: {DEFAULT_MODE}); supported: regular@HOST:PORT",
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
    run.set_defaults(func=_run)

    check = sub.add_parser(
        "check",
        help="validate policy files",
        description="Validate policy files; print every problem as FILE:LINE:COLUMN: KEY: MESSAGE.",
    )
    check.add_argument("files", metavar="FILE", nargs="+", help="policy files to check")
    check.set_defaults(func=_check)
    return parser


def _check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            print(exc, file=sys.stderr)
            status = EXIT_POLICY
        else:
            print(f"{path}: ok ({len(policy.rules)} rules, sha256 {policy.sha256})")
    return status


def _run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy) if args.policy else load_default_policy()
    except PolicyError as exc:
        print(f"egress-gateway: invalid policy:\n{exc}", file=sys.stderr)
        return EXIT_POLICY
    from addons.runner import run_gateway  # mitmproxy is imported only when running

    return run_gateway(
        policy_path=args.policy or "",
        modes=args.mode or [DEFAULT_MODE],
        confdir=args.confdir,
        audit_log=args.audit_log,
        set_options=args.setoptions,
        quiet=args.quiet,
        policy_sha256=policy.sha256,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
