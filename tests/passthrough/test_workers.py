"""Passthrough with `--workers 2`: every worker relays an allowed ClientHello to the pinned upstream
and refuses the others, exactly like one process. Which worker took a connection is read from /proc
(tests/workers/procs.py)."""

from __future__ import annotations

import ssl

import pytest

from tests.support.waiting import value_when
from tests.transparent.clients import client_hello, read_tls_record
from tests.workers.harness import Probe, WorkerGateway, open_conn, probe_until_every_worker

from .conftest import pass_policy
from .test_passthrough import all_servers, der, touched

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def two(tmp_path_factory, upstreams, pki, pass_upstreams):
    workdir = tmp_path_factory.mktemp("passthrough-workers")
    policy = workdir / "policy.yaml"
    policy.write_text(pass_policy(upstreams, pass_upstreams))
    gateway = WorkerGateway(policy, workdir / "gw", upstream_ca=pki.ca_cert, workers=2, expect=2)
    gateway.start()
    yield gateway
    gateway.stop()


def _tunnel(gateway: WorkerGateway, authority: str):
    conn, pid = open_conn(gateway)
    conn.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    answer = conn.read_response(head_only=True)
    assert answer.status == 200, answer
    return conn, pid


def _passthrough(gateway, pki, pass_upstreams) -> Probe:
    conn, pid = _tunnel(gateway, "pass.test:443")
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    with context.wrap_socket(conn.sock, server_hostname="pass.test") as tls:
        tls.settimeout(TIMEOUT)
        assert tls.getpeercert(binary_form=True) == der(pass_upstreams.cert_path), f"worker {pid}: not the upstream's certificate"
        tls.sendall(f"GET /worker/{pid} HTTP/1.1\r\nHost: pass.test\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
    return Probe(pid, conn.client, status, None, data)


def _refused(gateway, hello: bytes) -> Probe:
    conn, pid = _tunnel(gateway, "pass.test:443")
    with conn:
        conn.send(hello)
        read_tls_record(conn.sock, timeout=5)
    return Probe(pid, conn.client, None, None, b"")


def _deny_reason(gateway, client: str) -> str | None:
    """The reason of the client's first deny line (None when there is none after 3 s)."""
    return value_when(lambda: next((entry["reason"] for entry in gateway.audit_entries()
                                    if entry["client"] == client and entry["decision"] == "deny"), None),
                      lambda reason: reason is not None, 3)


def test_every_worker_relays_an_allowed_client_hello(two, pki, pass_upstreams):
    probes = probe_until_every_worker(two, lambda: _passthrough(two, pki, pass_upstreams), at_least=2)
    assert {p.status for p in probes} == {200}, probes
    assert sorted(r.path for r in pass_upstreams.pass_tls.requests) == sorted(f"/worker/{p.worker}" for p in probes)
    assert {r.sni for r in pass_upstreams.pass_tls.requests} == {"pass.test"}
    lines = value_when(lambda: {e["client"]: e for e in two.audit_entries() if e["event"] == "tls" and e.get("passthrough")},
                       lambda lines: all(p.client in lines for p in probes), 3)
    for probe in probes:
        line = lines.get(probe.client)
        assert line is not None, f"no passthrough line for {probe}"
        assert (line["decision"], line["rule"], line["host"], line["address"]) == (
            "allow", "pass", "pass.test", pass_upstreams.addresses["pass.test"]), line


@pytest.mark.parametrize("hello, reason", [
    (lambda: client_hello("pass2.test"), "sni_mismatch"),
    (lambda: client_hello(None), "sni_required"),
    (lambda: client_hello("pass.test", ech=True), "ech_refused"),
], ids=["sni_mismatch", "sni_required", "ech_refused"])
def test_every_worker_refuses_a_bad_client_hello(two, upstreams, pass_upstreams, hello, reason):
    probes = probe_until_every_worker(two, lambda: _refused(two, hello()))
    assert touched(*all_servers(upstreams, pass_upstreams)) == [], "an upstream connection was made"
    reasons = [(p.worker, _deny_reason(two, p.client)) for p in probes]
    assert {r for _, r in reasons} == {reason}, reasons
