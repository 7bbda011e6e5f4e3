"""The control API at scale (issue 17): what 100,000 registered sandboxes cost a decision, how much
memory each takes, and how many registrations a second the API takes.

    python bench/control.py                    # 100,000 sandboxes, about a minute
    python bench/control.py --sandboxes 20000 --api 2000 --workers 2

1. Decision cost: the lookup every decision makes (`scope_of` through the registry) plus the
   engine's `check_request`, for a client of one registered sandbox (with a grant), and for clients
   spread over N registered sandboxes (each with a grant: one rule grant, and a hosts grant for one
   in ten), measured in the same run, interleaved, best of several rounds; the target is a ratio
   within 1.2x.
2. Memory per registered sandbox: tracemalloc over registering N (two addresses, two labels, one
   grant each) and one decision each (its cached scope), divided by N.
3. Registrations a second through the API: a real gateway (`python -m gateway run --control
   unix:...`, one process, or `--workers N`: the supervisor fans each change out and waits for
   every worker), one client on one keep-alive connection, each call returning only once the
   registration is in force.

A benchmark, not a test: it prints a markdown report and exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.commands.sandbox import ControlClient  # noqa: E402
from gateway.engine import Engine, RequestFacts  # noqa: E402
from gateway.grants import build_grant  # noqa: E402
from gateway.hostnames import canonical_host  # noqa: E402
from gateway.identity import scope_of  # noqa: E402
from gateway.policy import STANDARD_METHODS, compile_policy  # noqa: E402
from gateway.registry import Registry  # noqa: E402

POLICY = """version: 1
network:
  allow_ip_ranges: [127.0.0.0/8]
resolver:
  static_hosts:
    pypi.org: [127.0.0.1]
rules:
  - id: pypi
    hosts: [pypi.org, files.pythonhosted.org]
  - id: docs
    hosts: [docs.python.org]
  - id: npm
    hosts: [registry.npmjs.org]
    paths: ["/**"]
sandboxes:
  - id: default
    rules: []
  - id: agent
    rules: [pypi, npm]
    grantable:
      rules: [docs]
      hosts: ["*.github.com"]
      max_ttl: 1d
