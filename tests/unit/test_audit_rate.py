"""Refusal aggregation in the audit log: a flood of refusals from one sandbox writes a bounded number
of lines, every refusal is still accounted for (verbatim or in a summary's count), allows are never
aggregated, the summaries are chained like any line, and memory stays bounded."""

from __future__ import annotations

import json
import string

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.audit import AuditLog, verify_chain
from gateway.auditrate import OVERFLOW_SOURCE, RefusalAggregator, source_of


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def refusal(sandbox=None, client="10.0.0.1:4000", reason="no_rule", host="evil.test", event="request", rule=None):
    return {"event": event, "client": client, "sandbox": sandbox, "decision": "deny", "reason": reason,
            "rule": rule, "host": host, "status": 403, "mode": "regular", "port": 80}


def allow(**kw):
    return refusal(**kw) | {"decision": "allow", "reason": "allowed", "status": None}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_source_is_the_sandbox_or_the_client_address_without_its_port():
    assert source_of({"sandbox": "ci", "client": "10.0.0.1:5"}) == "sandbox:ci"
    assert source_of({"client": "10.0.0.1:5"}) == source_of({"client": "10.0.0.1:6"}) == "client:10.0.0.1"
    assert source_of({"client": "fd00::1:443"}) == "client:fd00::1"
    assert source_of({}) == "client:?"


def test_a_burst_verbatim_then_one_summary_per_kind_at_the_window_end():
    clock = Clock()
    agg = RefusalAggregator(per_source=5, per_key=3, burst_seconds=1, clock=clock)
    admitted = [agg.admit(refusal(host="a.test")) for _ in range(10)]
    assert admitted == [True] * 3 + [False] * 7  # per key
    admitted = [agg.admit(refusal(host=f"h{i}.test")) for i in range(4)]
    assert admitted == [True, True, False, False]  # per source: 5 verbatim in all
    assert agg.due() == []  # the window is still open
    clock.now += 1.0
    summaries = agg.due()
    assert sorted((s["host"], s["count"]) for s in summaries) == [("a.test", 7), ("h2.test", 1), ("h3.test", 1)]
    assert all(s["event"] == "suppressed" and s["suppressed_event"] == "request" and s["reason"] == "no_rule"
               and s["client"] == "10.0.0.1" and s["decision"] == "deny" for s in summaries)
    assert summaries[0]["window_start"] < summaries[0]["window_end"]
    # A second later the buckets are full again.
    assert [agg.admit(refusal(host="a.test")) for _ in range(4)] == [True] * 3 + [False]


def test_a_sustained_flood_writes_the_rate_and_one_summary_a_second():
    clock = Clock()
    agg = RefusalAggregator(per_source=50, per_key=10, clock=clock)
    written = summaries = 0
    for _ in range(10_000):  # 1,000 refusals a second for 10 s, one kind
        clock.now += 0.001
        summaries += len(agg.due())
        written += agg.admit(refusal())
    assert written <= 40 + 10 * 10 + 1  # the burst, then the key's rate
    assert 9 <= summaries <= 11


def test_ordinary_traffic_never_reaches_the_budget():
    """A test suite, a retrying client: a few refusals of one kind a second, bursts of dozens."""
    clock = Clock()
    agg = RefusalAggregator(clock=clock)
    for second in range(60):
        for n in range(5 if second % 10 else 35):
            clock.now += 0.01
            assert agg.admit(refusal(reason="path_not_allowed", host="api.test"))
        clock.now += 1.0


def test_allows_and_would_deny_are_never_aggregated():
    agg = RefusalAggregator(per_source=1, per_key=1, burst_seconds=1, clock=Clock())
    assert all(agg.admit(allow()) for _ in range(1000))
    assert all(agg.admit(refusal() | {"decision": "would_deny"}) for _ in range(1000))
    assert agg.suppressed == 0


def test_sources_do_not_share_a_budget():
    agg = RefusalAggregator(per_source=2, per_key=2, burst_seconds=1, clock=Clock())
    assert [agg.admit(refusal(sandbox="a")) for _ in range(3)] == [True, True, False]
    assert [agg.admit(refusal(sandbox="b")) for _ in range(3)] == [True, True, False]


