"""`egress-gateway placeholders --policy F [--sandbox ID]`: env lines a sandbox can hold instead of
the platform's secrets (many SDKs refuse to start without a key).

Each placeholder is an HMAC of (sandbox, secret name) under the key in the gateway's confdir, so
it is stable, different per sandbox, and worthless anywhere but at the gateway, which swaps it for
the real value only on approved requests to a rule bound to that secret.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ..credentials import load_placeholder_key, placeholder
from ..policy import PolicyError, load_default_policy, load_policy
from . import EXIT_INVALID, EXIT_OK


def register(sub) -> None:
    parser = sub.add_parser(
        "placeholders",
        help="print placeholder env lines for a sandbox",
        description=__doc__.split("\n\n")[0].removeprefix("`egress-gateway placeholders --policy F [--sandbox ID]`: "),
    )
    parser.add_argument("--policy", metavar="PATH", help="policy file (default: the embedded default policy)")
    parser.add_argument("--sandbox", metavar="ID", default=None,
                        help="the sandbox id the placeholders are for (default: clients outside any sandbox)")
    parser.add_argument("--confdir", metavar="DIR", default="~/.mitmproxy",
                        help="the gateway's confdir, which holds the placeholder key (created if missing)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy) if args.policy else load_default_policy()
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    if args.sandbox is not None:
        if policy.sandboxes is None:
            print(f"egress-gateway: {policy.source} has no sandboxes section: omit --sandbox", file=sys.stderr)
            return EXIT_INVALID
        if args.sandbox not in {s.id for s in policy.sandboxes}:
            print(f"egress-gateway: no sandbox {args.sandbox!r} in {policy.source}", file=sys.stderr)
            return EXIT_INVALID
    key = load_placeholder_key(args.confdir)
    for name, source in sorted(policy.secrets.items()):
        print(f"{source.env_name}={shlex.quote(placeholder(key, name, args.sandbox))}")
    return EXIT_OK
