"""`egress-gateway explain [--policy F] [--sandbox ID | --source-ip IP] [-X METHOD] [-H 'NAME: VALUE']... URL`: one decision, every step shown.

`egress-gateway explain --secrets [--policy F] [--sandbox ID] [--format json]`: where every secret
can go instead (gateway/secretmap.py): which rules carry it, to which hosts, ports and schemes,
written where, granted to whom, and the proof that it goes nowhere else. Exit status 0 when every
property holds, 1 when there are findings, 2 for bad input."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
from pathlib import Path

from .. import secretmap
from ..explain import ExplainError, explain, parse_header, render_text, scope_for
from ..hostnames import Host
from ..policy import PolicyError, default_policy_text, load_default_policy, load_policy
from ..resolver import Resolver
from . import EXIT_FAILED, EXIT_INVALID, EXIT_OK


def register(sub) -> None:
    parser = sub.add_parser(
        "explain",
        help="explain how the policy decides one request",
        description=(
            "Show the decision for one request (https://host[:port]/path, http://..., or tcp://IP:PORT for raw "
            "TCP rules): the deciding rule, why every other candidate rule did not match, the addresses the "
            "name resolves to and the deny list's verdict on each, and the names of the secrets that would be "
            "injected (never their values). Exit status: 0 allow, 1 deny, 2 bad input. With --secrets and no "
            "URL: every secret, the rules that can carry it and exactly where to, and the proof that it can reach "
            "nothing else (exit status 0 when every property holds, 1 with findings)."
        ),
    )
    parser.add_argument("--policy", metavar="PATH", default=None,
                        help="policy file (default: the embedded default policy)")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--sandbox", metavar="ID", help="decide for this sandbox id")
    who.add_argument("--source-ip", metavar="IP", help="decide for a client with this source address")
    parser.add_argument("-X", "--method", metavar="METHOD", default="GET", help="request method (default GET)")
    parser.add_argument("-H", "--header", metavar="'NAME: VALUE'", action="append", default=None,
                        help="a request header field (repeatable), e.g. -H 'X-HTTP-Method-Override: DELETE': "
                             "method overrides in headers are judged like the URL's")
    parser.add_argument("--resolve", action="store_true",
                        help="look names up in DNS when static_hosts does not have them (default: do not)")
    parser.add_argument("--address", metavar="IP", action="append", default=None,
                        help="treat the host as resolving to IP (repeatable; overrides static_hosts and DNS)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.add_argument("--secrets", action="store_true",
                        help="instead of a URL: where every secret can go (rules, hosts, ports, schemes, methods, "
                             "paths, sandboxes, where it is written) and the proof that it goes nowhere else")
    parser.add_argument("url", metavar="URL", nargs="?")
    parser.set_defaults(func=main)


def _dns(host: Host):
    return asyncio.run(Resolver().resolve(host))


def main(args: argparse.Namespace) -> int:
    if args.secrets == (args.url is not None):
        print("egress-gateway explain: give a URL, or --secrets (not both)", file=sys.stderr)
        return EXIT_INVALID
    try:
        policy = load_policy(args.policy) if args.policy else load_default_policy()
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    if args.secrets:
        return _secrets(args, policy)
    try:
        given = None
        if args.address:
            try:
                given = [ipaddress.ip_address(a.strip("[]")) for a in args.address]
            except ValueError as exc:
                raise ExplainError(f"--address: {exc}") from None
        headers = [parse_header(h) for h in args.header or ()]
        result = explain(policy, args.url, args.method, sandbox=args.sandbox, source_ip=args.source_ip,
                         addresses=given, resolve=_dns if args.resolve else None, headers=headers)
    except ExplainError as exc:
        print(f"egress-gateway explain: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.format == "json":
        print(json.dumps(result.as_dict(), indent=2))
    else:
        sys.stdout.write(render_text(result))
    return result.exit_status


def _secrets(args: argparse.Namespace, policy) -> int:
    unused = [flag for flag, value in (("--source-ip", args.source_ip), ("--resolve", args.resolve),
                                       ("--address", args.address), ("-X", args.method != "GET"),
                                       ("-H", args.header)) if value]
    if unused:
        print(f"egress-gateway explain: --secrets does not take {', '.join(unused)}", file=sys.stderr)
        return EXIT_INVALID
    try:
        scope, _ = scope_for(policy, args.sandbox)
    except ExplainError as exc:
        print(f"egress-gateway explain: {exc}", file=sys.stderr)
        return EXIT_INVALID
    text = Path(args.policy).read_text(encoding="utf-8") if args.policy else default_policy_text()
    result = secretmap.secret_map(policy, text, scope if args.sandbox else None)
    if args.format == "json":
        print(json.dumps({"file": policy.source, "sha256": policy.sha256, "secrets": result.as_dict()}, indent=2))
    else:
        sys.stdout.write(secretmap.render_text(result))
    return EXIT_OK if result.holds else EXIT_FAILED
