"""`egress-gateway explain [--policy F] [--sandbox ID | --source-ip IP] [-X METHOD] URL`: one decision, every step shown."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys

from ..explain import ExplainError, explain, render_text
from ..hostnames import Host
from ..policy import PolicyError, load_default_policy, load_policy
from ..resolver import Resolver
from . import EXIT_INVALID


def register(sub) -> None:
    parser = sub.add_parser(
        "explain",
        help="explain how the policy decides one request",
        description=(
            "Show the decision for one request (https://host[:port]/path, http://..., or tcp://IP:PORT for raw "
            "TCP rules): the deciding rule, why every other candidate rule did not match, the addresses the "
            "name resolves to and the deny list's verdict on each, and the names of the secrets that would be "
            "injected (never their values). Exit status: 0 allow, 1 deny, 2 bad input."
        ),
    )
    parser.add_argument("--policy", metavar="PATH", default=None,
                        help="policy file (default: the embedded default policy)")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--sandbox", metavar="ID", help="decide for this sandbox id")
    who.add_argument("--source-ip", metavar="IP", help="decide for a client with this source address")
    parser.add_argument("-X", "--method", metavar="METHOD", default="GET", help="request method (default GET)")
    parser.add_argument("--resolve", action="store_true",
                        help="look names up in DNS when static_hosts does not have them (default: do not)")
    parser.add_argument("--address", metavar="IP", action="append", default=None,
                        help="treat the host as resolving to IP (repeatable; overrides static_hosts and DNS)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.add_argument("url", metavar="URL")
    parser.set_defaults(func=main)


def _dns(host: Host):
    return asyncio.run(Resolver().resolve(host))


def main(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy) if args.policy else load_default_policy()
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    try:
        given = None
        if args.address:
            try:
                given = [ipaddress.ip_address(a.strip("[]")) for a in args.address]
            except ValueError as exc:
                raise ExplainError(f"--address: {exc}") from None
        result = explain(policy, args.url, args.method, sandbox=args.sandbox, source_ip=args.source_ip,
                         addresses=given, resolve=_dns if args.resolve else None)
    except ExplainError as exc:
        print(f"egress-gateway explain: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.format == "json":
        print(json.dumps(result.as_dict(), indent=2))
    else:
        sys.stdout.write(render_text(result))
    return result.exit_status
