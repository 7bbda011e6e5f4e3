"""`egress-gateway replay --policy NEW AUDIT...`: what would change if NEW had decided the recorded traffic."""

from __future__ import annotations

import argparse
import json
import sys

from ..policy import PolicyError, load_policy
from ..replay import ReplayResult, parse_audit, render_text, replay
from . import EXIT_FAILED, EXIT_INVALID, EXIT_OK


def register(sub) -> None:
    parser = sub.add_parser(
        "replay",
        help="re-decide an audit log under another policy",
        description=(
            "Re-decide the request, connect, tls and dns decisions recorded in audit logs (JSON lines) under "
            "the policy NEW and print what would change: newly denied, newly allowed, another reason or rule, "
            "other credentials injected. Exit status: 0 nothing changes, 1 something does, 2 bad input."
        ),
    )
    parser.add_argument("--policy", metavar="NEW", required=True, help="the policy to replay under")
    parser.add_argument("audit", metavar="AUDIT", nargs="+", help="audit log files ('-' for standard input)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    result = ReplayResult()
    records = []
    for path in args.audit:
        try:
            if path == "-":
                found, _ = parse_audit(sys.stdin, result, "-")
            else:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    found, _ = parse_audit(handle, result, path)
        except OSError as exc:
            print(f"egress-gateway replay: cannot read {path}: {exc.strerror}", file=sys.stderr)
            return EXIT_INVALID
        records.extend(found)
    replay(policy, records, result)
    if args.format == "json":
        print(json.dumps({"policy": args.policy} | result.as_dict(), indent=2))
    else:
        sys.stdout.write(render_text(result, args.policy))
    return EXIT_FAILED if result.changes else EXIT_OK
