"""Each sandbox's share of a worker's event loop (gateway/fairshare.py, addons/fair_share.py):
sandbox A floods kept-alive requests at its allowed rates. Alone it is never slowed (the share only
matters when someone else waits); once sandbox B is active too, A's reads wait while it is over
its share (counted in `egress_loop_share_wait_seconds_total{sandbox="attacker"}`, more than B waits), B
is served throughout, and nothing is refused for it. The share is set low (5%) and the loop always counts as
contended and the share a hard cap (no lending of what the loop leaves idle), so that A passes its
share on any machine; timing is the benchmark's business
(bench/noisy.py), not this test's."""

from __future__ import annotations

import urllib.request

import pytest

from bench.lib import noisy
from tests.support.gateway import free_port
from tests.support.waiting import value_when

pytestmark = pytest.mark.load

OCTETS = (246, 247, 248, 249)  # A's origin, sandbox A, sandbox B, B's origin, in the session block


@pytest.fixture(scope="module")
def world(tmp_path_factory, upstreams):
    port = free_port()
    world = noisy.make_world(tmp_path_factory.mktemp("share"), upstreams.block, [
        "--set", "egress_max_loop_share_per_sandbox=0.05", "--set", "egress_loop_share_burst=0.02",
        "--set", "egress_loop_share_busy=0",  # always contended: on a starved machine the loop may look idle
        "--set", "egress_loop_share_headroom=1",  # the share is a hard cap: the flood need not fill the loop
        "--metrics", f"127.0.0.1:{port}"], octets=OCTETS)
    world.metrics = f"http://127.0.0.1:{port}/metrics"
    yield world
    world.stop()


def _sample(world, line_prefix: str) -> float:
    text = urllib.request.urlopen(world.metrics, timeout=10).read().decode()
    return sum(float(line[len(line_prefix):]) for line in text.splitlines() if line.startswith(line_prefix))


def _waited(world, sandbox: str) -> float:
    return _sample(world, f'egress_loop_share_wait_seconds_total{{sandbox="{sandbox}"}} ')


def _until(world, predicate) -> bool:
    """Whether the active-sandboxes gauge (the heartbeat sets it every second) comes to satisfy
    `predicate` within noisy.TIMEOUT."""
    active = value_when(lambda: _sample(world, "egress_loop_share_active_sandboxes "), predicate, noisy.TIMEOUT,
                        interval=0.1)
    return bool(predicate(active))


def _quiet(world) -> bool:
    """Make B active until the gateway's gauge has seen it, then wait until no sandbox is active:
    whatever came before (the start-up probe, another test) is then out of the share's window."""
    victim = noisy.Victim(world, pace=0.1)
    victim.start()
    seen = _until(world, lambda active: active >= 1)
    victim.stop()
    return seen and _until(world, lambda active: active == 0)


def test_a_lone_sandbox_is_never_slowed(world):
    assert _quiet(world)
    before = _waited(world, "attacker")
    outcome = noisy.request_flood(world, connections=4, requests=120, seconds=120)
    assert outcome.statuses.get(200) == 120, outcome
    assert _waited(world, "attacker") == before


def test_a_flood_waits_for_its_share_while_another_sandbox_is_served(world):
    victim = noisy.Victim(world, pace=0.1)
    victim.start()
    assert victim.first.wait(noisy.TIMEOUT), victim.errors
    outcome = noisy.request_flood(world, connections=4, requests=120, seconds=120)
    served = len(victim.samples)
    victim.stop()
    assert outcome.statuses.get(200) == 120, outcome  # slowed, never refused
    assert _waited(world, "attacker") > _waited(world, "victim")
    assert not victim.errors and served and all(status == 200 for _, status in victim.samples), victim.samples
