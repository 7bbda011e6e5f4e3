"""`egress-gateway run --workers N`: a supervisor, N worker processes on one port (SO_REUSEPORT), one
CA and one policy; restarts, signals, shutdown. Each test makes sure it reached every worker: the
worker that accepted a connection is read from /proc (see procs.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import threading
import time

import httpx
import pytest

from tests.e2e.helpers import Conn, assert_untouched, curl
from tests.support.gateway import free_port

from . import procs
from .harness import (
    BASE_RULES, RELOADED_RULES, TIMEOUT, Probe, egress_cli, log_tail, make_gateway, open_conn, probe_http,
    probe_https, probe_until_every_worker, write_policy,
)

RESTART_WITHIN = 10.0  # "within a few seconds", generously
CONVERGE_WITHIN = 15.0


@pytest.fixture(scope="module")
def three(tmp_path_factory, upstreams, pki, slow_upstream):
    """Three workers with the base policy, shared by the read-only tests of this module."""
    gateway = make_gateway(tmp_path_factory.mktemp("three"), upstreams, pki, workers=3)
    gateway.start()
    yield gateway
    gateway.stop()


@pytest.fixture(autouse=True)
def _fresh(upstreams, slow_upstream):
    upstreams.reset()
    slow_upstream.reset()
    yield


# --- start-up ---------------------------------------------------------------------------------------


def test_three_workers_are_children_listening_on_one_port(three, upstreams):
    pids = three.worker_pids()
    assert len(set(pids)) == 3, f"listening descendants of the supervisor: {pids}"
    direct = procs.children(three.pid)
    assert set(pids) <= set(direct), f"workers {pids} are not all direct children of {three.pid} ({direct})"
    ca_before = three.ca_digest()

    results = probe_until_every_worker(three, lambda: probe_https(three, "allowed.test", "/spread"), at_least=2)
    bad = [r for r in results if r.status != 200 or b"upstream allowed.test" not in r.body]
    assert not bad, f"some workers did not serve: {bad}"
    assert len(upstreams.tls["allowed.test"].requests) == len(results)
    # Every TLS handshake above was verified against the one CA file: one CA for all workers.
    assert three.ca_digest() == ca_before, "the CA file changed while the workers ran"
    assert list(three.confdir.glob("mitmproxy-ca*.pem")), "no CA in the one confdir"


def test_curl_and_httpx_through_the_workers(three, upstreams):
    mark = len(three.audit_entries())
    for i in range(8):
        result = curl(three, f"https://allowed.test/curl/{i}")
        assert result.status == 200, (result.status, result.stderr)
        result = curl(three, f"http://allowed.test/curl-plain/{i}")
        assert result.status == 200, (result.status, result.stderr)
    context = ssl.create_default_context(cafile=str(three.ca_cert))
    for i in range(8):
        response = httpx.get(f"https://allowed.test/httpx/{i}", proxy=three.proxy_url, verify=context, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        assert response.headers["x-upstream"] == "allowed.test"
    assert len(upstreams.tls["allowed.test"].requests) == 16
    assert len(upstreams.plain["allowed.test"].requests) == 8
    lines = procs.wait_for(
        lambda: (found := [e for e in three.audit_entries()[mark:] if e["event"] == "request"]) and len(found) >= 24
        and found, 10, what="24 request audit lines")
    assert len(lines) == 24 and all(e["decision"] == "allow" for e in lines), lines


def test_denials_happen_before_any_upstream_byte_on_every_worker(three, upstreams):
    refused_connect = probe_until_every_worker(three, lambda: probe_https(three, "other.test", "/x"))
    refused_plain = probe_until_every_worker(three, lambda: probe_http(three, "other.test", "/x"))
    restated = probe_until_every_worker(three, lambda: probe_https(three, "allowed.test", "/x", "other.test"))
    assert {(r.status, r.reason) for r in refused_connect} == {(403, "no_rule")}, refused_connect
    assert {(r.status, r.reason) for r in refused_plain} == {(403, "no_rule")}, refused_plain
    assert {(r.status, r.reason) for r in restated} == {(421, "host_mismatch")}, restated
    assert_untouched(upstreams, "other.test")
    # The CONNECTs to allowed.test made TLS connections to it but sent no request.
    assert upstreams.tls["allowed.test"].requests == []


def test_one_worker_means_one_process(worker_gateway):
    gateway = worker_gateway(workers=1)
    assert procs.listeners([gateway.pid], gateway.port) == [gateway.pid]
    assert gateway.worker_pids() == [], "with --workers 1 no other process listens"
    assert probe_http(gateway, "allowed.test", "/one").status == 200


def test_dns_mode_with_a_tcp_rule_naming_a_host_runs_one_worker(worker_gateway):
    """Such a rule allows a connection by what the gateway's DNS answered its client, and only the
    worker that runs DNS mode has those answers: with two, a connection the kernel gave the other
    was refused `no_rule` (review 37: 4 of 10 relayed). One worker, said on stderr."""
    rules = BASE_RULES + "- id: git\n  protocol: tcp\n  hosts: [allowed.test]\n  ports: [22]\n"
    gateway = worker_gateway(workers=2, rules=rules, args=["--mode", f"dns@127.0.0.1:{free_port()}"], expect=1)
    assert gateway.worker_pids() == [], "one process: DNS answers and the TCP decisions that use them"
    assert "running one worker, not 2" in gateway.log()
    assert probe_http(gateway, "allowed.test", "/one").status == 200


def test_the_default_comes_from_EGRESS_WORKERS(worker_gateway):
    gateway = worker_gateway(workers=None, env={"EGRESS_WORKERS": "2"}, expect=2)
    assert len(gateway.worker_pids()) == 2
    results = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/env"))
    assert {r.status for r in results} == {200}, results


def _usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("count", [1, 2])
def test_without_flag_or_variable_the_default_is_the_usable_cores(worker_gateway, count):
    """No --workers, no EGRESS_WORKERS: one process per CPU the gateway may run on (its affinity,
    set here with taskset; not the machine's core count)."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed")
    cpus = _usable_cpus()
    if len(cpus) < count:
        pytest.skip(f"needs {count} usable CPUs")
    cpu_list = ",".join(map(str, cpus[:count]))
    gateway = worker_gateway(workers=None, env={"EGRESS_WORKERS": None}, expect=0,
                             prefix=["taskset", "-c", cpu_list])
    itself, workers = gateway.settled_listeners()
    if count == 1:
        assert (itself, workers) == (True, []), f"one usable CPU: expected one process, got workers {workers}"
    else:
        assert len(workers) == count, f"{count} usable CPUs: expected {count} workers, got {workers}"


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_worker_count_below_one_is_refused(tmp_path, upstreams, value):
    policy = tmp_path / "policy.yaml"
    write_policy(policy, upstreams, "- id: web\n  hosts: [allowed.test]\n")
    port = free_port()
    result = egress_cli("run", "--policy", str(policy), "--mode", f"regular@127.0.0.1:{port}",
                        "--confdir", str(tmp_path / "confdir"), "--workers", value, timeout=30)
    assert result.returncode != 0, f"--workers {value} was accepted: {result.stdout} {result.stderr}"
    assert "workers" in (result.stderr + result.stdout).lower()


# --- a dead worker ------------------------------------------------------------------------------------


EXIT_WORDS = re.compile(r"exit|died|dead|killed|signal|SIGKILL|-9|terminated", re.IGNORECASE)


def test_a_killed_worker_is_restarted_while_the_others_keep_serving(worker_gateway, upstreams):
    gateway = worker_gateway(workers=2)
    pids = gateway.worker_pids()
    first = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/before"))
    assert {r.status for r in first} == {200}
    victim, survivor = pids
    victim_id, survivor_id = procs.identity(victim), procs.identity(survivor)
    log_mark = len(gateway.log())

    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    procs.wait_for(lambda: procs.gone(victim_id), 5, what=f"worker {victim} to die")

    # Requests while the victim is dead (and while its successor starts): every one succeeds.
    during: list[Probe] = []
    replacement = None
    deadline = killed_at + RESTART_WITHIN
    while replacement is None or len(during) < 5:
        probe = probe_http(gateway, "allowed.test", f"/during/{len(during)}")
        during.append(probe)
        assert probe.status == 200, f"request {len(during)} after the kill failed: {probe}\n{log_tail(gateway)}"
        current = [p for p in gateway.worker_pids() if p not in pids]
        if current and replacement is None:
            replacement = current[0]
            restarted_after = time.monotonic() - killed_at
        assert time.monotonic() < deadline or replacement is not None, (
            f"no replacement worker {RESTART_WITHIN:g}s after the kill; workers now {gateway.worker_pids()}")
    assert procs.running(survivor_id), "the surviving worker was restarted too"
    now = gateway.wait_serving(2, RESTART_WITHIN)
    assert sorted(now) == sorted([survivor, replacement]), now
    assert replacement in procs.children(gateway.pid), "the replacement is not a child of the supervisor"
    assert restarted_after < RESTART_WITHIN

    # The supervisor said which worker died and how.
    new_log = gateway.log()[log_mark:]
    lines = [line for line in new_log.splitlines()
             if "worker" in line.lower() and EXIT_WORDS.search(line)
             and (str(victim) in line or re.search(r"worker[ #=]*\d", line, re.IGNORECASE))]
    assert lines, f"no supervisor line names the dead worker {victim} and its exit:\n{new_log[-3000:]}"

    # The replacement serves, with the same policy, and writes to the same audit log.
    after = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/after"))
    assert {r.status for r in after} == {200}, after
    denied = probe_until_every_worker(gateway, lambda: probe_http(gateway, "other.test", "/after"))
    assert {(r.status, r.reason) for r in denied} == {(403, "no_rule")}, denied
    assert_untouched(upstreams, "other.test")
    replacement_clients = {r.client for r in after + denied if r.worker == replacement}
    procs.wait_for(lambda: replacement_clients <= {e["client"] for e in gateway.audit_entries()}, 5,
                   what="audit lines of the replacement worker's connections")


def test_a_worker_killed_right_after_serving_is_restarted_not_a_start_up_failure(worker_gateway):
    """A worker that has listened and served requests has started: if it is killed a moment later
    (OOM, an operator), it is restarted like any other; the gateway does not stop."""
    gateway = worker_gateway(workers=2)
    served = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/early"))
    assert {r.status for r in served} == {200}
    victim = gateway.worker_pids()[0]
    victim_id = procs.identity(victim)
    age = time.monotonic() - gateway.started_at
    os.kill(victim, signal.SIGKILL)
    procs.wait_for(lambda: procs.gone(victim_id), 5, what=f"worker {victim} to die")
    try:
        now = gateway.wait_serving(2, RESTART_WITHIN)  # fails at once if the supervisor exits
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: the supervisor exited with {gateway.process.poll()} after worker {victim}, which had "
            f"served requests, was killed {age:.1f}s after start:\n{log_tail(gateway, 8)}") from None
    assert victim not in now
    assert probe_http(gateway, "allowed.test", "/early-after").status == 200


