"""gateway/fairshare.py: each sandbox's share of the loop, driven by a fake clock."""

from __future__ import annotations

import math

import pytest

from hypothesis import given, settings, strategies as st

from gateway.fairshare import LEVEL_MIN_LOAD, LEVEL_PERIOD, MAX_DELAY, LoopShare, fill_level


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def share(**kw) -> tuple[LoopShare, Clock]:
    clock = Clock()
    return LoopShare(clock=clock, **kw), clock


def test_a_lone_sandbox_is_never_delayed_however_much_it_uses():
    s, clock = share()
    for _ in range(100):
        s.charge("a", 0.1)
        clock.now += 0.01
    assert s.tokens("a") < 0
    assert s.delay("a") == 0.0


def test_over_its_share_on_a_contended_loop_with_another_active_it_waits_for_its_debt():
    s, clock = share(max_share=0.5, burst=0.2, max_debt=100)  # (the debt uncapped: its arithmetic)
    s.charge("b", 0.1)  # another sandbox with a part of the loop
    s.charge("a", 0.4)  # 0.2 saved, 0.2 in debt
    assert s.share() == 0.5
    assert not s.contended()  # 40% of the loop: nobody waits, nobody is slowed
    assert s.delay("a") == 0.0
    s.charge("a", 0.4)  # 80%: contended, 0.6 in debt
    assert s.contended()
    assert s.delay("a") == min(0.6 / 0.5, MAX_DELAY)
    assert s.delay("b") == 0.0  # under its share


def test_the_load_decays_with_the_window():
    s, clock = share(window=1.0)
    s.charge("a", 0.9)
    assert s.contended()
    clock.now += 1.0
    assert abs(s.load() - 0.9 / 2.718281828) < 1e-6 and not s.contended()


def test_the_share_is_one_over_the_active_sandboxes_when_all_are_heavy_and_expires_with_the_window():
    s, clock = share(max_share=0.5, window=1.0)
    for key in "abcd":
        s.charge(key, 0.3)  # each wants more than the loop's level (0.8 / 4)
    assert s.active() == 4 and s.share() == 0.25
    clock.now += 1.5
    s.charge("a", 0.001)
    assert s.active() == 1 and s.share() == 0.5
    assert s.delay("a") == 0.0  # the others went quiet: a is alone again


def test_the_delay_is_capped_and_asked_again():
    s, clock = share(max_share=0.1, burst=0.0, max_debt=100)
    s.charge("b", 0.1)  # another sandbox with a part of the loop
    s.charge("a", 10.0)
    assert s.contended() and s.delay("a") == MAX_DELAY


def test_off_means_never_delayed():
    s, clock = share(max_share=0.0)
    s.charge("b", 1.0)
    s.charge("a", 10.0)
    assert s.delay("a") == 0.0 and s.tokens("a") is None


def test_keys_are_bounded():
    s, clock = share(max_keys=10)
    for k in range(1000):
        s.charge(k, 0.001)
    assert s.active() <= 10


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 0.05), st.floats(0, 0.2)), max_size=200))
def test_a_sandbox_that_waits_as_told_uses_no_more_than_its_share_plus_burst(steps):
    """Whatever the others do: if `a` only works when its delay is 0, its work over any run is at
    most its burst, plus the contention threshold's worth of the elapsed time (under it nobody is
    slowed), plus one window at that threshold (the load decays over a window) and one piece (a
    piece of work cannot be cut short)."""
    s, clock = share(max_share=0.5, burst=0.2)
    start, used = clock.now, 0.0
    s.charge("b", 0.0001)
    for key, work, gap in steps:
        clock.now += gap
        s.charge("b", 0.0001)  # b stays active
        if key == "a" and s.delay("a") == 0.0:
            s.charge("a", work)
            used += work
    assert used <= 0.2 + 0.7 * (clock.now - start) + 0.7 + 0.05 + 1e-9


