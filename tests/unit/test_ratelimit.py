"""gateway/ratelimit.py: token buckets, sliding windows, quotas and sizes, with an injected clock."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ratelimit import (MAX_RETRY_AFTER, MIN_RATE, BucketTable, Quotas, SlidingWindow, parse_rate, parse_size,
                               retry_after_header)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- token buckets ---------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.1, 100), burst=st.integers(1, 50),
       events=st.lists(st.tuples(st.floats(0, 2), st.integers(0, 3)), max_size=200))
def test_a_bucket_never_admits_more_than_its_burst_plus_what_refilled(rate, burst, events):
    clock = Clock()
    table = BucketTable(rate, burst, clock=clock)
    start = clock.now
    admitted: dict[int, int] = {}
    for dt, key in events:
        clock.now += dt
        wait = table.take(key)
        if wait == 0.0:
            admitted[key] = admitted.get(key, 0) + 1
        else:
            assert wait > 0
        for k, n in admitted.items():
            assert n <= burst + rate * (clock.now - start) + 1e-6


@settings(max_examples=100, deadline=None)
@given(rate=st.floats(0.5, 50), burst=st.integers(1, 20), idle=st.floats(0, 5))
def test_the_wait_given_is_exactly_enough(rate, burst, idle):
    clock = Clock()
    table = BucketTable(rate, burst, clock=clock)
    for _ in range(burst):
        assert table.take("k") == 0.0
    clock.now += idle
    wait = table.take("k")
    if wait:
        clock.now += wait * (1 - 1e-9) * 0.5
        assert table.take("k") > 0  # half the wait is not enough
        clock.now += wait  # well past it
        assert table.take("k") == 0.0


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.integers(1, 2000))
def test_cycling_keys_never_grows_the_table_past_its_cap(cap, keys):
    clock = Clock()
    table = BucketTable(0.001, 1, max_keys=cap, clock=clock)  # nothing refills: nothing is idle-full
    for key in range(keys):
        table.take(("address", key))
        assert len(table) <= cap


def test_idle_full_buckets_are_evicted_as_the_table_is_used():
    clock = Clock()
    table = BucketTable(10, 5, clock=clock)
    for key in range(100):
        table.take(key)
    assert len(table) == 100
    clock.now += 1.0  # 10 tokens refilled: every bucket is full again
    for _ in range(60):
        table.take("active")
    assert len(table) == 1


def test_a_zero_rate_is_no_limit_and_keeps_nothing():
    table = BucketTable(0, 0)
    assert all(table.take(k) == 0.0 for k in range(1000))
    assert len(table) == 0


def test_configure_caps_saved_tokens_to_the_new_burst():
    clock = Clock()
    table = BucketTable(0.001, 10, clock=clock)
    table.take("k")
    table.configure(0.001, 2)
    assert [table.take("k") == 0.0 for _ in range(3)] == [True, True, False]


# --- sliding windows -------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(period=st.sampled_from([60.0, 3600.0, 7.5]), slots=st.integers(1, 60),
       events=st.lists(st.tuples(st.floats(0, 30), st.integers(0, 500)), max_size=120))
def test_a_window_counts_exactly_the_slots_of_the_last_period(period, slots, events):
    """Against a reference that keeps every event: what `used` says is the sum of the amounts added
    in the slots the window covers now."""
    width = period / slots
    now = 5000.0
    window = SlidingWindow(10**9, period, now, slots)
    log: list[tuple[float, int]] = []
    for dt, amount in events:
        now += dt
        window.add(amount, now)
        log.append((now, amount))
        head = math.floor(now / width)
        expected = sum(a for t, a in log if math.floor(t / width) > head - slots)
        assert window.used(now) == expected


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 1000), period=st.sampled_from([60.0, 3600.0]),
       events=st.lists(st.tuples(st.floats(0, 120), st.integers(1, 400)), max_size=80))
def test_a_window_admits_no_more_than_its_limit_and_its_wait_is_enough(limit, period, events):
    now = 100.0
    window = SlidingWindow(limit, period, now)
    for dt, amount in events:
        now += dt
        if window.fits(amount, now):
            window.add(amount, now)
            assert window.used(now) <= limit
            continue
        wait = window.retry_after(amount, now)
        assert wait > 0
        if amount > limit:
            assert wait == period  # never fits: the whole period
            continue
        earlier = copy.deepcopy(window)
        if wait > period / 120:  # half a slot less is not enough: the wait is the earliest that fits
            assert not earlier.fits(amount, now + wait - period / 120)
        assert window.fits(amount, now + wait)  # waiting as long as it says is enough


def test_a_window_forgets_after_a_whole_period_and_survives_a_clock_step_back():
    window = SlidingWindow(3, 60, 0.0)
    for t in (0.0, 1.0, 2.0):
        window.add(1, t)
    assert not window.fits(1, 30.0)
    assert window.fits(1, 61.0)  # the slot of t=0 left the window
    window.add(1, 61.0)
    assert window.used(10.0) == 2  # (t=1 left too); an earlier time expires nothing and breaks nothing


def test_quotas_keep_only_the_keys_the_new_policy_has_under_its_new_limits():
    clock = Clock()
    quotas = Quotas(clock)
    quotas.window("kept", 5, 60).add(4, clock.now)
    quotas.window("gone", 5, 60).add(4, clock.now)
    quotas.keep(lambda key: 10 if key == "kept" else None)
    assert list(quotas.keys()) == ["kept"]
    kept = quotas.window("kept", 10, 60)
    assert (kept.used(clock.now), kept.limit) == (4, 10)
    assert quotas.window("gone", 5, 60).used(clock.now) == 0  # a new counter



def test_quotas_are_bounded_and_drop_empty_windows_first():
    """Sandbox ids come from traffic too (a token's subject): the windows they make are bounded."""
    clock = Clock()
    quotas = Quotas(clock, max_windows=3)
    quotas.window("busy", 5, 60).add(1, clock.now)
    for i in range(10):
        quotas.window(f"idle{i}", 5, 60)  # never counted anything
        clock.now += 61
        quotas.window("busy", 5, 60).add(1, clock.now)
    # idle ones were dropped once a period had passed since they were asked for: nothing was lost
    assert len(quotas) <= 3 and "busy" in quotas.keys() and quotas.evicted_in_use == 0
    for i in range(5):
        quotas.window(f"full{i}", 5, 60).add(1, clock.now)
    assert len(quotas) == 3 and quotas.evicted_in_use > 0  # past the cap, the least recently used goes
    clock.now += 61  # everything drained: each new window sweeps the oldest empty ones
    evicted = quotas.evicted_in_use
    for i in range(3):
        quotas.window(f"new{i}", 5, 60)
    assert sorted(quotas.keys()) == ["new0", "new1", "new2"] and quotas.evicted_in_use == evicted


def test_a_window_just_asked_for_is_never_swept_before_it_counts():
    """One request asks for several windows before counting on any: none is swept meanwhile."""
    clock = Clock()
    quotas = Quotas(clock, max_windows=100)
    first = quotas.window("sandbox", 5, 60)
    quotas.window("rule", 5, 60)
    first.add(1, clock.now)
    assert quotas.window("sandbox", 5, 60) is first


def test_a_window_in_use_is_kept_by_being_used():
    clock = Clock()
    quotas = Quotas(clock, max_windows=2)
    quotas.window("a", 5, 60).add(1, clock.now)
    quotas.window("b", 5, 60).add(1, clock.now)
    quotas.window("a", 5, 60)  # a used again: b is now the least recently used
    quotas.window("c", 5, 60).add(1, clock.now)
    assert sorted(quotas.keys()) == ["a", "c"]


# --- sizes -----------------------------------------------------------------------------------

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@given(st.integers(0, 10**6), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]), st.booleans())
def test_sizes_parse_with_their_unit(number, unit, space, lower):
    text = f"{number}{space}{unit.lower() if lower else unit}"
    assert parse_size(text) == number * UNITS[unit]
    assert parse_size(number) == number


