"""`egress-gateway audit verify FILE...`: check a hash-chained audit log (written with --audit-chain)."""

from __future__ import annotations

import argparse
import re
import sys

from ..audit import verify_chain
from . import EXIT_FAILED, EXIT_INVALID, EXIT_OK


def _hex64(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected 64 hex digits")
    return text.lower()


def register(sub) -> None:
    audit = sub.add_parser(
        "audit",
        help="audit log tools",
        description="Tools for the audit log (see docs/audit-log.md).",
    )
    actions = audit.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = actions.add_parser(
        "verify",
        help="check a hash-chained audit log",
        description=(
            "Check audit files written with --audit-chain, as one chain: each line's 'prev' must be the "
            "SHA-256 of the line before it, and the first line's 64 zeros. Give rotated files oldest first "
            "(audit.jsonl.2 audit.jsonl.1 audit.jsonl). Prints the first bad line as FILE:LINE: PROBLEM and "
            "exits 1; prints the line count and the chain head (the last line's hash) and exits 0 when intact. "
            "Lines removed from the end are only detectable against a head recorded earlier (--expect-head)."
        ),
    )
    verify.add_argument("files", metavar="FILE", nargs="+", help="audit files, oldest first")
    verify.add_argument(
        "--partial", action="store_true",
        help="the first line may continue a chain (a rotated file whose predecessors are gone)",
    )
    verify.add_argument(
        "--expect-head", metavar="HASH", type=_hex64, default=None,
        help="the last line must hash to HASH (a head recorded elsewhere, e.g. from the gateway's shutdown log)",
    )
    verify.set_defaults(func=main_verify)


def main_verify(args: argparse.Namespace) -> int:
    try:
        report = verify_chain(args.files, partial=args.partial, expect_head=args.expect_head)
    except OSError as exc:
        print(f"egress-gateway: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_INVALID
    if report.ok:
        print(f"{' '.join(args.files)}: {report.describe()}")
        return EXIT_OK
    print(report.describe())
    return EXIT_FAILED