def test_reads_in_debt_get_slots_spaced_by_a_reads_cost():
    """A sandbox in debt holding many connections: each read gets its own slot, the first when the
    debt is paid, the next ones a read's cost (at its share) apart."""
    s, clock = share(max_share=0.5, burst=0.005, busy=0.0, spare_headroom=1.0)  # (at its share only)
    s.charge("b", 0.001)
    s.charge("a", 0.01)  # one read cost 10 ms: 5 ms of debt
    waits = [s.reserve("a") for _ in range(5)]
    assert abs(waits[0] - 0.005 / 0.5) < 1e-9
    assert all(abs((b - a) - 0.01 / 0.5) < 1e-9 for a, b in zip(waits, waits[1:])), waits
    assert s.reserve("b") == 0.0  # not in debt: no slot to wait for


def test_a_sandbox_in_debt_refills_at_what_the_others_leave_of_the_loop_when_that_is_more():
    """Review 28: a legitimate upload next to 300 connections trickling a byte each (~10% of the
    loop) was held to its 1/N share, the rest of the loop idle: cut to a fifth. In debt, a sandbox
    refills at its share or at what the others' work left over the last second less the headroom,
    whichever is more; next to a neighbour that takes half, at its share."""
    s, clock = share(max_share=0.5, burst=0.0, busy=0.0, max_debt=100)
    s.charge("b", 0.1)  # the neighbour: a tenth of the loop
    s.charge("a", 0.5)
    assert abs(s.reserve("a") - 0.5 / (1.0 - 0.1 - 0.2)) < 1e-9  # at 0.7, not at 0.5
    busy, clock2 = share(max_share=0.5, burst=0.0, busy=0.0, max_debt=100)
    busy.charge("b", 0.6)  # a neighbour that takes more than half
    busy.charge("a", 0.5)
    assert abs(busy.reserve("a") - 0.5 / 0.5) < 1e-9


def test_the_headroom_is_configured_with_the_share_and_1_makes_the_share_a_hard_cap():
    """`egress_loop_share_headroom`: configured (and checked) with the other options; at 1 a
    sandbox in debt refills at its share however idle the others leave the loop."""
    s, clock = share(max_share=0.5, burst=0.0, busy=0.0, max_debt=100)
    s.configure(0.5, 0.0, 0.0, 1.0)
    s.charge("b", 0.1)
    s.charge("a", 0.5)
    assert abs(s.reserve("a") - 0.5 / 0.5) < 1e-9  # at its share, not at 0.7
    s.configure(0.5, 0.0)  # left as it was when not given
    assert s.spare_headroom == 1.0
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError):
            s.configure(0.5, 0.0, None, bad)


@pytest.mark.parametrize("max_share, burst, busy", [(math.nan, 0.05, 0.7), (0.5, math.nan, 0.7), (0.5, math.inf, 0.7),
                                                    (0.5, -0.01, 0.7), (0.5, 0.05, math.nan), (math.inf, 0.05, 0.7)])
def test_values_that_are_not_finite_numbers_in_range_are_refused(max_share, burst, busy):
    """Review 31: `egress_loop_share_burst=nan` passed `burst < 0`; every wait was then NaN seconds
    (truthy) and the worker stopped serving anyone once two sandboxes were active."""
    s, clock = share()
    with pytest.raises(ValueError):
        s.configure(max_share, burst, busy)


def test_in_debt_is_the_bucket_below_zero_whether_or_not_the_loop_is_contended():
    """The priority rule (addons/fair_share.py: an indebted sandbox yields to one within its
    share) asks `in_debt`; `delay` also needs contention and another active sandbox."""
    s, clock = share(max_share=0.5, burst=0.05)
    s.busy = 1.0  # never contended
    assert not s.in_debt("a")  # unknown
    s.charge("a", 0.04)
    assert not s.in_debt("a")
    s.charge("a", 0.02)  # 0.01 s in debt
    assert s.in_debt("a") and s.delay("a") == 0.0  # alone and uncontended: never waits
    clock.now += 0.01 / 0.5 + 0.001  # refilled at its share (1/N with N=1, capped at 0.5)
    assert not s.in_debt("a")


