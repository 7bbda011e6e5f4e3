"""What a proxy token costs (policy `identity: tokens:`; not a test, see bench/README.md).

    .venv/bin/python bench/tokens.py            # about 20 seconds
    .venv/bin/python bench/tokens.py --tokens 10000 --rounds 5

Three figures, in process, no servers:
- cold: one signature verification per token (every token new to the cache), per algorithm;
- cached: the same token again (a hash and an LRU lookup);
- per connection: a new ClientSession's whole proxy-level decision (parse Proxy-Authorization,
  verify through the cache, identify the session, scope_of, the CONNECT decision) with N distinct
  warm tokens taken round-robin, against one token every time. The ratio (N / one) is measured in
  the same run, rounds interleaved; the target is at most 1.2.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.tokens import claims, new_signer, write_jwks  # noqa: E402
from gateway.engine import Engine  # noqa: E402
from gateway.hostnames import canonical_host  # noqa: E402
from gateway.identity import scope_of  # noqa: E402
from gateway.policy import compile_policy  # noqa: E402
from gateway.proxyauth import authenticate  # noqa: E402
from gateway.session import ClientSession, decide_destination  # noqa: E402
from gateway.tokens import TokenSettings, TokenVerifier  # noqa: E402

ALGORITHMS = ("EdDSA", "ES256", "RS256", "PS256")
RATIO_TARGET = 1.2


def basic(token: str) -> str:
    return "Basic " + base64.b64encode(f"sandbox:{token}".encode()).decode()


def cold_and_cached(directory: Path, count: int) -> dict[str, tuple[float, float]]:
    """alg -> (median µs of a first verification, median µs of a cached one)."""
    out = {}
    for alg in ALGORITHMS:
        signer = new_signer(alg)
        path = write_jwks(directory / f"{alg}.json", signer)
        settings = TokenSettings((path,), True, (alg,), "egress-gateway", leeway=30.0)
        verifier = TokenVerifier(settings, frozenset({"agent"}))
        tokens = [signer.mint(claims(f"task-{i}", "agent")) for i in range(count)]
        cold = []
        for token in tokens:
            started = time.perf_counter()
            verifier.verify(token)
            cold.append(time.perf_counter() - started)
        one = tokens[0]
        cached = []
        for _ in range(count * 20):
            started = time.perf_counter()
            verifier.verify(one)
            cached.append(time.perf_counter() - started)
        out[alg] = (statistics.median(cold) * 1e6, statistics.median(cached) * 1e6)
    return out


def per_connection(directory: Path, count: int, rounds: int) -> tuple[float, float]:
    """(µs per connection with `count` distinct warm tokens, µs with one token), best of `rounds`."""
    signer = new_signer("EdDSA")
    write_jwks(directory / "jwks.json", signer)
    text = textwrap.dedent("""\
        version: 1
        resolver: {static_hosts: {pypi.test: [192.0.2.10]}}
        rules: [{id: pypi, hosts: [pypi.test]}]
        sandboxes: [{id: agent, rules: [pypi]}]
        identity: {tokens: {keys: jwks.json, audience: egress-gateway, algorithms: [EdDSA]}}
        """)
    (directory / "policy.yaml").write_text(text)
    policy = compile_policy(text, str(directory / "policy.yaml"))
    engine = Engine.build(policy)
    verifier = engine.tokens
    host = canonical_host("pypi.test")
    headers = [[basic(signer.mint(claims(f"task-{i}", "agent", ttl=3600)))] for i in range(count)]
    for values in headers:  # warm: every token verified once
        assert authenticate(ClientSession("c", "regular"), values, verifier) is None
    verifications = verifier.verifications

    def run(pick) -> float:
        started = time.perf_counter()
        for i in range(count):
            session = ClientSession("c", "regular")
            if authenticate(session, pick(i), verifier) is not None:
                raise SystemExit("a warm token was refused")
            scope = scope_of(policy, None, session.identity)
            if not decide_destination(engine, scope, host, 443).decision.allowed:
                raise SystemExit("the CONNECT was refused")
        return (time.perf_counter() - started) / count * 1e6

    many, one = [], []
    for _ in range(rounds):  # interleaved, so drift hits both alike
        many.append(run(lambda i: headers[i]))
        one.append(run(lambda i: headers[0]))
    if verifier.verifications != verifications:
        raise SystemExit("the cache missed: the figure would include signature checks")
    return min(many), min(one)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000, help="distinct tokens (default 10000)")
    parser.add_argument("--cold", type=int, default=200, help="tokens verified cold per algorithm (default 200)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        figures = cold_and_cached(directory, args.cold)
        many, one = per_connection(directory, args.tokens, args.rounds)
    print("| algorithm | cold verify (µs, median) | cached (µs, median) |")
    print("|---|---|---|")
    for alg, (cold, cached) in figures.items():
        print(f"| {alg} | {cold:.1f} | {cached:.2f} |")
    ratio = many / one
    print()
    print(f"per connection (auth + scope + CONNECT decision): {args.tokens} distinct tokens {many:.1f} µs, "
          f"one token {one:.1f} µs, ratio {ratio:.2f} (target <= {RATIO_TARGET})")
    return 0 if ratio <= RATIO_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
