"""Run mitmproxy embedded with the gateway's addons (what `egress-gateway run` does)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from mitmproxy import exceptions, options
from mitmproxy.tools.dump import DumpMaster

from .egress import make_addons

logger = logging.getLogger("egress")


async def _serve(policy_path: str, modes: list[str], confdir: str, audit_log: str | None,
                 set_options: list[str], quiet: bool) -> int:
    opts = options.Options()
    master = DumpMaster(opts, with_termlog=True, with_dumper=False)
    ours = make_addons()
    master.addons.add(*ours)
    # Run the gateway's hooks before mitmproxy's built-in addons, exactly as `mitmdump -s` does:
    # the guards then decide first (next layer, DNS answers) and never race a built-in default.
    chain = master.addons.chain
    chain[:] = [a for a in chain if a in ours] + [a for a in chain if a not in ours]
    try:
        opts.update(
            mode=modes,
            confdir=confdir,
            egress_policy=policy_path,
            egress_audit_log=audit_log or "",
            termlog_verbosity="warn" if quiet else "info",
        )
        if set_options:
            opts.set(*set_options)
    except exceptions.OptionsError as exc:
        print(f"egress-gateway: {exc}", file=sys.stderr)
        return 2

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    await master.run()
    errorcheck = master.addons.get("errorcheck")
    return 1 if errorcheck is not None and getattr(errorcheck, "has_errored", False) else 0


def run_gateway(*, policy_path: str, modes: list[str], confdir: str, audit_log: str | None,
                set_options: list[str], quiet: bool, policy_sha256: str, extra=None) -> int:
    """`extra` is the parsed command line, for options that later subcommand flags add."""
    logging.getLogger().setLevel(logging.INFO)
    for noisy in ("tornado", "asyncio", "hpack", "quic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return asyncio.run(_serve(policy_path, modes, confdir, audit_log, set_options, quiet))
