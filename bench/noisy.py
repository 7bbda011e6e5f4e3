"""The noisy-neighbour benchmark (issue 15; not a test, see bench/README.md): what one hostile
sandbox costs another sandbox on the same gateway worker.

    .venv/bin/python bench/noisy.py                          # every attack, about 3 minutes
    .venv/bin/python bench/noisy.py --only h2_rapid_reset --samples 100
    .venv/bin/python bench/noisy.py --set egress_h2_max_concurrent_streams=1000   # a looser budget

For each attack a fresh gateway (one worker, this checkout, its default budgets unless `--set`
says otherwise) is started in front of a loopback TLS origin (bench/lib/noisy.py). Sandbox B
(its own source address, `sandboxes` entry and process) times its simple request: a fresh CONNECT tunnel,
TLS, `GET /ok`, close. First `--samples` of them alone (B's baseline, measured in the same run
against the same process), then as many while sandbox A runs the attack, repeated until B has
`--samples` samples during it. The gateway's RSS is sampled every 10 ms from idle to the attack's
end. Figures: B's p50 and p99 during the attack against its baseline (target: p99 ≤ 2x), the
gateway's peak RSS against its idle RSS (target: under 1.5x idle + the budgets), what A saw, and
how many audit lines A made. Traffic stays on 127.0.0.0/8.

Attacks (sandbox A): HTTP/2 streams that buffer and never end (100 x 900 KB), a decompression bomb
on a credential-bound rule (300 MB of brotli zeros), a never-finished 8 MiB TLS ClientHello,
HTTP/2 rapid reset (6,000 HEADERS + RST_STREAM), a flood of kept-alive requests, a flood of new
connections, an 8 MiB HTTP/2 header block in CONTINUATION frames, heads of 12,000 tiny fields,
9,000 one-byte HTTP/2 DATA frames rotating over 100 streams, 1,200 HTTP/2 heads of 55 KB whose body
never comes, an upstream the sandbox picks answering in 2,000,000 one-byte chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.processes import set_affinity  # noqa: E402  (bench/lib)
from lib.procfs import process_tree  # noqa: E402
from lib import noisy  # noqa: E402

BLOCK = "127.250.0"  # outside the blocks test sessions take (127.20-219.0.0/24)
os.environ["EGRESS_WORKERS"] = "1"  # one worker: A and B share its event loop, and its RSS is the process's


def _under_attack(world, name: str, attack, samples: int, args, outcomes: list) -> noisy.Victim:
    """B timing its requests while A repeats the attack, until B has `samples` of them."""
    victim = noisy.Victim(world, args.pace, keepalive=args.victim == "keepalive")
    started = time.monotonic()
    victim.start()
    victim.first.wait(noisy.TIMEOUT)
    if name == "h2_held_streams":  # one connection held open while B measures
        hold = threading.Event()
        holder = threading.Thread(target=lambda: outcomes.append(attack(world, hold=hold)), daemon=True)
        holder.start()
        while len(victim.samples) < samples and time.monotonic() - started < args.max_seconds:
            time.sleep(0.05)  # the benchmark's own pacing, not a synchronisation
        hold.set()
        holder.join(noisy.TIMEOUT)
    else:
        while len(victim.samples) < samples and time.monotonic() - started < args.max_seconds:
            outcomes.append(attack(world))
    return victim.stop()


def run_attack(name: str, args) -> dict:
    attack = noisy.ATTACKS[name]
    extra = [x for item in args.set for x in ("--set", item)]
    with tempfile.TemporaryDirectory() as tmp:
        world = noisy.make_world(Path(tmp), BLOCK, extra, bomb_size=args.bomb_mb << 20)
        try:
            if args.pin:
                set_affinity(process_tree(world.gateway.process.pid), {0})
            for _ in range(5):  # warm: certificates minted, code paths hot
                noisy.victim_request(world)
            idle = world.rss_kib()
            sampler = noisy.RssSampler(world)
            sampler.start()
            baseline, during, errors, outcomes, first = [], [], [], [], None
            per_round = -(-args.samples // args.rounds)
            for _ in range(args.rounds):  # alone, then under attack, in turns: the machine's drift hits both
                fresh = noisy.victim_samples(world, per_round, args.pace, keepalive=args.victim == "keepalive")
                first = first if first is not None else fresh
                baseline += fresh
                victim = _under_attack(world, name, attack, per_round, args, outcomes)
                during += victim.samples
                errors += victim.errors
            peak = sampler.stop()
            alive = world.gateway.process.poll() is None
            attacker_lines = len(world.audit_lines(world.attacker))
        finally:
            world.stop()
    base, during, clean = noisy.summary(baseline), noisy.summary(during), noisy.summary(first)
    seen: dict = {"repeats": len(outcomes), "statuses": {}, "resets": 0, "goaway": set(), "closed": 0, "notes": set()}
    for outcome in outcomes:
        for status, n in outcome.statuses.items():
            seen["statuses"][status] = seen["statuses"].get(status, 0) + n
        seen["resets"] += outcome.resets
        if outcome.goaway is not None:
            seen["goaway"].add(outcome.goaway)
        seen["closed"] += outcome.closed
        seen["notes"].update(outcome.notes)
    seen["goaway"], seen["notes"] = sorted(seen["goaway"]), sorted(seen["notes"])[:5]
    return {"attack": name, "baseline": base, "during": during, "victim_errors": errors[:5],
            "victim_failed": len(errors) + during["requests"] - during["ok"],
            "p50_ratio": during["p50_ms"] / base["p50_ms"], "p99_ratio": during["p99_ms"] / base["p99_ms"],
            "first_baseline": clean, "p99_ratio_first": during["p99_ms"] / clean["p99_ms"],
            "idle_rss_mib": idle / 1024, "peak_rss_mib": peak / 1024, "rss_ratio": peak / idle,
            "alive": alive, "attacker_audit_lines": attacker_lines, "attacker_saw": seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(noisy.ATTACKS), help="attacks to run (repeatable)")
    parser.add_argument("--samples", type=int, default=60, help="B's requests in the baseline and during each attack")
    parser.add_argument("--pace", type=float, default=0.1,
                        help="seconds between the starts of B's requests (0: back to back, B then takes about half "
                             "the worker itself and its own share applies to it)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns of baseline then attack, each with samples/rounds of B's requests (the "
                             "machine's own drift over a run then weighs on both sides alike)")
    parser.add_argument("--max-seconds", type=float, default=40.0, help="the longest an attack is repeated for, per round")
    parser.add_argument("--bomb-mb", type=int, default=300, help="decoded size of the decompression bomb (MiB)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a gateway option")
    parser.add_argument("--victim", choices=["fresh", "keepalive"], default="fresh",
                        help="B's request: a fresh tunnel + TLS + GET each time (an agent's curl), or a GET on "
                             "one kept-alive tunnel (an SDK between two calls); the second shows a stall of the "
                             "loop at a tenth of the size")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="let every process run on any CPU (default on 2+ CPUs: the gateway alone on CPU 0, "
                             "the attacker, B and the origins on the others, as in production, where the sandboxes "
                             "do not run on the gateway's CPU)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    args.pin = args.pin and len(os.sched_getaffinity(0)) >= 2
    if args.pin:  # this process, and every process it starts, off CPU 0; the gateway is moved onto it
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})
    results = []
    for name in args.only or list(noisy.ATTACKS):
        print(f"... {name}", file=sys.stderr, flush=True)
        results.append(run_attack(name, args))
    where = "gateway alone on CPU 0, the rest on the other CPUs" if args.pin else "no CPU pinning"
    how = "a GET on one kept-alive tunnel" if args.victim == "keepalive" else "fresh tunnel + TLS + GET"
    print(f"B: {how} per request, {args.samples} alone then {args.samples}+ during each attack, in {args.rounds} "
          f"rounds; {where}. p99 ratio: against every baseline round (against the first, before any attack)\n")
    print("| attack (sandbox A) | B p50 ms (base → during) | B p99 ms (base → during) | p99 ratio (vs first) | B failed | "
          "RSS MiB (idle → peak) | RSS ratio | A audit lines | A saw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        saw = r["attacker_saw"]
        what = ", ".join(f"{n}x{s}" for s, n in sorted(saw["statuses"].items()))
        if saw["resets"]:
            what += f", {saw['resets']} resets"
        if saw["goaway"]:
            what += f", GOAWAY {saw['goaway']}"
        if saw["closed"]:
            what += f", closed {saw['closed']}/{saw['repeats']}"
        print(f"| {r['attack']} | {r['baseline']['p50_ms']:.1f} → {r['during']['p50_ms']:.1f} | "
              f"{r['baseline']['p99_ms']:.1f} → {r['during']['p99_ms']:.1f} | {r['p99_ratio']:.2f} ({r['p99_ratio_first']:.2f}) | "
              f"{r['victim_failed']} | {r['idle_rss_mib']:.0f} → {r['peak_rss_mib']:.0f} | {r['rss_ratio']:.2f} | "
              f"{r['attacker_audit_lines']} | {what.strip(', ')}{'' if r['alive'] else ' (GATEWAY DIED)'} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