@pytest.mark.parametrize("value", ["", "MiB", "-1", "1 parsec", "1e9", "0x10", "1.5.2MiB", True, None, 1.5, -3,
                                   "99999999999999999999TiB"])
def test_bad_sizes_are_refused(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_retry_after_is_whole_seconds_and_never_zero():
    assert [retry_after_header(s) for s in (0.0, 0.01, 1.0, 1.2, 59.99)] == ["1", "1", "1", "2", "60"]
    assert [retry_after_header(s) for s in (-1.0, float("-inf"), float("nan"), float("inf"))] == [
        "1", "1", str(MAX_RETRY_AFTER), str(MAX_RETRY_AFTER)]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.floats().map(lambda f: f"{f:e}"),
                 st.integers(-400, 400).map(lambda e: f"1e{e}"), st.text(max_size=12)))
def test_a_rate_is_refused_or_gives_finite_bounded_waits(text):
    """Any rate text is either refused (ValueError) or a rate whose every wait and Retry-After is
    finite and at most MAX_RETRY_AFTER: 1e-320 used to make every refusal a 500."""
    try:
        rate = parse_rate(text)
    except ValueError:
        return
    assert rate == 0 or (MIN_RATE <= rate < math.inf and math.isfinite(1 / rate))
    table = BucketTable(rate, 1, clock=lambda: 0.0)
    table.take("k")
    wait = table.take("k", cost=2)
    assert 0 <= wait <= MAX_RETRY_AFTER
    header = retry_after_header(wait) if wait else "1"
    assert 1 <= int(header) <= MAX_RETRY_AFTER


@pytest.mark.parametrize("text", ["1e-320", "1e-300", "0.0009", "-1", "nan", "inf", "-0.5", "x", ""])
def test_tiny_negative_and_non_numbers_are_not_rates(text):
    with pytest.raises(ValueError):
        parse_rate(text)


@pytest.mark.parametrize("seconds", [math.inf, math.nan, 1e300, 10**6])
def test_retry_after_is_clamped(seconds):
    assert retry_after_header(seconds) == str(MAX_RETRY_AFTER)
