"""`egress-gateway`: the command line. Subcommands live in `gateway/commands/`, one module each,
and in the modules the `egress_gateway.commands` entry point names: `run`, which starts mitmproxy
with the addons, is addons/run_command.py, so that the core imports no proxy code.

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
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from . import __version__, commands

COMMANDS_GROUP = "egress_gateway.commands"


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
    for _, register in sorted(_registrars().items(), key=lambda item: (item[0] != "run", item[0])):
        register(sub)
    return parser


def _registrars() -> dict[str, Callable]:
    """Each subcommand's `register`: the core's own, then those other packages declare (which
    cannot replace one of the core's)."""
    found = {}
    for info in pkgutil.iter_modules(commands.__path__):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(module, "register"):
            found[info.name] = module.register
    for entry in entry_points(group=COMMANDS_GROUP):
        if entry.name not in found:
            found[entry.name] = entry.load()
    found.setdefault("run", _run_not_installed)
    return found


def _run_not_installed(sub) -> None:
    """Run from a checkout that was never installed: say how to get `run` instead of "invalid choice"."""
    def refuse(args) -> int:
        print("egress-gateway: the run command comes with the addons package; install the project "
              "(pip install -e .) so that it is registered", file=sys.stderr)
        return commands.EXIT_FAILED
    sub.add_parser("run", help="run the gateway (not installed)").set_defaults(func=refuse)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
