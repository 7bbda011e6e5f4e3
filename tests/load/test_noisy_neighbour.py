"""One sandbox cannot hurt the others (issue 15): sandbox A runs each attack of the noisy-neighbour
benchmark (bench/noisy.py) while sandbox B keeps making its simple request through the same
worker. Each attack must end in its documented refusal (an audit line with its reason code), B
must be served throughout (every request 200, none failed), the gateway must stay alive, and A's
audit lines must stay bounded. Timing is the benchmark's business, not this test's: nothing here
measures latency.

Budgets are set lower than their defaults where the default would make the test slow (a budget of
`egress_*` seconds or requests the attack would otherwise need minutes to exhaust); each such
option says so below.
"""

from __future__ import annotations

import threading

import pytest

from bench.lib import noisy
from tests.support.waiting import wait_for

pytestmark = pytest.mark.load

OCTETS = (250, 251, 252, 253)  # A's origin, sandbox A, sandbox B, B's origin, in the session block

# attack -> (kwargs, the reason code its refusal is audited with, most audit lines A may write)
CASES = {
    "h2_held_streams": (dict(streams=300, per_stream=900_000), "too_many_streams", 400),
    "decompression_bomb": (dict(times=2), "response_too_large", 10),
    "huge_client_hello": (dict(), "client_hello_too_large", 5),
    "h2_rapid_reset": (dict(streams=6000), "reset_flood", 400),
    "request_flood": (dict(connections=4, requests=600), "rate_limited", 300),
    "connection_flood": (dict(count=300), "connection_rate_limited", 300),
    "request_body_bomb": (dict(connections=2, requests=6), "request_too_large", 20),
    "streamed_bomb": (dict(times=2), "response_too_large", 10),
    "h2_header_block": (dict(value_bytes=2 << 20), "request_head_too_large", 5),
    "many_header_fields": (dict(connections=2, seconds=5.0), "too_many_header_fields", 200),
    "h2_small_data": (dict(rounds=4), "small_frame_flood", 450),  # (a request line a stream opened)
}

# Lower than the defaults so the floods reach them within a few hundred requests on a slow machine
# (the defaults are generous: an agent running pip opens dozens of connections a second). B makes
# at most VICTIM_RATE requests a second, each on a new connection: under its own budgets.
# The loop share is off: it would slow A's floods below these rates before they reach their
# refusals (tests/load/test_fair_share.py tests it).
ARGS = [
    "--set", "egress_max_loop_share_per_sandbox=0",
    "--set", "egress_max_requests_per_second_per_sandbox=20", "--set", "egress_request_burst_per_sandbox=40",
    "--set", "egress_max_new_connections_per_second_per_sandbox=20", "--set", "egress_new_connection_burst_per_sandbox=40",
]
VICTIM_RATE = 10


@pytest.fixture(scope="module")
def world(tmp_path_factory, upstreams):
    world = noisy.make_world(tmp_path_factory.mktemp("noisy"), upstreams.block, ARGS, bomb_size=300 << 20,
                             octets=OCTETS)
    yield world
    world.stop()


def _lines_after(world, source: str, start: int) -> list[dict]:
    return [e for e in world.gateway.audit()[start:] if str(e.get("client", "")).startswith(source + ":")]


def _refusal_lines(world, start: int, reason: str) -> list[dict]:
    """The attacker's audit lines after `start`, once one has `reason` (the refusal's line); all of
    them after noisy.TIMEOUT if none has (the test's assertion then names the reasons seen)."""
    def refused():
        lines = _lines_after(world, world.attacker, start)
        return lines if any(e.get("reason") == reason for e in lines) else None

    try:
        return wait_for(refused, noisy.TIMEOUT, f"a {reason} line")
    except AssertionError:
        return _lines_after(world, world.attacker, start)


@pytest.mark.parametrize("name", list(CASES))
def test_an_attack_is_refused_while_the_other_sandbox_is_served(world, name):
    kwargs, reason, max_lines = CASES[name]
    start = len(world.gateway.audit())
    victim = noisy.Victim(world, pace=1 / VICTIM_RATE)
    victim.start()
    assert victim.first.wait(noisy.TIMEOUT), victim.errors
    served_before = len(victim.samples)
    if name == "h2_held_streams":
        hold = threading.Event()
        outcomes: list = []
        holder = threading.Thread(target=lambda: outcomes.append(noisy.h2_held_streams(world, hold=hold, **kwargs)),
                                  daemon=True)
        holder.start()
        lines = _refusal_lines(world, start, reason)
        hold.set()
        holder.join(noisy.TIMEOUT)
    else:
        outcomes = [noisy.ATTACKS[name](world, **kwargs)]
        lines = _refusal_lines(world, start, reason)
    # B is served during and after the attack: a request that starts after the refusal completes
    after = len(victim.samples)
    wait_for(lambda: len(victim.samples) > after, noisy.TIMEOUT, "a victim request after the refusal",
             detail=lambda: repr(victim.errors))
    victim.stop()
    assert world.gateway.process.poll() is None, world.gateway.log()[-3000:]
    assert any(e.get("reason") == reason for e in lines), (sorted({e.get("reason") for e in lines}), outcomes)
    assert not victim.errors, victim.errors
    assert all(status == 200 for _, status in victim.samples), victim.samples
    assert len(victim.samples) > served_before
    assert len(lines) <= max_lines, (len(lines), sorted({e.get("reason") for e in lines}))
    assert not [e for e in _lines_after(world, world.victim, start) if e.get("decision") != "allow"]
