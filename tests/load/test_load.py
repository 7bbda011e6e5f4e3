"""Load: 1,000 concurrent client connections against one gateway, for a sustained period.

One gateway process (`egress_max_connections_per_sandbox=2000` and the per-sandbox rates off: every
client here comes from 127.0.0.1, one "sandbox" for the limiters) takes, at the same time:

(a) 1,000 kept-alive tunnels: CONNECT load.test:443, TLS inside (the gateway's CA verified), then a
    request every EGRESS_LOAD_INTERVAL seconds (default 15, jittered) on each, for the hold phase
    (EGRESS_LOAD_SECONDS, default 20). One request in 20 asks for a path the policy refuses (403
    path_not_allowed on the same kept-alive connection, provoked);
(b) a stream of new connections during the same hold phase (EGRESS_LOAD_NEW_RATE per second,
    default 5): CONNECT + TLS + one request + close; one in four is a CONNECT to other.test, which
    no rule allows (403 no_rule, provoked).

The run (module fixture `load_run`, once) goes: start the gateway, warm up (a few tunnels: the
leaf certificate is minted, code paths are warm), idle RSS, ramp up the 1,000 tunnels (24 set-ups
at a time, as fast as the gateway takes them), hold, close everything, wait until the gateway has
closed every socket, RSS after, then stop the gateway (SIGTERM, exit 0). The tests below assert
on what was recorded; the summary table is printed (`pytest -s`) and, with EGRESS_LOAD_REPORT=PATH,
written there as markdown too.

`test_connection_limit_refuses_n_plus_1_under_load` is separate: its own gateway with a limit of 50.

Safety: loopback only (127.0.0.1 and the session's 127.X.0.0/24 block), a fixed number of
clients, every network operation under a time-out, every phase bounded, the processes stopped
at the end (the load upstream also stops by itself after 30 minutes or when its parent dies).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from tests.load.conftest import (LOAD_HOST, Sampler, healthz, load_seconds, metric, metrics_text, read_proc,
                                 start_load_gateway)
from tests.load.loadgen import (LoadConfig, LoadStats, close_all, deny_connects, keep_busy, open_tunnels,
                                percentile, refused_at_once, run_load)
from tests.support.gateway import free_port
from tests.support.waiting import value_when

HOLD_SECONDS = load_seconds()
CONNECTIONS = int(os.environ.get("EGRESS_LOAD_CONNECTIONS", "1000"))
INTERVAL = float(os.environ.get("EGRESS_LOAD_INTERVAL", "15"))
NEW_RATE = float(os.environ.get("EGRESS_LOAD_NEW_RATE", "5"))
LIMIT_FOR_LOAD = 2000
# Every client here is 127.0.0.1, standing for a thousand sandboxes: the per-sandbox rates
# (addons/rate_limits.py; tested in tests/e2e/test_rate_limits.py) would refuse the ramp-up.
RATES_OFF = ["--set", "egress_max_new_connections_per_second_per_sandbox=0",
             "--set", "egress_max_requests_per_second_per_sandbox=0"]
WARMUP_TUNNELS = 5
MAX_KIB_PER_CONNECTION = 200       # (peak - idle) / connections
RETURNED_FRACTION = 0.5            # after closing, RSS must give back at least half of the growth
HOLD_GROWTH_FRACTION = 0.5         # RSS growth during the hold <= half of what the churned connections cost fresh,
HOLD_GROWTH_FLOOR = 0.25           # or a quarter of the RSS at the start of the hold, whichever is larger
SUSPICIOUS = re.compile(r"traceback|error|exception|crash|fail", re.IGNORECASE)

pytestmark = [pytest.mark.load, pytest.mark.e2e, pytest.mark.timeout(240 + 2 * HOLD_SECONDS)]


@dataclass
class LoadRun:
    cfg: LoadConfig
    stats: LoadStats
    sampler: Sampler
    rss_idle: int = 0              # KiB
    rss_peak: int = 0
    rss_after: int = 0
    rss_hold_start: int = 0
    rss_hold_end: int = 0
    hwm: int = 0
    peak_connections: int = 0
    cpu_hold: float = 0.0
    cpu_ramp: float = 0.0
    fds_idle: int = 0
    fds_peak: int = 0
    fds_after: int = 0
    health: list = field(default_factory=list)          # /healthz status during the run
    active: dict = field(default_factory=dict)          # egress_active_connections by phase
    metrics_end: str = ""
    upstream_before: dict = field(default_factory=dict)
    upstream_after: dict = field(default_factory=dict)
    forbidden_untouched: bool = False
    recording_touched: list = field(default_factory=list)
    audit: list = field(default_factory=list)
    log_lines: list = field(default_factory=list)
    log_suspicious: list = field(default_factory=list)
    exit_code: int | None = None
    timings: dict = field(default_factory=dict)
    summary: str = ""

    @property
    def growth_kib(self) -> int:
        return self.rss_peak - self.rss_idle

    @property
    def kib_per_connection(self) -> float:
        return self.growth_kib / max(1, self.peak_connections)

    @property
    def hold_growth_kib(self) -> int:
        return self.rss_hold_end - self.rss_hold_start

    @property
    def hold_growth_bound_kib(self) -> float:
        """A leak of the churned connections would add their whole fresh cost during the hold. The
        floor: Python's cyclic GC defers a full collection until the objects that survived the
        young generations reach 25% of the long-lived ones, so garbage worth about a quarter of the
        heap may lie uncollected at any moment without any leak. With the default 20 s hold this
        check only catches gross leaks (e.g. per request); with EGRESS_LOAD_SECONDS=120 the churned
        connections alone would cost more than the floor."""
        return max(HOLD_GROWTH_FLOOR * self.rss_hold_start,
                   HOLD_GROWTH_FRACTION * self.stats.new_allowed_done * self.kib_per_connection)



def decisions(audit: list[dict]) -> Counter:
    """(event, decision, reason) -> how many: a line each, plus what `suppressed` lines count."""
    out: Counter = Counter()
    for a in audit:
        if a["event"] == "suppressed":
            out[a["suppressed_event"], a["decision"], a["reason"]] += a["count"]
        else:
            out[a["event"], a["decision"], a["reason"]] += 1
    return out

def _wait_active(url: str, at_most: float, timeout: float = 15.0) -> float:
    """egress_active_connections once it is <= at_most (or its value after `timeout` s)."""
    return value_when(lambda: metric(metrics_text(url), "egress_active_connections"), lambda value: value <= at_most,
                      timeout, interval=0.2)


def _wait_fds(pid: int, at_most: int, timeout: float = 30.0) -> int:
    """The gateway's open descriptors once they are <= at_most: closing a client connection is
    seen at once by the connection gauge, the upstream side closes a moment later."""
    return value_when(lambda: read_proc(pid)[3], lambda fds: fds <= at_most, timeout, interval=0.1)


@pytest.fixture(scope="module")
def load_run(tmp_path_factory, upstreams, pki, load_upstream) -> LoadRun:
    started = time.monotonic()
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    upstreams.reset()
    gateway = start_load_gateway(
        tmp_path_factory.mktemp("load"), upstreams, pki, load_upstream,
        ["--set", f"egress_max_connections_per_sandbox={LIMIT_FOR_LOAD}", "--metrics", f"127.0.0.1:{metrics_port}",
         *RATES_OFF])
    cfg = LoadConfig("127.0.0.1", gateway.port, str(gateway.ca_cert), LOAD_HOST, "other.test",
                     connections=CONNECTIONS, hold_seconds=HOLD_SECONDS, request_interval=INTERVAL,
                     new_rate=NEW_RATE)
    stats = LoadStats()
    sampler = Sampler(gateway.process.pid).start()
    run = LoadRun(cfg, stats, sampler)
    try:
        run.upstream_before = load_upstream.stats()

        async def warm_up():
            await close_all(await open_tunnels(cfg, stats, WARMUP_TUNNELS, "warmup"))
            await deny_connects(cfg, stats, 1)

        asyncio.run(warm_up())
        _wait_active(metrics_url, 0)
        run.rss_idle = sampler.settled_rss(seconds=0.75)
        run.fds_idle = read_proc(gateway.process.pid)[3]
        run.timings["start+warm-up"] = time.monotonic() - started

        async def on_phase(name: str) -> None:
            if name in ("ramped", "held"):
                text = await asyncio.to_thread(metrics_text, metrics_url)
                run.active[name] = metric(text, "egress_active_connections")
                run.health.append((name, await asyncio.to_thread(healthz, metrics_url)))
            if name == "held":
                run.peak_connections = stats.keepalive_open

        asyncio.run(run_load(cfg, stats, on_phase))
        phases = stats.phases
        ramp = sampler.between(phases["ramp_start"], phases["ramped"])
        hold = sampler.between(phases["hold_start"], phases["held"])
        run.cpu_ramp = ramp[-1][3] - ramp[0][3] if len(ramp) > 1 else 0.0
        run.cpu_hold = hold[-1][3] - hold[0][3] if len(hold) > 1 else 0.0
        run.rss_hold_start, run.rss_hold_end = hold[0][1], hold[-1][1]
        during = sampler.between(phases["ramp_start"], phases["closed"])
        run.rss_peak = max(s[1] for s in during)
        run.fds_peak = max(s[4] for s in during)
        run.active["closed"] = _wait_active(metrics_url, 0)
        run.fds_after = _wait_fds(gateway.process.pid, run.fds_idle)
        # not synchronisation: a measurement; the gateway collects and trims ~1 s after its last
        # connection closes, and RSS may stand still before that
        time.sleep(4)
        run.rss_after = sampler.settled_rss(seconds=0.75)

        run.metrics_end = metrics_text(metrics_url)
        run.health.append(("end", healthz(metrics_url)))
        run.upstream_after = load_upstream.wait_stats(
            lambda s: s["requests"] - run.upstream_before["requests"] >= stats.requests_ok and s["open"] == 0)
        run.hwm = sampler.samples[-1][2]
    finally:
        sampler.stop()
        run.exit_code = gateway.stop()
    run.forbidden_untouched = upstreams.untouched("other.test")
    run.recording_touched = [s.name for s in upstreams.all() if s.touched]
    run.audit = gateway.audit()
    log = gateway.log().splitlines()
    run.log_lines = log
    run.log_suspicious = [line for line in log if SUSPICIOUS.search(line)]
    run.timings["total"] = time.monotonic() - started
    run.summary = summary(run)
    print("\n" + run.summary)
    report = os.environ.get("EGRESS_LOAD_REPORT")
    if report:
        with open(report, "w") as f:
            f.write(run.summary + "\n")
    return run


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def summary(run: LoadRun) -> str:
    s, cfg, ph = run.stats, run.cfg, run.stats.phases
    hold_time = ph["held"] - ph["hold_start"]
    ramp_time = ph["ramped"] - ph["ramp_start"]
    hold_requests = len(s.hold_request_latencies)
    events: Counter = Counter()
    for (event, decision, _), count in decisions(run.audit).items():
        events[event, decision] += count
    up = {k: run.upstream_after.get(k, 0) - run.upstream_before.get(k, 0) for k in ("connections", "requests", "errors")}
    load_avg = open("/proc/loadavg").read().split()[:3]
    rows = [
        ("kept-alive tunnels (a), open at once", f"{run.peak_connections} (gateway gauge: {run.active.get('held', 0):.0f})"),
        ("ramp-up: CONNECT+TLS+first request", f"{ramp_time:.1f} s ({cfg.connections / ramp_time:.0f} tunnels/s, gateway CPU {run.cpu_ramp:.1f} s)"),
        ("hold phase", f"{hold_time:.1f} s, one request per tunnel every ~{cfg.request_interval:g} s"),
        ("new connections (b) during hold", f"{s.new_started} at {cfg.new_rate:g}/s, 1 in {cfg.deny_connect_every} denied CONNECT"),
        ("requests, all phases", f"{s.requests_sent} ({s.requests_ok} 200, {s.requests_denied} provoked 403 path_not_allowed)"),
        ("requests during hold, req/s", f"{hold_requests} / {hold_time:.1f} s = {hold_requests / hold_time:.1f} req/s"),
        ("CONNECTs, all phases", f"{s.connects_sent} ({s.connects_allowed} 200, {s.connects_denied} provoked 403 no_rule)"),
        ("request latency during hold p50 / p99", f"{_ms(percentile(s.hold_request_latencies, 50))} / {_ms(percentile(s.hold_request_latencies, 99))}"),
        ("request latency, all (incl. ramp) p50 / p99", f"{_ms(percentile(s.request_latencies, 50))} / {_ms(percentile(s.request_latencies, 99))}"),
        ("new connection CONNECT+TLS p50 / p99", f"{_ms(percentile(s.setup_latencies, 50))} / {_ms(percentile(s.setup_latencies, 99))}"),
        ("gateway CPU during hold", f"{run.cpu_hold:.1f} s of {hold_time:.1f} s ({100 * run.cpu_hold / hold_time:.0f}% of one core)"),
        ("client errors (resets, early closes, time-outs, unexpected statuses)", f"{s.error_count} {dict(s.errors) or ''}"),
        ("5xx responses", str(sum(v for (_, st, _), v in s.statuses.items() if st >= 500))),
        ("gateway log: lines / error-like lines", f"{len(run.log_lines)} / {len(run.log_suspicious)}"),
        ("gateway exit status after SIGTERM", str(run.exit_code)),
        ("RSS idle (after warm-up)", _mib(run.rss_idle)),
        ("RSS peak (1,000 tunnels open)", f"{_mib(run.rss_peak)} (VmHWM {_mib(run.hwm)})"),
        ("RSS per connection (peak - idle) / connections", f"{run.kib_per_connection:.1f} KiB (bound {MAX_KIB_PER_CONNECTION} KiB)"),
        ("RSS after all closed", f"{_mib(run.rss_after)} (+{_mib(run.rss_after - run.rss_idle)} over idle, "
                                 f"{100 * (run.rss_after - run.rss_idle) / max(1, run.growth_kib):.0f}% of the growth kept)"),
        ("RSS growth during the hold", f"{_mib(run.rss_hold_start)} -> {_mib(run.rss_hold_end)} "
                                       f"({run.hold_growth_kib / 1024:+.1f} MiB; {s.new_allowed_done} connections churned, "
                                       f"bound {run.hold_growth_bound_kib / 1024:.1f} MiB)"),
        ("gateway open fds: idle / peak / after close", f"{run.fds_idle} / {run.fds_peak} / {run.fds_after}"),
        ("audit connect lines vs CONNECTs sent", f"{events['connect', 'allow'] + events['connect', 'deny']} vs {s.connects_sent}"),
        ("audit request lines vs requests sent", f"{events['request', 'allow'] + events['request', 'deny']} vs {s.requests_sent}"),
        ("other audit events", str({f'{k[0]}/{k[1]}': v for k, v in events.items() if k[0] not in ('connect', 'request')} or "none")),
        ("load upstream: connections / requests / errors", f"{up['connections']} / {up['requests']} / {up['errors']}"),
        ("forbidden upstream (other.test) touched", "no" if run.forbidden_untouched else "YES"),
        ("wall time of the run", f"{run.timings['total']:.1f} s; load average {' '.join(load_avg)}"),
    ]
    lines = ["| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def test_no_errors_under_load(load_run):
    s = load_run.stats
    assert s.keepalive_established == load_run.cfg.connections, s.error_samples
    assert load_run.peak_connections == load_run.cfg.connections
    assert load_run.active["held"] >= load_run.cfg.connections  # the gateway saw them all open at once
    assert s.error_count == 0, f"{dict(s.errors)}: {s.error_samples[:10]}"
    fives = {k: v for k, v in s.statuses.items() if k[1] >= 500}
    assert not fives, fives
    expected = {("CONNECT", 200, None), ("CONNECT", 403, "no_rule"), ("GET", 200, None), ("GET", 403, "path_not_allowed")}
    assert set(s.statuses) <= expected, s.statuses
    assert s.new_done == s.new_started == int(load_run.cfg.hold_seconds * load_run.cfg.new_rate)
    assert s.requests_ok + s.requests_denied == s.requests_sent
    assert all(status == 200 for _, status in load_run.health), load_run.health  # event loop never stalled 10 s
    assert not load_run.log_suspicious, "\n".join(load_run.log_suspicious[:20])
    assert metric(load_run.metrics_end, "egress_upstream_failures_total") == 0
    assert load_run.exit_code == 0


def test_memory_per_connection_is_bounded(load_run):
    assert load_run.kib_per_connection < MAX_KIB_PER_CONNECTION, load_run.summary


def test_memory_flat_while_connections_churn(load_run):
    """During the hold, new connections come and go next to the 1,000 kept-alive ones: the RSS must
    not grow by what those connections cost (it would, were they leaked)."""
    assert load_run.hold_growth_kib <= load_run.hold_growth_bound_kib, load_run.summary


def test_every_connection_and_socket_released_after_close(load_run):
    assert load_run.active["closed"] == 0  # the gateway forgot every client connection
    assert load_run.fds_after <= load_run.fds_idle  # and closed every socket, client and upstream side


def test_rss_returns_toward_baseline_after_close(load_run):
    """After every connection closed (and every socket: see the test above), the RSS gives back at
    least half of what the load added.

    Fails on this gateway as of this writing: all of the growth stays resident. Not a leak (the
    tests above hold, and so do repeated rounds); see docs/load.md, "Memory after the load"."""
    kept = load_run.rss_after - load_run.rss_idle
    assert kept <= RETURNED_FRACTION * load_run.growth_kib, (
        f"RSS after closing every connection is {load_run.rss_after / 1024:.1f} MiB, idle was "
        f"{load_run.rss_idle / 1024:.1f} MiB and the peak {load_run.rss_peak / 1024:.1f} MiB: "
        f"{100 * kept / max(1, load_run.growth_kib):.0f}% of the growth is still resident "
        "(not a leak: closed connections are left to the cyclic GC, which an idle gateway does not run, and "
        "glibc keeps freed memory; see docs/load.md, 'Memory after the load')")


def test_audit_lines_equal_decisions(load_run):
    s = load_run.stats
    events = decisions(load_run.audit)
    connect_lines = sum(v for k, v in events.items() if k[0] == "connect")
    request_lines = sum(v for k, v in events.items() if k[0] == "request")
    # one line per decision (refusals past the audit budget counted in `suppressed` lines instead)
    assert (connect_lines, request_lines) == (s.connects_sent, s.requests_sent)
    # ... and each line says what the client was told
    assert events["connect", "allow", "allowed"] == s.connects_allowed
    assert events["connect", "deny", "no_rule"] == s.connects_denied
    assert events["request", "allow", "allowed"] == s.requests_ok
    assert events["request", "deny", "path_not_allowed"] == s.requests_denied
    others = {k: v for k, v in events.items() if k[0] not in ("connect", "request")}
    assert not others, others  # no refused connections (too_many_connections), no upstream errors
    assert metric(load_run.metrics_end, "egress_requests_total") == s.requests_sent
    assert metric(load_run.metrics_end, "egress_connections_total") == s.connects_sent


def test_forbidden_upstream_untouched_and_allowed_one_sees_exactly_the_allowed(load_run):
    s = load_run.stats
    assert load_run.forbidden_untouched
    assert not load_run.recording_touched, load_run.recording_touched
    up = {k: load_run.upstream_after[k] - load_run.upstream_before[k] for k in ("connections", "requests", "errors", "wrong_host")}
    assert up["requests"] == s.requests_ok  # the refused paths never went upstream
    assert up["connections"] == s.connects_allowed  # one upstream connection per allowed tunnel, lazily
    assert up["errors"] == up["wrong_host"] == 0, load_run.upstream_after.get("error_samples")


# --------------------------------------------------------------------------------------------


LIMIT = 50


def test_connection_limit_refuses_n_plus_1_under_load(tmp_path, upstreams, pki, load_upstream):
    """With egress_max_connections_per_sandbox=50 and 50 busy tunnels, connection 51 is closed at
    once (one audit line, too_many_connections) while the 50 keep working; closing 5 frees exactly
    5 slots."""
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    upstreams.reset()
    gateway = start_load_gateway(tmp_path, upstreams, pki, load_upstream,
                                 ["--set", f"egress_max_connections_per_sandbox={LIMIT}",
                                  "--metrics", f"127.0.0.1:{metrics_port}", *RATES_OFF])
    try:
        assert _wait_active(metrics_url, 0) == 0  # the start-up probe's connection is gone
        cfg = LoadConfig("127.0.0.1", gateway.port, str(gateway.ca_cert), LOAD_HOST, "other.test")
        stats = LoadStats()

        async def scenario() -> dict:
            result = {}
            tunnels = await open_tunnels(cfg, stats, LIMIT, "held", concurrency=10)
            result["opened"] = len(tunnels)
            stops = [asyncio.Event() for _ in tunnels]
            busy = [asyncio.create_task(keep_busy(t, 0.5, stop, f"busy{i}")) for i, (t, stop) in enumerate(zip(tunnels, stops))]
            await asyncio.sleep(0.5)  # not synchronisation: the load's shape, the held tunnels busy a while
            result["extra"] = [await refused_at_once(cfg) for _ in range(10)]  # connections 51..60, one by one
            # give back 5 slots, then exactly 5 new tunnels fit, and the one after them does not
            for stop in stops[:5]:
                stop.set()
            await asyncio.gather(*busy[:5])
            await close_all(tunnels[:5])
            result["active_after_close"] = await asyncio.to_thread(_wait_active, metrics_url, LIMIT - 5)
            more = await open_tunnels(cfg, stats, 5, "more", concurrency=5)
            result["more"] = len(more)
            result["one_more"] = await refused_at_once(cfg)
            await asyncio.sleep(0.5)  # not synchronisation: the load's shape, all tunnels busy a while
            for stop in stops:
                stop.set()
            await asyncio.gather(*busy)
            await close_all(tunnels[5:] + more)
            return result

        result = asyncio.run(scenario())
    finally:
        gateway.stop()
    print(f"\nlimit {LIMIT}: {result['opened']} busy tunnels; connections {LIMIT + 1}..{LIMIT + 10}: "
          f"{Counter(result['extra'])}; 5 closed, then {result['more']} new accepted and the next "
          f"{result['one_more']}; {stats.requests_sent} requests meanwhile, {stats.error_count} errors")
    assert result["opened"] == LIMIT, stats.error_samples
    assert result["extra"] == ["closed"] * 10
    assert result["active_after_close"] <= LIMIT - 5
    assert result["more"] == 5, stats.error_samples
    assert result["one_more"] == "closed"
    assert stats.error_count == 0, stats.error_samples  # the busy tunnels never noticed
    assert stats.requests_ok == stats.requests_sent > LIMIT + 5 + LIMIT  # they were busy meanwhile
    refused = [a for a in gateway.audit() if a["reason"] == "too_many_connections"]
    assert len(refused) == 11
    assert all(a["event"] == "connection" and a["decision"] == "deny" for a in refused)
    assert all(f"(limit {LIMIT})" in a["message"] for a in refused)
    assert upstreams.untouched("other.test")