# --- signals ----------------------------------------------------------------------------------------


def _converge(gateway, probe_new, is_new, is_old) -> dict[int, int]:
    """Probe with fresh connections until every worker has answered the new way; a worker that has
    answered the new way must never answer the old way again. Returns probes per worker."""
    pids = gateway.serving_pids()
    flipped: set[int] = set()
    seen: dict[int, int] = {}

    def converged() -> bool:  # one probe per call
        probe = probe_new()
        seen[probe.worker] = seen.get(probe.worker, 0) + 1
        if is_new(probe):
            flipped.add(probe.worker)
        else:
            assert is_old(probe), f"neither the old nor the new policy's answer: {probe}"
            assert probe.worker not in flipped, f"worker {probe.worker} went back to the old policy: {probe}"
        return flipped == set(pids)

    procs.wait_for(converged, CONVERGE_WITHIN, "every worker to follow the new policy", interval=0.02,
                   detail=lambda: f"only workers {sorted(flipped)} of {pids} do (probes per worker {seen})")
    return seen


def test_sighup_reloads_the_policy_and_reopens_the_audit_log_in_every_worker(worker_gateway, upstreams):
    gateway = worker_gateway(workers=2, args=["--set", "egress_policy_poll=0"])
    before = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/v1"))
    assert {r.status for r in before} == {200}

    write_policy(gateway.policy, upstreams, RELOADED_RULES)
    # egress_policy_poll=0: nothing changes before the signal.
    unchanged = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/still-v1"))
    assert {r.status for r in unchanged} == {200}, unchanged

    moved = gateway.audit_path.with_name("audit.jsonl.moved")
    os.rename(gateway.audit_path, moved)
    gateway.signal(signal.SIGHUP)

    _converge(gateway, lambda: probe_http(gateway, "api.test", "/v2"),
              is_new=lambda p: p.status == 200, is_old=lambda p: (p.status, p.reason) == (403, "no_rule"))
    assert gateway.process.poll() is None, "the supervisor died of SIGHUP"
    gone = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/v2"))
    assert {(r.status, r.reason) for r in gone} == {(403, "no_rule")}, gone
    assert upstreams.plain["allowed.test"].requests and all(
        r.path in ("/v1", "/still-v1") for r in upstreams.plain["allowed.test"].requests)

    # The audit log was reopened by every worker: lines of both workers' new connections are in the
    # new file, none in the moved one.
    procs.wait_for(gateway.audit_path.exists, 5, what="a new audit log after SIGHUP")
    recent = probe_until_every_worker(gateway, lambda: probe_http(gateway, "api.test", "/reopened"))
    clients = {r.client for r in recent}
    procs.wait_for(lambda: clients <= {e["client"] for e in gateway.audit_entries()}, 5,
                   what=f"audit lines of {sorted(clients)} in the reopened log")
    old_clients = {json.loads(line)["client"] for line in moved.read_text().splitlines() if line}
    assert not clients & old_clients, "lines written to the moved file after SIGHUP"
    workers_in_new = {r.worker for r in recent}
    assert workers_in_new == set(gateway.serving_pids())


