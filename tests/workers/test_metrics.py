"""`--metrics` with `--workers N`: every worker serves the metrics port, and every scrape, whichever
worker answers it, reports the numbers of all workers merged (Prometheus multiprocess mode)."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from . import procs
from .harness import by_worker, http_get_raw, make_gateway, open_conn, probe_http, probe_until_every_worker

SETTLE = 10.0


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def total(samples: dict, name: str, **labels) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def duplicate_series(text: str) -> list[str]:
    keys = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]
    return [key for key, n in Counter(keys).items() if n > 1]


def get(gateway, path: str) -> tuple[int, object]:
    """GET path on the metrics port over a fresh connection: (pid that answered, Response)."""
    conn, pid = open_conn(gateway, gateway.metrics_port)
    with conn:
        return pid, http_get_raw(conn, path)


def scrape(gateway) -> tuple[int, dict, str]:
    pid, response = get(gateway, "/metrics")
    assert response.status == 200, response.text[:500]
    return pid, parse(response.text), response.text


def scrape_every_worker(gateway, at_least: int = 2, max_scrapes: int = 200) -> list[tuple[int, dict, str]]:
    pids = gateway.serving_pids()
    scrapes: list[tuple[int, dict, str]] = []
    while not all(sum(s[0] == p for s in scrapes) >= at_least for p in pids):
        assert len(scrapes) < max_scrapes, f"scrapes never reached every worker {pids}"
        scrapes.append(scrape(gateway))
    return scrapes


def total_reaches(gateway, expected: float, name: str, **labels) -> dict:
    """The arguments of `procs.wait_for(**...)`: until a scrape's total of `name` (with `labels`) is
    `expected`; a failure names the last scrapes (pid, value)."""
    last = []

    def settled():
        pid, samples, _ = scrape(gateway)
        last.append((pid, total(samples, name, **labels)))
        return last[-1][1] == expected

    return dict(predicate=settled, timeout=SETTLE, what=f"{name}{labels} to reach {expected}", interval=0.1,
                detail=lambda: f"last scrapes (pid, value) {last[-6:]}")


@pytest.fixture(scope="module")
def metered(tmp_path_factory, upstreams, pki, slow_upstream):
    """Two workers with --metrics, shared by this module's tests in order (the last one kills a worker)."""
    gateway = make_gateway(tmp_path_factory.mktemp("metered"), upstreams, pki, workers=2, metrics=True)
    gateway.start()
    yield gateway
    gateway.stop()


def allow_total(samples) -> float:
    return total(samples, "egress_requests_total", decision="allow")


def agreed_total(gateway, name: str, **labels) -> float:
    """The value every worker's scrape reports (asserting they agree): the baseline of a test."""
    values = {pid: total(samples, name, **labels) for pid, samples, _ in scrape_every_worker(gateway, at_least=1)}
    assert len(set(values.values())) == 1, f"workers disagree on {name}{labels}: {values}"
    return next(iter(values.values()))


def test_every_worker_serves_metrics_and_health(metered):
    gateway = metered
    pids = gateway.serving_pids()
    assert sorted(procs.listeners(pids, gateway.metrics_port)) == sorted(pids), "not every worker listens on --metrics"
    for path in ("/healthz", "/readyz"):
        answers: dict[int, list[int]] = {}
        while set(answers) != set(pids):
            assert sum(map(len, answers.values())) < 100, f"{path} never reached every worker"
            pid, response = get(gateway, path)
            answers.setdefault(pid, []).append(response.status)
        assert all(set(v) == {200} for v in answers.values()), f"{path}: {answers}"


def test_every_scrape_counts_the_requests_of_all_workers(metered):
    gateway = metered
    base_allow = agreed_total(gateway, "egress_requests_total", decision="allow")
    base_deny = agreed_total(gateway, "egress_requests_total", decision="deny", reason="no_rule")
    allowed = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/m"), at_least=3)
    denied = probe_until_every_worker(gateway, lambda: probe_http(gateway, "other.test", "/m"), at_least=2)
    assert {r.status for r in allowed} == {200} and {r.status for r in denied} == {403}
    k, d = base_allow + len(allowed), base_deny + len(denied)
    assert all(len(v) >= 3 for v in by_worker(allowed).values())

    procs.wait_for(**total_reaches(gateway, k, "egress_requests_total", decision="allow"))
    for pid, samples, text in scrape_every_worker(gateway):
        assert allow_total(samples) == k, (
            f"scrape answered by worker {pid}: allow={allow_total(samples)}, expected {k} "
            f"({dict(Counter(r.worker for r in allowed))} requests per worker)")
        assert total(samples, "egress_requests_total", decision="deny", reason="no_rule") == d, (
            f"scrape answered by worker {pid}: deny={total(samples, 'egress_requests_total', decision='deny')}, "
            f"expected {d}")
        assert not duplicate_series(text), f"worker {pid}: duplicate series {duplicate_series(text)[:10]}"


def _open_tunnels(gateway, per_worker: int) -> list[tuple[object, int]]:
    """Idle CONNECT tunnels (answered 200, kept open): at least `per_worker` on every worker."""
    pids = gateway.serving_pids()
    tunnels = []
    while not all(sum(t[1] == p for t in tunnels) >= per_worker for p in pids):
        assert len(tunnels) < 100, f"tunnels never reached every worker {pids}"
        conn, pid = open_conn(gateway)
        conn.send(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
        answer = conn.read_response(head_only=True)
        assert answer.status == 200, answer
        tunnels.append((conn, pid))
    return tunnels


def test_live_gauges_sum_the_live_workers_and_counters_keep_a_dead_workers_counts(metered):
    """egress_active_connections sums the workers alive now; a killed worker's connections stop
    counting. Counters are totals over the gateway's life: a restarted worker's earlier requests
    still count (a merged counter that dropped them would go backwards for Prometheus)."""
    gateway = metered
    procs.wait_for(**total_reaches(gateway, 0, "egress_active_connections"))
    allowed_before = agreed_total(gateway, "egress_requests_total", decision="allow")
    tunnels = _open_tunnels(gateway, per_worker=2)
    try:
        m = len(tunnels)
        procs.wait_for(**total_reaches(gateway, m, "egress_active_connections"))
        for pid, samples, _ in scrape_every_worker(gateway, at_least=1):
            assert total(samples, "egress_active_connections") == m, f"worker {pid}: {samples}"

        victim = tunnels[0][1]
        held = sum(1 for _, pid in tunnels if pid == victim)
        victim_id = procs.identity(victim)
        os.kill(victim, signal.SIGKILL)
        procs.wait_for(lambda: procs.gone(victim_id), 5, what="the killed worker to exit")
        gateway.wait_serving(2, 15)
        procs.wait_for(**total_reaches(gateway, m - held, "egress_active_connections"))
        for pid, samples, _ in scrape_every_worker(gateway, at_least=1):
            assert total(samples, "egress_active_connections") == m - held, (
                f"after killing worker {victim} (it held {held} of {m} connections), worker {pid} reports "
                f"{total(samples, 'egress_active_connections')}")
            assert allow_total(samples) == allowed_before, (
                f"worker {pid}: allow={allow_total(samples)} after worker {victim} died, {allowed_before} before: "
                "the dead worker's requests no longer count")
    finally:
        for conn, _ in tunnels:
            conn.close()
    procs.wait_for(**total_reaches(gateway, 0, "egress_active_connections"))
    more = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/k2"))
    procs.wait_for(**total_reaches(gateway, allowed_before + len(more), "egress_requests_total", decision="allow"))
