"""`egress-gateway`: the command line. Subcommands live in `gateway/commands/`, one module each.

The contract other tooling depends on (add flags, never rename):

    egress-gateway run [--policy PATH] [--mode SPEC]... [--confdir DIR]
                       [--audit-log PATH|-] [--metrics HOST:PORT] [--set NAME=VALUE]...
    egress-gateway check FILE...
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from . import __version__, commands


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
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: (m.name != "run", m.name)):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