def test_a_policy_file_change_reaches_every_worker(worker_gateway, upstreams):
    gateway = worker_gateway(workers=2, args=["--set", "egress_policy_poll=1"])
    before = probe_until_every_worker(gateway, lambda: probe_http(gateway, "api.test", "/v1"))
    assert {(r.status, r.reason) for r in before} == {(403, "no_rule")}
    write_policy(gateway.policy, upstreams, RELOADED_RULES)
    _converge(gateway, lambda: probe_http(gateway, "api.test", "/v2"),
              is_new=lambda p: p.status == 200, is_old=lambda p: (p.status, p.reason) == (403, "no_rule"))
    gone = probe_until_every_worker(gateway, lambda: probe_http(gateway, "allowed.test", "/v2"))
    assert {(r.status, r.reason) for r in gone} == {(403, "no_rule")}, gone
    reloads = [e for e in gateway.audit_entries() if e["event"] == "policy_reload"]
    assert reloads and all(e["result"] == "ok" for e in reloads), reloads


# --- shutdown (stops the module's shared gateway: keep this test last) -------------------------------


def test_sigterm_drains_every_worker_and_leaves_no_process(three, slow_upstream):
    """The last test of this module: it stops the shared three-worker gateway."""
    gateway = three
    pids = gateway.worker_pids()
    everyone = gateway.descendant_ids() | {procs.identity(gateway.pid)}

    # One slow request in flight on each worker.
    in_flight: dict[int, Conn] = {}
    attempts = 0
    while set(in_flight) != set(pids):
        attempts += 1
        assert attempts < 200, f"could not reach every worker: {sorted(in_flight)} of {pids}"
        conn, pid = open_conn(gateway)
        if pid in in_flight:
            conn.close()
            continue
        conn.sock.settimeout(30)
        conn.send(f"GET http://slow.test/slow/2/{pid} HTTP/1.1\r\nHost: slow.test\r\nConnection: close\r\n\r\n"
                  .encode())
        in_flight[pid] = conn
    procs.wait_for(lambda: len(slow_upstream.requests) == len(pids), 10, what="the slow requests upstream")

    answers: dict[int, object] = {}

    def read(pid: int, conn: Conn) -> None:
        try:
            answers[pid] = conn.read_response()
        except Exception as exc:  # noqa: BLE001  (the test reports it)
            answers[pid] = exc

    readers = [threading.Thread(target=read, args=item, daemon=True) for item in in_flight.items()]
    for reader in readers:
        reader.start()
    gateway.signal(signal.SIGTERM)
    code = gateway.process.wait(30)
    for reader in readers:
        reader.join(10)
    for conn in in_flight.values():
        conn.close()

    assert code == 0, f"supervisor exit status {code}"
    for pid, answer in answers.items():
        assert getattr(answer, "status", None) == 200, f"in-flight request on worker {pid}: {answer!r}"
        assert answer.body.startswith(b"slow.test answered /slow/2/"), answer.body
    assert len(answers) == len(pids)
    try:
        procs.wait_for(lambda: not any(procs.running(i) for i in everyone), 5, what="every process to exit")
    except AssertionError:
        raise AssertionError(f"left running after the supervisor exited: "
                             f"{[i[0] for i in everyone if procs.running(i)]}") from None
    assert procs.listening_inodes(gateway.port) == set(), "something still listens on the gateway's port"