def test_memory_is_bounded_by_sources_and_keys():
    clock = Clock()
    agg = RefusalAggregator(per_source=1, per_key=1, burst_seconds=1, clock=clock, max_sources=8, max_keys=4)
    for i in range(10_000):
        agg.admit(refusal(client=f"10.{i // 250}.{i % 250}.1:1", host=f"h{i}.test", reason=f"r{i % 3}"))
    assert agg.sources <= 8 + 1  # the overflow source
    assert all(len(s.counts) <= 2 * 4 + 1 for s in agg._sources.values())
    clock.now += 1.0
    summaries = agg.due()
    assert sum(s["count"] for s in summaries) == agg.suppressed
    assert any(s["sandbox"] is None and s["client"] is None for s in summaries)  # the overflow source's
    assert not agg._windows
    # Idle sources are forgotten when new ones need the room.
    clock.now += 10
    agg.admit(refusal(client="192.0.2.1:1"))
    assert agg.sources <= 2 and OVERFLOW_SOURCE not in agg._sources


def test_drain_flushes_open_windows_and_keeps_suppressing():
    clock = Clock()
    agg = RefusalAggregator(per_source=1, per_key=1, burst_seconds=1, clock=clock)
    agg.admit(refusal())
    assert not agg.admit(refusal())
    assert [s["count"] for s in agg.drain()] == [1]
    assert not agg.admit(refusal())  # the bucket is still empty: still over budget
    clock.now += 1
    assert [s["count"] for s in agg.due()] == [1]


def test_unwritten_summaries_come_back_first_and_are_bounded():
    clock = Clock()
    agg = RefusalAggregator(per_source=1, per_key=1, clock=clock, max_unwritten=2)
    agg.restore([{"count": 5}, {"count": 6}, {"count": 7}])
    assert agg.lost == 5
    assert [s["count"] for s in agg.due()] == [6, 7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["no_rule", "port_not_allowed"]),
                          st.sampled_from(string.ascii_lowercase[:4]), st.booleans(),
                          st.floats(min_value=0, max_value=0.7)), max_size=300),
       st.integers(1, 6), st.integers(1, 6))
def test_every_refusal_is_a_line_or_counted_once(events, per_source, per_key):
    """Whatever the interleaving: verbatim + sum(count) == refusals; allows all verbatim; per
    source and window at most per_source verbatim refusals."""
    clock = Clock()
    agg = RefusalAggregator(per_source=per_source, per_key=per_key, burst_seconds=1, clock=clock)
    verbatim = counted = refusals = allows = 0
    for sandbox, reason, host, denied, step in events:
        clock.now += step
        counted += sum(s["count"] for s in agg.due())
        entry = refusal(sandbox=sandbox, reason=reason, host=host) if denied else allow(sandbox=sandbox)
        if denied:
            refusals += 1
            verbatim += agg.admit(entry)
        else:
            allows += 1
            assert agg.admit(entry)
    counted += sum(s["count"] for s in agg.drain())
    assert verbatim + counted == refusals


# --- in the audit log ---------------------------------------------------------------------------


def test_audit_log_writes_a_bounded_flood_and_a_chained_summary(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), chain=True)
    log.configure(refusals_per_second=5, refusals_per_key=5)
    clock = Clock()
    log.refusals.clock = clock
    log.refusals.burst_seconds = 1
    log.refusals.configure(5, 5)
    for n in range(6000):  # a rapid-reset-sized flood in "one second"
        log.record(**refusal(sandbox="attacker") | {"path": f"/{n}"})
    for n in range(3):
        log.record(**allow(sandbox="attacker") | {"path": f"/ok{n}"})
    clock.now += 1.0
    log.maintain()
    records = lines(path)
    assert len(records) == 5 + 3 + 1
    summary = records[-1]
    assert summary["event"] == "suppressed" and summary["count"] == 5995 and summary["sandbox"] == "attacker"
    assert [r["path"] for r in records if r["decision"] == "allow"] == ["/ok0", "/ok1", "/ok2"]
    assert list(summary)[:19] == list(records[0])[:19]  # the 19 stable keys, in order
    assert verify_chain([str(path)]).ok
    assert log.suppressed == 5995


def test_a_pending_summary_is_written_at_close_and_before_a_reopen(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), chain=True)
    log.configure(refusals_per_second=1)
    log.refusals.clock = Clock()
    log.refusals.burst_seconds = 1
    log.refusals.configure(1, 1)
    for _ in range(4):
        log.record(**refusal())
    path.rename(tmp_path / "audit.jsonl.1")
    log.reopen()  # logrotate: the summary goes to the moved file, with the lines it summarises
    moved = lines(tmp_path / "audit.jsonl.1")
    assert [r["event"] for r in moved] == ["request", "suppressed"] and moved[1]["count"] == 3
    for _ in range(3):
        log.record(**refusal())
    log.close()  # shutdown (the window is still open: all three were over budget)
    assert [r.get("count") for r in lines(path)] == [3]
    assert verify_chain([str(tmp_path / "audit.jsonl.1"), str(path)]).ok