"""


def address(i: int) -> str:
    return str(ipaddress.ip_address("10.0.0.0") + i + 1)


def populate(policy, count: int, now: float) -> Registry:
    registry = Registry()
    envelope = policy.sandboxes_by_id["agent"].grantable
    for i in range(count):
        registry.apply({"op": "register", "registration": {
            "id": f"sandbox-{i}", "source_ips": [address(2 * i), address(2 * i + 1)], "profile": "agent",
            "expires": now + 86400, "expires_at": time.time() + 86400, "by": "bench",
            "labels": {"team": f"t{i % 50}", "task": str(i)}}})
        spec = {"rule": "docs"} if i % 10 else {"hosts": [f"r{i}.github.com"]}
        grant = build_grant(spec, envelope, policy.rules_by_id, grant_id=f"g{i}", sandbox=f"sandbox-{i}", by="bench",
                            now=now, wall=time.time(), standard_methods=STANDARD_METHODS)
        registry.apply({"op": "grant", "grant": grant.to_op()})
    return registry


def decision_cost(count: int, decisions: int, rounds: int) -> dict:
    policy = compile_policy(POLICY, "bench")
    engine = Engine.build(policy)
    now = time.monotonic()
    one = populate(policy, 1, now)
    many = populate(policy, count, now)
    host = canonical_host("pypi.org")
    facts = RequestFacts(host, 443, "https", "GET", "/simple/requests/")
    one_clients = [ipaddress.ip_address(address(0))] * decisions
    step = max(1, (2 * count) // decisions)
    many_clients = [ipaddress.ip_address(address((k * step) % (2 * count))) for k in range(decisions)]

    def run(registry: Registry, clients) -> float:
        engine.grant_rules = registry.grant_rules
        started = time.perf_counter()
        for client in clients:
            scope = scope_of(policy, client, None, registry, now)
            decision = engine.check_request(facts, scope)
        elapsed = time.perf_counter() - started
        assert decision.allowed, decision
        return elapsed / len(clients)

    for client in set(many_clients):  # warm every scope cache once, as live traffic would
        scope_of(policy, client, None, many, now)
    best_one, best_many = float("inf"), float("inf")
    for _ in range(rounds):
        best_one = min(best_one, run(one, one_clients))
        best_many = min(best_many, run(many, many_clients))
    return {"one_us": best_one * 1e6, "many_us": best_many * 1e6, "ratio": best_many / best_one,
            "distinct_clients": len(set(many_clients))}


def memory(count: int) -> dict:
    policy = compile_policy(POLICY, "bench")
    now = time.monotonic()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    registry = populate(policy, count, now)
    for i in range(count):
        scope_of(policy, ipaddress.ip_address(address(2 * i)), None, registry, now)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"bytes_per_sandbox": (after - before) / count, "total_mib": (after - before) / 2**20}


def api_rate(count: int, workers: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="egress-bench-control-"))
    policy = work / "policy.yaml"
    policy.write_text(POLICY)
    sock = work / "control.sock"
    env = dict(os.environ, PYTHONPATH=str(ROOT), EGRESS_WORKERS=str(workers))
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--policy", str(policy), "--mode", "regular@127.0.0.1:0",
         "--confdir", str(work / "conf"), "--control", f"unix:{sock}", "--control-rate", "0", "-q",
         "--workers", str(workers)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    client = ControlClient(f"unix:{sock}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = client.call("GET", "/v1/status")
                if status == 200 and (workers == 1 or _workers_ready(client)):
                    break
            except OSError:
                client.close()
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.1)
        started = time.perf_counter()
        confirmed = set()
        for i in range(count):
            status, body = client.register(f"sandbox-{i}", [address(i)], "agent", ttl_seconds=3600)
            assert status == 201, body
            confirmed.add(body["workers"])
        elapsed = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(count // 10):
            status, body = client.grant(f"sandbox-{i}", {"rule": "docs", "ttl_seconds": 600})
            assert status == 201, body
        grant_elapsed = time.perf_counter() - started
        return {"per_second": count / elapsed, "grants_per_second": (count // 10) / grant_elapsed,
                "workers_confirmed": sorted(confirmed)}
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(work, ignore_errors=True)


def _workers_ready(client: ControlClient) -> bool:
    """A probe registration that every worker confirmed (then removed)."""
    status, body = client.register("probe", ["10.255.255.254"], "agent", ttl_seconds=60)
    if status not in (200, 201):
        return False
    ready = body.get("workers") == int(os.environ.get("EGRESS_BENCH_WORKERS", "0") or body.get("workers"))
    client.deregister("probe")
    return ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--api", type=int, default=5000, help="registrations sent through the API")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    args = parser.parse_args()
    print(f"# Control API at scale ({args.sandboxes} registered sandboxes)\n")
    cost = decision_cost(args.sandboxes, args.decisions, args.rounds)
    print("## Decision cost (registry lookup + check_request), best of", args.rounds, "rounds\n")
    print("| sandboxes | µs per decision |\n|---|---|")
    print(f"| 1 | {cost['one_us']:.2f} |")
    print(f"| {args.sandboxes} ({cost['distinct_clients']} distinct clients) | {cost['many_us']:.2f} |")
    verdict = "within" if cost["ratio"] <= 1.2 else "NOT within"
    print(f"\nratio {cost['ratio']:.3f} ({verdict} the 1.2x target)\n")
    mem = memory(args.sandboxes)
    print("## Memory\n")
    print(f"{mem['bytes_per_sandbox']:.0f} bytes per registered sandbox (2 addresses, 2 labels, 1 grant, its "
          f"cached scope); {mem['total_mib']:.1f} MiB for {args.sandboxes}\n")
    print("## Registrations through the API (one client, one keep-alive connection, unix socket)\n")
    print("| workers | registrations/s | grants/s | workers confirming each change |\n|---|---|---|---|")
    for workers in args.workers:
        os.environ["EGRESS_BENCH_WORKERS"] = str(workers)
        rate = api_rate(args.api, workers)
        print(f"| {workers} | {rate['per_second']:.0f} | {rate['grants_per_second']:.0f} | "
              f"{rate['workers_confirmed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
