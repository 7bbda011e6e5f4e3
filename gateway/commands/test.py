"""`egress-gateway test FILE...`: run policy test files (requests and the decision each must get)."""

from __future__ import annotations

import argparse
import json
import sys

from ..policytest import as_dict, exit_status, render_text, run_file


def register(sub) -> None:
    parser = sub.add_parser(
        "test",
        help="run policy test files",
        description=(
            "Run policy test files: YAML with `policy: FILE` (relative to the test file) and `cases:`, each a "
            "url, method (default GET), sandbox or source_ip, expect (allow|deny|would_deny) and optionally reason, rule, "
            "inject (secret names) and addresses. Names resolve only through static_hosts or a case's "
            "addresses, never DNS. Exit status: 0 all passed, 1 some failed, 2 a test file (or its policy) is "
            "invalid."
        ),
    )
    parser.add_argument("files", metavar="FILE", nargs="+", help="test files (*.test.yaml)")
    parser.add_argument("--policy", metavar="PATH", default=None,
                        help="run every file against this policy instead of the one it names")
    parser.add_argument("-v", "--verbose", action="store_true", help="list passing cases too")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    files = [run_file(path, args.policy) for path in args.files]
    if args.format == "json":
        print(json.dumps(as_dict(files), indent=2))
    else:
        sys.stdout.write(render_text(files, args.verbose))
    return exit_status(files)