def test_a_pressed_loop_is_contended_only_while_the_last_tenth_of_a_second_was_busy():
    """`reserve(pressed=True)`: another sandbox is being served now. That makes the loop contended
    for an indebted sandbox only while the fast load (~0.1 s) is over `busy`: a neighbour served
    next to a loop with room to spare slows nobody."""
    s, clock = share(max_share=0.5, burst=0.0)
    s.charge("b", 0.001)  # b is active
    s.charge("a", 0.02)  # a in debt; 20 ms of work lately
    assert s.reserve("a") == 0.0  # the one-second average (~2%) is under busy
    assert s.reserve("a", pressed=True) == 0.0  # and so is the last 0.1 s (~20%)
    for _ in range(10):  # 10 ms of work every 10 ms: the fast load goes to ~1
        clock.now += 0.01
        s.charge("a", 0.01)
    assert s.load() < s.busy  # the one-second average is still under
    assert s.reserve("a") == 0.0
    assert s.reserve("a", pressed=True) > 0.0  # pressed and busy lately: a waits for its slot


def test_a_busy_sandbox_next_to_a_nearly_idle_one_is_not_slowed():
    """The loop is busy with the sandbox's own work; the other made one small request lately. That
    is no contention: nobody else wants the loop (a fresh-eyes review: a busy uploader lost a third
    to a half of its throughput next to a neighbour making one request every few seconds)."""
    s, clock = share(max_share=0.5, burst=0.0)
    s.charge("idle", 0.002)  # one small request
    for _ in range(300):  # a fills 90% of the loop for three seconds
        clock.now += 0.01
        s.charge("a", 0.009)
    assert s.load() >= s.busy and s.tokens("a") < 0
    assert s.reserve("a") == 0.0
    for _ in range(10):  # now the other takes a real part of it, and a goes on
        clock.now += 0.01
        s.charge("idle", 0.008)
        s.charge("a", 0.006)
    assert s.reserve("a") > 0.0


def test_the_debt_is_capped_so_that_what_was_used_while_nobody_waited_is_forgiven():
    s, clock = share(max_share=0.5, burst=0.0, busy=0.0)
    s.charge("b", 0.1)
    s.charge("a", 5.0)  # five seconds of work alone
    assert s.tokens("a") == -s.max_debt
    assert 0 < s.reserve("a") <= s.max_debt / 0.5 + 1e-9


def test_a_sandbox_has_one_noted_load_for_all_its_connections_until_its_next_turn():
    """The ready order compares sandboxes by the load noted at their last turn: one value per
    sandbox (per-connection values let two sandboxes each wait for the other's lighter-looking
    connection), read without a clock."""
    s, clock = share()
    assert s.noted_load("a") == -1.0  # never charged: not known
    s.charge("a", 0.3)
    assert s.noted_load("a") == -1.0  # charged, no turn yet
    noted = s.note_load("a")
    assert abs(noted - s.load_of("a")) < 1e-9 and s.noted_load("a") == noted
    clock.now += 5.0  # its load decays, its noted load stays until its next turn
    assert s.load_of("a") < noted and s.noted_load("a") == noted
    assert s.note_load("a") == s.load_of("a")


def test_a_burst_is_heavy_within_a_tenth_of_a_second_though_its_average_over_a_second_is_not():
    """Over the last second alone, a flood that had just begun counted as light for ~0.3 s and
    went first; so did one flooding for 0.2 s of every second (its average never reaches HEAVY)."""
    from gateway.fairshare import FAST_WINDOW, HEAVY, LOAD_WINDOW

    clock = [100.0]
    s = LoopShare(clock=lambda: clock[0])
    for _ in range(60):  # 60 ms of work in 60 ms
        clock[0] += 0.001
        s.charge("flood", 0.001)
    slow = s._shares["flood"].load.at(clock[0]) / LOAD_WINDOW
    assert slow < HEAVY <= s.load_of("flood")
    clock[0] += 5 * FAST_WINDOW  # quiet since: back to the second's average
    assert abs(s.load_of("flood") - s._shares["flood"].load.at(clock[0]) / LOAD_WINDOW) < 0.01
    s.charge("trickle", 0.0005)
    assert s.load_of("trickle") < HEAVY


@settings(max_examples=300, deadline=None)
@given(loads=st.lists(st.floats(0, 1), max_size=40), capacity=st.floats(0, 1))
def test_the_level_is_the_largest_that_the_capacity_holds(loads, capacity):
    """Max-min: below the level a sandbox keeps what it uses, above it each gets the level; the
    sum fits the capacity and no higher level would."""
    level = fill_level(sorted(loads), capacity)
    if capacity == 0 or not loads:
        assert level == (0.0 if capacity == 0 else math.inf)
        return
    if level == math.inf:
        assert sum(loads) <= capacity + 1e-9
        return
    assert sum(min(load, level) for load in loads) <= capacity + 1e-9
    assert sum(min(load, level + 1e-6) for load in loads) > capacity - 1e-9
    assert level >= capacity / len(loads) - 1e-12  # never below an equal split


