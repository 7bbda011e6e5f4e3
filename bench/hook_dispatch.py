#!/usr/bin/env python3
"""What dispatching one event costs with the gateway's addon chain, apart from the hooks themselves:
mitmproxy's walk of every addon against addons/hook_dispatch.py's plan, in one process.

    python bench/hook_dispatch.py [--number 20000] [--repeat 7]

The chain is the runner's (addons/runner.py: mitmproxy's six built-in addons after the gateway's
addons, 37 in all). Events that no addon of that chain handles (`update`, which mitmproxy fires after
every flow event, and `server_connected`) are dispatched with mitmproxy's own trigger_event and with
the plan; µs per event, best of --repeat. No proxy, no sockets. Not a test (bench/ is not collected).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def measure(number: int, repeat: int) -> dict[str, dict[str, float]]:
    from mitmproxy import addonmanager, hooks, master, options
    from mitmproxy.proxy import server_hooks
    from mitmproxy.test import tflow

    from addons.egress import make_addons
    from addons.runner import builtin_addons

    planned = addonmanager.AddonManager.trigger_event
    walked = planned.__wrapped__
    m = master.Master(options.Options())
    ours = make_addons()
    m.addons.add(*builtin_addons(), *ours)
    flow = tflow.tflow()
    events = {"update": hooks.UpdateHook([flow]),
              "server_connected": server_hooks.ServerConnectedHook(server_hooks.ServerConnectionHookData(
                  flow.server_conn, flow.client_conn))}
    out: dict[str, dict[str, float]] = {}
    for name, event in events.items():
        out[name] = {}
        for label, trigger in (("mitmproxy", walked), ("plan", planned)):
            best = float("inf")
            for _ in range(repeat):
                started = time.perf_counter()
                for _ in range(number):
                    await trigger(m.addons, event)
                best = min(best, time.perf_counter() - started)
            out[name][label] = 1e6 * best / number
    out["chain"] = {"addons": float(len(m.addons.chain))}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    out = asyncio.run(measure(args.number, args.repeat))
    print(f"{int(out.pop('chain')['addons'])} addons in the chain; µs per event dispatched (best of {args.repeat}):")
    for name, figures in out.items():
        print(f"- {name}: mitmproxy's walk {figures['mitmproxy']:.2f}, plan {figures['plan']:.2f} "
              f"({figures['plan'] / figures['mitmproxy']:.2f}×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
