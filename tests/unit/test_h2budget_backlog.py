"""gateway/h2budget.py `Backlog`: events come out in order, a step ends after so many requests or
once its time is spent (only while events are left), and `bytes` is what the waiting events carry.
The HTTP/2 server that drives it: tests/unit/test_h2_backlog.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.h2budget import Backlog

# An event: ("req", n) opens a request, ("data", size) carries size body bytes, ("other", 0).
events_ = st.lists(st.tuples(st.sampled_from(["req", "data", "other"]), st.integers(0, 1000)), max_size=60)


def _backlog(per_step: int = 8, seconds: float = 1e9, clock=None) -> Backlog:
    kwargs = {"clock": clock} if clock is not None else {}
    return Backlog(lambda e: e[1] if e[0] == "data" else 0, lambda e: e[0] == "req", per_step, seconds, **kwargs)


def _steps(backlog: Backlog) -> list[list]:
    steps = []
    while backlog:
        steps.append(list(backlog.step()))
    return steps


@given(events_, st.integers(1, 10))
def test_steps_hand_out_every_event_in_order_at_most_so_many_requests_each(events, per_step):
    backlog = _backlog(per_step)
    backlog.extend(events)
    steps = _steps(backlog)
    assert [e for step in steps for e in step] == events
    for step in steps:
        assert sum(e[0] == "req" for e in step) <= per_step
    for step in steps[:-1]:  # a step ends early only on the request that filled it
        assert step[-1][0] == "req" and sum(e[0] == "req" for e in step) == per_step
    assert backlog.bytes == 0


@given(events_)
def test_bytes_is_what_the_waiting_events_carry(events):
    backlog = _backlog(per_step=1)
    backlog.extend(events)
    while backlog:
        assert backlog.bytes == sum(e[1] for e in backlog if e[0] == "data")
        for event in backlog.step():
            assert backlog.bytes == sum(e[1] for e in backlog if e[0] == "data")
    assert backlog.bytes == 0


def test_a_step_ends_once_its_time_is_spent_checked_after_each_request():
    now = [0.0]
    backlog = _backlog(per_step=100, seconds=1.0, clock=lambda: now[0])
    backlog.extend([("req", 1), ("data", 5), ("req", 2), ("req", 3), ("data", 7)])
    handed = []
    for event in backlog.step():
        handed.append(event)
        if event == ("req", 2):
            now[0] = 1.0  # handling this request spent the step's time
    assert handed == [("req", 1), ("data", 5), ("req", 2)]
    assert list(backlog) == [("req", 3), ("data", 7)] and backlog.bytes == 7


def test_the_last_request_ends_no_step_early_when_nothing_is_left():
    backlog = _backlog(per_step=1)
    backlog.extend([("req", 1)])
    assert list(backlog.step()) == [("req", 1)] and not backlog


def test_clear_drops_the_events_and_their_bytes_even_mid_step():
    backlog = _backlog()
    backlog.extend([("data", 3), ("data", 4), ("req", 1)])
    step = backlog.step()
    assert next(step) == ("data", 3)
    backlog.clear()
    assert list(step) == [] and len(backlog) == 0 and backlog.bytes == 0


def _stream(event) -> int | None:
    return event[2] if len(event) > 2 else None


def test_a_step_ends_once_its_time_is_spent_after_data_events_too():
    """Review 15: only a request ended a step by time, so a backlog of DATA alone (thousands of
    one-byte frames in one read) was handled in one step however long it took."""
    now = [0.0]
    backlog = _backlog(per_step=100, seconds=1.0, clock=lambda: now[0])
    backlog.extend([("data", 1), ("data", 2), ("data", 3), ("other", 0)])
    handed = []
    for event in backlog.step():
        handed.append(event)
        if event == ("data", 2):
            now[0] = 1.0
    assert handed == [("data", 1), ("data", 2)]
    assert list(backlog) == [("data", 3), ("other", 0)] and backlog.bytes == 3


@given(st.lists(st.tuples(st.sampled_from(["req", "data", "other"]), st.integers(0, 1000), st.integers(1, 8)),
                max_size=60), st.integers(1, 20_000))
def test_taking_the_heaviest_takes_heaviest_first_no_more_than_needed_and_keeps_the_order(events, need):
    """`take_heaviest(need)` is what taking `heaviest` one stream at a time until `need` bytes are
    gone did, in one pass: the streams taken carry at least as much as any kept, the last one
    taken was needed, and every event keeps its order."""
    backlog = _backlog()
    backlog.extend(events)
    taken = backlog.take_heaviest(need, _stream)
    carried = {}
    for kind, size, sid in events:
        if kind == "data" and size:
            carried[sid] = carried.get(sid, 0) + size
    taken_ids = [sid for sid, _ in taken]
    weights = [carried[sid] for sid in taken_ids]
    assert weights == sorted(weights, reverse=True)
    kept_ids = set(carried) - set(taken_ids)
    if taken_ids:
        assert min(weights) >= max((carried[sid] for sid in kept_ids), default=0)
        assert sum(weights[:-1]) < need  # the last one taken was needed
    assert sum(weights) >= need or not kept_ids  # enough went, or every stream carrying bytes did
    for sid, its in taken:
        assert its == [e for e in events if e[2] == sid]
    left = [e for e in events if e[2] not in set(taken_ids)]
    assert list(backlog) == left
    assert backlog.bytes == sum(e[1] for e in left if e[0] == "data")
