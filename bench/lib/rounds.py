"""Interleaved rounds: the order of the configurations rotates and reverses from round to round, and
every proxy gets fresh processes before each round but the first."""

from __future__ import annotations

import time

from lib.load import run_hey
from lib.log import log
from lib.proxies import start_proxy
from lib.results import RunMeta
from lib.session import Setup

# Configurations whose ratio is a target run back to back in every round (their order alternating),
# so that a burst of load from elsewhere on the machine hits both or neither.
ADJACENT = (("mitmdump", "gateway"), ("mitmdump_passthrough", "gateway_passthrough"))


def rotated(items: list, rnd: int) -> list:
    """Round `rnd`'s order: blocks (a pair from ADJACENT, or one configuration) rotate by the round
    number and reverse every other round, so that each takes every position; inside a pair the order
    alternates too."""
    blocks: list[list] = []
    for item in items:
        pair = next((p for p in ADJACENT if item in p), None)
        if pair and all(k in items for k in pair):
            if item == pair[0]:
                blocks.append(list(pair))
        else:
            blocks.append([item])
    if not blocks:
        return []
    shift = rnd % len(blocks)
    blocks = blocks[shift:] + blocks[:shift]
    if rnd % 2 and len(blocks) > 2:  # (two blocks: the rotation alone alternates them)
        blocks.reverse()
    return [k for block in blocks for k in (reversed(block) if rnd % 2 else block)]


def restart_proxies(setup: Setup, tools: dict[str, str], keys: list[str], bulk_keys: list[str], args) -> None:
    """Fresh processes for every round: one process can run a steady 10-20% faster or slower than
    another started the same way (memory layout, hash seeds, where the kernel put it), and with one
    process per configuration for the whole run that bias would be in every round. Restarted, it
    becomes round-to-round noise, which the medians and paired ratios deal with."""
    started = time.monotonic()
    for key in keys:
        proxy = setup.proxies.get(key)
        if proxy is None or proxy.service is None:
            continue
        proxy.service.stop()
        setup.proxies[key] = fresh = start_proxy(setup, key, tools)
        if key not in bulk_keys:  # a short warm-up, not counted (bulk downloads need none)
            run_hey(setup, fresh, args.warmup / 2, args.concurrency, True)
            run_hey(setup, fresh, args.warmup / 2, args.concurrency, False)
    log(f"fresh proxy processes for this round ({time.monotonic() - started:.0f} s)")


def note_failures(meta: RunMeta, rnd: int, figure: str, key: str, res: dict) -> None:
    if res.get("failure_fraction", 0) > 0.001:
        what = (f"{res.get('non_200')} non-200 and {res['missing']} missing of {res['expected']} at the set rate"
                if "missing" in res else f"{res.get('non_200')} non-200 and {res.get('errors')} errors")
        meta.warnings.append(f"round {rnd + 1} {figure} {key}: {what} ({res['failure_fraction']:.2%})")


def warm_up(setup: Setup, args, keys: list[str]) -> None:
    """A keep-alive and a new-connection run through each configuration before the first round, not counted."""
    log("warm-up (not counted)")
    for key in keys:
        run_hey(setup, setup.proxies[key], args.warmup, args.concurrency, True)
        run_hey(setup, setup.proxies[key], args.warmup, args.concurrency, False)