def test_aggregation_off_writes_every_refusal(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path))
    log.configure(refusals_per_second=0)
    for _ in range(200):
        log.record(**refusal())
    assert len(lines(path)) == 200


class FailingStream:
    """A stream whose writes fail with ENOSPC while `full`."""

    def __init__(self, inner):
        self.inner, self.full = inner, False

    def write(self, data):
        if self.full:
            raise OSError(28, "No space left on device")
        return self.inner.write(data)

    def fileno(self):
        return self.inner.fileno()

    def close(self):
        self.inner.close()


def test_a_failed_write_is_visible_until_a_write_succeeds_and_the_outage_is_recorded(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), chain=True)
    log.record(**allow())
    stream = log._stream = FailingStream(log._stream)
    stream.full = True
    for _ in range(3):
        try:
            log.record(**allow())
        except OSError:
            pass
        else:
            raise AssertionError("a write to a full disk must raise (the decision fails closed)")
    assert not log.writable and log.write_failures == 3
    log.maintain()  # still full: still failing
    assert not log.writable and log.write_failures == 4
    stream.full = False
    log.maintain()  # a quiet gateway notices by itself
    assert log.writable
    records = lines(path)
    assert records[-1]["event"] == "audit_log" and records[-1]["failed_writes"] == 4
    assert verify_chain([str(path)]).ok


# --- cycling source addresses (review of issue 15) ------------------------------------------------


def test_with_a_sandboxes_section_every_uncovered_client_shares_one_source():
    """As the rate limiter keys them: 400 addresses no sandbox covers are one source, one burst."""
    assert source_of({"client": "10.0.0.1:5"}, sandboxed=True) == source_of({"client": "10.9.9.9:5"}, True)
    assert source_of({"sandbox": "ci", "client": "10.0.0.1:5"}, sandboxed=True) == "sandbox:ci"
    clock = Clock()
    agg = RefusalAggregator(per_source=5, per_key=5, burst_seconds=1, clock=clock)
    written = sum(agg.admit(refusal(client=f"10.0.{i}.1:1"), sandboxed=True) for i in range(400))
    assert written == 5
    clock.now += 1.0
    [summary] = agg.due()
    assert summary["count"] == 395 and summary["client"] is None and summary["sandbox"] is None
    assert "clients no sandbox covers" in summary["message"]


def test_a_gateway_wide_budget_bounds_every_source_together():
    """Without a sandboxes section each address is its own source; the total budget still bounds
    the verbatim lines, and the rest are summarised under the overflow source."""
    clock = Clock()
    agg = RefusalAggregator(per_source=5, per_key=5, total=20, burst_seconds=1, clock=clock)
    written = sum(agg.admit(refusal(client=f"10.0.{i % 250}.{i // 250}:1")) for i in range(400))
    assert written == 20
    clock.now += 1.0
    summaries = agg.due()
    assert sum(s["count"] for s in summaries) == 380 and len(summaries) == 1
    assert summaries[0]["client"] is None and "gateway-wide" in summaries[0]["message"]


def test_a_flood_of_cycling_addresses_writes_the_total_rate(tmp_path):
    path = tmp_path / "audit.jsonl"
    clock = Clock()
    log = AuditLog(str(path), chain=True)
    log.configure(refusals_per_second=50, refusals_per_key=10, refusals_total=100)
    log.refusals.clock = clock
    log.refusals.configure(50, 10, 100)  # the bucket on the test's clock
    for i in range(10_200):  # 680 refusals a second for 15 s, from 400 addresses
        clock.now += 15 / 10_200
        log.record(event="request", client=f"10.1.{i % 400 // 250}.{i % 250}:1", sandbox=None,
                   decision="deny", reason="no_rule", status=403, host="evil.test")
    log.close()
    written = [line for line in lines(path) if line["event"] == "request"]
    summaries = [line for line in lines(path) if line["event"] == "suppressed"]
    assert len(written) <= 100 * 4 + 100 * 15 + 1
    assert len(written) + sum(s["count"] for s in summaries) == 10_200
    assert len(summaries) <= 2 * 16
    assert verify_chain([str(path)]).ok