def test_light_neighbours_leave_their_part_of_the_loop_to_the_others_not_1_over_n():
    """Review 34: a flood, four sandboxes making a request a second and one (b) making requests
    back to back. At 1/6 each, b (~30% of the loop) was in debt and waited for its turns ~290 times
    a second while the flood took what the light ones left: b's latency 4-5x. The max-min level
    gives b what the light ones leave, so it does not wait; the flood still does."""
    s, clock = share(max_share=0.5, burst=0.05, max_debt=100)
    for step in range(300):  # three seconds in 10 ms steps
        clock.now += 0.01
        s.charge("flood", 0.006)
        s.charge("b", 0.003)
        if step % 100 == 0:
            for light in "1234":
                s.charge(light, 0.004)  # a small request a second each
    assert s.active() == 6
    assert s.share() > 0.3 > 1 / 6  # (b's load)
    assert s.tokens("b") >= 0 and s.reserve("b") == 0.0
    assert s.reserve("flood") > 0.0  # the flood, over its level, still waits


def test_the_level_is_recomputed_from_a_bounded_number_of_sandboxes():
    """Ten thousand light sandboxes and two heavy ones: only the heavy ones are looked at one by
    one (the loads add up to about one loop, so at most ~1/LEVEL_MIN_LOAD are over it); the
    level is computed at most once per LEVEL_PERIOD."""
    s, clock = share(max_share=0.5, burst=0.0, max_debt=100)
    for key in range(10_000):
        s.charge(key, 0.00005)
    s.charge("x", 0.3)
    s.charge("y", 0.4)
    clock.now += LEVEL_PERIOD
    level = s.share()
    assert set(s._heavy) == {"x", "y"}
    light = s.load() - (0.3 + 0.4) * math.exp(-LEVEL_PERIOD)
    assert abs(level - min(0.5, fill_level(sorted([0.3 * math.exp(-LEVEL_PERIOD), 0.4 * math.exp(-LEVEL_PERIOD)]),
                                           1.0 - s.spare_headroom - light))) < 1e-6
    s.charge("x", 0.2)
    assert s.share() == level  # within the period: not recomputed
    s.charge("z", 0.5)
    assert s.share() < level  # but at once when another sandbox becomes heavy
    clock.now += 30  # all quiet: forgotten, and the heavy ones with them
    s.charge("x", LEVEL_MIN_LOAD / 2)
    s.share()
    assert set(s._heavy) == set()


def test_under_contention_a_sandbox_over_the_level_gives_way_though_under_heavy():
    """Review 34's probe spread over four sandboxes: each at ~0.2 of the loop, all under HEAVY, so
    none gave way to a neighbour making a request every 0.1 s, which waited behind all of their
    ready work. The line is the max-min level while that is lower than HEAVY (not under
    HEAVY_FLOOR), and the ready order follows it."""
    from gateway.fairshare import HEAVY, HEAVY_FLOOR, ReadyOrder

    s, clock = share()
    assert s.heavy() == HEAVY  # nobody yet: no level
    for step in range(500):  # five seconds in 10 ms steps
        clock.now += 0.01
        for attacker in "wxyz":
            s.charge(attacker, 0.0022)  # ~0.22 of the loop each
        if step % 10 == 0:
            s.charge("b", 0.005)  # one small request every 0.1 s: ~0.05
    s.share()
    assert HEAVY_FLOOR < s.heavy() < 0.2 < HEAVY
    assert s.load_of("b") < s.heavy() <= s.load_of("w") < HEAVY
    for line, gives_way in ((HEAVY, False), (s.heavy(), True)):
        order = ReadyOrder(heavy=line)
        order.ran("b", s.load_of("b"), clock.now, 0.001, False)  # b is being served
        assert order.yielding("w", s.load_of("w"), clock.now) is gives_way
    for many in range(40):  # forty such: the level is far lower, the line stops at the floor
        s.charge(("more", many), 0.2)
    clock.now += LEVEL_PERIOD
    s.share()
    assert s.heavy() == HEAVY_FLOOR
