"""`egress-gateway check FILE...`: validate policy files without running anything."""

from __future__ import annotations

import argparse
import sys

from ..policy import PolicyError, load_policy
from . import EXIT_INVALID, EXIT_OK


def register(sub) -> None:
    check = sub.add_parser(
        "check",
        help="validate policy files",
        description="Validate policy files; print every problem as FILE:LINE:COLUMN: KEY: MESSAGE.",
    )
    check.add_argument("files", metavar="FILE", nargs="+", help="policy files to check")
    check.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            print(exc, file=sys.stderr)
            status = EXIT_INVALID
        else:
            print(f"{path}: ok ({len(policy.rules)} rules, sha256 {policy.sha256})")
    return status
