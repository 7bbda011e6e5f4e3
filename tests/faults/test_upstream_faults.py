"""Faults around one request, each on one shared gateway: the upstream refuses, resets, stalls or
shows a bad certificate; DNS fails or hangs; the client goes away mid-body; a secret file vanishes.

Every test ends the same way: that request gets a clear error (or, where mitmproxy offers nothing
better, a close within a bounded time), the gateway keeps serving other clients (a control request
to api.test succeeds), and nothing is allowed that should not be (the upstream sees no request it
should not see, and every decision has its audit line).

The gateway runs with `tcp_timeout=3` (mitmproxy's idle timeout, default 600 s: the only bound on a
stalled upstream) and `egress_dns_timeout=1` (default 5), and with its DNS isolated to a loopback
resolver (tests/faults/harness.py) so that no name it resolves can leave the machine.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.e2e.helpers import assert_refused, connect_proxy, get, open_clients, start_tls, tunnel
from tests.support.certificates import issue_cert
from tests.support.waiting import value_when, wait_for, wait_until_sent

from .conftest import address, needs_isolation
from .harness import (
    FullBacklog,
    ScriptedServer,
    TLSRecorder,
    drain,
    header,
    log_problems,
    make_gateway,
    reset_mid_response,
    stall_after_head,
    static_hosts,
)

TCP_TIMEOUT = 3
DNS_TIMEOUT = 1
SECRET = "tok-fault-0123456789abcdef"

RULES = """
- id: cred
  hosts: [allowed.test]
  inject:
    - header: X-Token
      value: "Bearer ${secrets.token}"
- id: control
  hosts: [api.test]
  schemes: [http, https]
- id: plain
  hosts: [refused.test, reset.test, stall.test, blackhole.test, nowhere.invalid, hang.invalid, "*.invalid"]
  schemes: [http]
- id: tls
  hosts: [refused.test, wrongname.test, expired.test, selfsigned.test, stalltls.test]
"""

NAMES = {  # name -> host number in the session's loopback block
    "refused.test": 60,  # nothing listens there
    "reset.test": 61,
    "stall.test": 62,
    "blackhole.test": 63,
    "wrongname.test": 64,
    "expired.test": 65,
    "selfsigned.test": 66,
    "stalltls.test": 67,
}


class Rig:
    def __init__(self, gateway, servers, secret_path, dns):
        self.gateway = gateway
        self.servers = servers
        self.secret_path = secret_path
        self.dns = dns

    def control(self) -> None:
        """The gateway still serves others: a plain request to api.test, on a new connection."""
        with connect_proxy(self.gateway) as conn:
            response = get(conn, "http://api.test/control", "api.test")
        assert response.status == 200 and response.header("X-Upstream") == "api.test", response

    def audit(self, client: str, count: int = 1, wait: float = 3.0) -> list[dict]:
        """The audit lines of `client` once there are `count` (after `wait` s: as many as there are)."""
        return value_when(lambda: [a for a in self.gateway.audit_since_mark() if a.get("client") == client],
                          lambda lines: len(lines) >= count, wait, interval=0.02)


@pytest.fixture(scope="module")
def rig(tmp_path_factory, upstreams, pki, loopback_dns):
    workdir = tmp_path_factory.mktemp("faults")
    certs = workdir / "certs"
    certs.mkdir()
    at = {name: address(upstreams, n) for name, n in NAMES.items()}
    servers = {
        "reset": ScriptedServer(at["reset.test"], 80, reset_mid_response),
        "stall": ScriptedServer(at["stall.test"], 80, stall_after_head),
        "stalltls": ScriptedServer(at["stalltls.test"], 443, stall_after_head),
        "blackhole": FullBacklog(at["blackhole.test"], 80),
        "wrongname": TLSRecorder(at["wrongname.test"], *issue_cert(pki, certs, "wrong", ["elsewhere.test"])),
        "expired": TLSRecorder(at["expired.test"], *issue_cert(pki, certs, "expired", ["expired.test"], expired=True)),
        "selfsigned": TLSRecorder(at["selfsigned.test"],
                                  *issue_cert(pki, certs, "self", ["selfsigned.test"], self_signed=True)),
    }
    secret_path = workdir / "token"
    secret_path.write_text(SECRET + "\n")
    extra = static_hosts(at) + f"secrets:\n  token: {{file: {secret_path}}}\n"
    gateway = make_gateway(workdir, upstreams, pki, RULES, extra, dns=loopback_dns,
                           args=["--set", f"tcp_timeout={TCP_TIMEOUT}", "--set", f"egress_dns_timeout={DNS_TIMEOUT}"])
    yield Rig(gateway, servers, secret_path, loopback_dns)
    gateway.stop()
    for server in servers.values():
        server.stop()


@pytest.fixture(autouse=True)
def _audit_mark(rig):
    rig.gateway.mark()


@pytest.fixture(autouse=True)
def clean(rig, upstreams):
    """Fresh records for each test; afterwards the gateway is alive, still serves, and logged no
    internal failure."""
    upstreams.reset()
    if rig.dns is not None:
        rig.dns.reset()
    for server in rig.servers.values():
        if hasattr(server, "reset"):
            server.reset()
    yield
    assert rig.gateway.process.poll() is None, rig.gateway.log()[-3000:]
    rig.control()
    assert log_problems(rig.gateway.log()) == []


# --------------------------------------------------------------------------------------------
# the upstream refuses, resets, stalls


@pytest.mark.parametrize("how", ["absolute-form", "tunnel"])
def test_upstream_refuses_the_connection(rig, how):
    """Nothing listens at the pinned address: 502 upstream_failed, an `error` audit line."""
    if how == "absolute-form":
        conn = connect_proxy(rig.gateway)
        response = get(conn, "http://refused.test/x", "refused.test")
    else:
        conn, answer = tunnel(rig.gateway, "refused.test:443")
        assert answer.status == 200  # lazy: the upstream is dialled for the first request
        conn = start_tls(conn, rig.gateway, "refused.test")
        response = get(conn, "/x", "refused.test")
    conn.close()
    assert_refused(response, 502, "upstream_failed")
    assert "Connect call failed" in response.text or "refused" in response.text.lower(), response.text
    lines = rig.audit(conn.client, 2)
    assert [(a["event"], a["decision"], a["reason"]) for a in lines][-2:] == [
        ("request", "allow", "allowed"), ("error", "deny", "upstream_failed")]


def test_upstream_resets_before_the_body_is_complete(rig):
    """A buffered response (under stream_large_bodies) cut by a reset: the client gets a 502, not
    the partial body."""
    with connect_proxy(rig.gateway) as conn:
        response = get(conn, "http://reset.test/small", "reset.test")
        assert_refused(response, 502, "upstream_failed")
        assert "complete message body" in response.text, response.text
        assert conn.closed()
    assert rig.servers["reset"].connections == 1
    assert [a["reason"] for a in rig.audit(conn.client, 2)] == ["allowed", "upstream_failed"]


def test_upstream_resets_a_streamed_response(rig):
    """A large response is streamed (headers already sent): a reset mid-body can only be passed on
    as an aborted response, i.e. fewer bytes than Content-Length and a closed connection, at once."""
    with connect_proxy(rig.gateway) as conn:
        conn.send(b"GET http://reset.test/large HTTP/1.1\r\nHost: reset.test\r\n\r\n")
        outcome = drain(conn.sock, 10)
    assert outcome.statuses[:1] == [200] and outcome.closed, outcome
    assert not outcome.timed_out and outcome.elapsed < 5
    length = int(header(outcome.data, "Content-Length"))
    body = outcome.data.split(b"\r\n\r\n", 1)[1]
    assert len(body) < length  # visibly incomplete: the client can tell
    assert [a["reason"] for a in rig.audit(conn.client)] == ["allowed"]


@pytest.mark.parametrize("name, server", [("stall.test", "stall"), ("blackhole.test", "blackhole")])
def test_upstream_stalls(rig, name, server):
    """An upstream that accepts and never answers (stall.test), or whose connect never completes
    (blackhole.test: a full accept queue drops the SYNs). Neither mitmproxy nor the gateway has a
    connect or response timeout: the only bound is `tcp_timeout` (idle client connection; here 3 s,
    default 600 s), after which the client connection is closed without an HTTP answer. Meanwhile
    the gateway serves other clients as usual."""
    if server == "blackhole":
        assert rig.servers["blackhole"].filled()
    conn = connect_proxy(rig.gateway, timeout=10)
    conn.send(f"GET http://{name}/wait HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
    wait_for(lambda: rig.audit(conn.client, wait=0), what="the request's allow line")  # now waiting upstream
    if server == "stall":
        wait_for(lambda: rig.servers["stall"].heads, what="the request at the stalling upstream")
    started = time.monotonic()
    rig.control()  # others are served while this one waits
    assert time.monotonic() - started < 1.0
    outcome = drain(conn.sock, TCP_TIMEOUT + 4)
    conn.close()
    assert outcome.closed and not outcome.timed_out, outcome
    assert outcome.data == b""  # no 502/504: mitmproxy just closes the idle connection
    assert TCP_TIMEOUT - 1 <= outcome.elapsed + 0.5 <= TCP_TIMEOUT + 2, outcome.elapsed
    if server == "stall":
        assert len(rig.servers["stall"].heads) == 1  # the request was sent (it was allowed)
    assert [a["reason"] for a in rig.audit(conn.client)] == ["allowed"]
    assert "Closing connection due to inactivity" in rig.gateway.log()


def test_upstream_stalls_in_the_tls_handshake(rig):
    """The upstream accepts TCP but never answers the ClientHello: bounded by tcp_timeout too."""
    conn, answer = tunnel(rig.gateway, "stalltls.test:443", timeout=10)
    assert answer.status == 200
    tls = start_tls(conn, rig.gateway, "stalltls.test")
    tls.send(b"GET /wait HTTP/1.1\r\nHost: stalltls.test\r\n\r\n")
    outcome = drain(tls.sock, TCP_TIMEOUT + 4)
    tls.close()
    assert outcome.closed and not outcome.timed_out and outcome.data == b"", outcome
    assert outcome.elapsed <= TCP_TIMEOUT + 2
    assert rig.servers["stalltls"].connections == 1


# --------------------------------------------------------------------------------------------
# DNS


@needs_isolation
def test_dns_failure_is_502_resolve_failed(rig):
    """A name outside static_hosts goes to getaddrinfo; the (loopback) resolver says NXDOMAIN."""
    with connect_proxy(rig.gateway) as conn:
        response = get(conn, "http://nowhere.invalid/x", "nowhere.invalid")
    assert_refused(response, 502, "resolve_failed", rule="plain")
    assert "cannot resolve nowhere.invalid" in response.text
    assert set(rig.dns.queries) == {"nowhere.invalid"}  # asked once per family, nothing else
    line = rig.audit(conn.client)[0]
    assert (line["event"], line["decision"], line["reason"], line["status"]) == ("request", "deny", "resolve_failed", 502)


@needs_isolation
def test_dns_timeout_is_502_resolve_failed_after_egress_dns_timeout(rig):
    """The resolver never answers: the gateway gives up after egress_dns_timeout (1 s here) with a
    502, whatever the system resolver's own timeout; other clients are served meanwhile."""
    conn = connect_proxy(rig.gateway, timeout=10)
    started = time.monotonic()
    conn.send(b"GET http://hang.invalid/x HTTP/1.1\r\nHost: hang.invalid\r\n\r\n")
    rig.control()
    response = conn.read_response()
    elapsed = time.monotonic() - started
    conn.close()
    assert_refused(response, 502, "resolve_failed", rule="plain")
    assert f"timed out after {DNS_TIMEOUT}s" in response.text, response.text
    assert DNS_TIMEOUT - 0.2 <= elapsed < DNS_TIMEOUT + 1.5, elapsed
    assert "hang.invalid" in rig.dns.queries


@needs_isolation
def test_hanging_lookups_do_not_starve_other_lookups(rig):
    """Lookups that hang (a slow authoritative server under an allowed wildcard, say) must not hold
    up the lookups of everyone else. Here 40 hanging names (more than the default executor's
    min(32, cpus + 4) threads), then a name the resolver answers at once (NXDOMAIN): its answer
    must be its own, not a timeout."""
    conns = []
    try:
        for i in range(40):
            conn = connect_proxy(rig.gateway, timeout=10)
            conn.send(f"GET http://hang{i}.invalid/x HTTP/1.1\r\nHost: hang{i}.invalid\r\n\r\n".encode())
            conns.append(conn)
        hanging = {f"hang{i}.invalid" for i in range(40)}
        value_when(lambda: set(rig.dns.queries), hanging.issubset)  # every lookup hangs (else: starved)
        started = time.monotonic()
        with connect_proxy(rig.gateway) as conn:
            response = get(conn, "http://nowhere.invalid/x", "nowhere.invalid")
        elapsed = time.monotonic() - started
        assert_refused(response, 502, "resolve_failed", rule="plain")
        assert "cannot resolve nowhere.invalid" in response.text and elapsed < 0.8, (
            f"BUG: an unrelated lookup was starved by hanging ones ({elapsed:.2f}s): {response.text!r}")
    finally:
        for conn in conns:
            conn.close()
        # let the hung getaddrinfo threads give up (resolv.conf timeout:3) before the next test
        value_when(lambda: _resolves_at_once(rig), bool, 6, interval=0.2)


def _resolves_at_once(rig) -> bool:
    """A name the resolver answers at once gets its own answer (no hung lookup in its way)."""
    with connect_proxy(rig.gateway) as conn:
        return "cannot resolve" in get(conn, "http://nowhere.invalid/y", "nowhere.invalid").text


# --------------------------------------------------------------------------------------------
# the upstream's certificate


@pytest.mark.parametrize("name, why", [
    ("wrongname.test", "hostname mismatch"),
    ("expired.test", "certificate has expired"),
    ("selfsigned.test", "self-signed certificate"),
])
def test_bad_upstream_certificate_is_502_and_no_byte_is_sent(rig, name, why):
    conn, answer = tunnel(rig.gateway, f"{name}:443")
    assert answer.status == 200
    tls = start_tls(conn, rig.gateway, name)
    response = get(tls, "/upload", name, method="POST", body=b"confidential request body")
    tls.close()
    assert_refused(response, 502, "upstream_failed")
    assert why in response.text, response.text
    recorder = rig.servers[name.removesuffix(".test")]
    assert recorder.connections == 1 and recorder.handshakes == 0 and recorder.received == b""
    reasons = [(a["event"], a["reason"]) for a in rig.audit(tls.client, 3)]
    assert reasons == [("connect", "allowed"), ("request", "allowed"), ("error", "upstream_failed")]


# --------------------------------------------------------------------------------------------
# the client goes away


@pytest.mark.parametrize("size, sent", [(100_000, 1000), (5 * 1024 * 1024, 2 * 1024 * 1024)],
                         ids=["buffered", "streamed"])
def test_client_disconnects_mid_body(rig, upstreams, size, sent):
    """A POST whose client closes after part of the body. Buffered (under stream_large_bodies):
    nothing reaches the upstream. Streamed: the upstream sees a body cut short, never a complete
    one. Either way the gateway carries on."""
    sock = socket.create_connection((rig.gateway.host, rig.gateway.port), timeout=5)
    client = "%s:%d" % sock.getsockname()[:2]
    sock.sendall(f"POST http://api.test/upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: {size}\r\n\r\n".encode())
    chunk = b"b" * 65536
    remaining = sent
    while remaining > 0:
        sock.sendall(chunk[: min(remaining, len(chunk))])
        remaining -= len(chunk)
    assert wait_until_sent(sock)  # the part sent is at the gateway before the close
    sock.close()
    wait_for(lambda: rig.audit(client, wait=0) and client not in open_clients(rig.gateway), 10,
             "the gateway to finish with the client", detail=rig.gateway.log)
    upstreams.plain["api.test"].settle()
    received = upstreams.plain["api.test"].requests
    if size <= 1024 * 1024:
        assert not upstreams.plain["api.test"].touched
    else:
        assert all(len(r.body) < size for r in received), [len(r.body) for r in received]
    assert [a["reason"] for a in rig.audit(client)] == ["allowed"]


# --------------------------------------------------------------------------------------------
# the secret file disappears


def test_secret_file_disappears_and_comes_back(rig, upstreams):
    server = upstreams.tls["allowed.test"]

    def fetch(path: str):
        conn, answer = tunnel(rig.gateway, "allowed.test:443")
        assert answer.status == 200
        with start_tls(conn, rig.gateway, "allowed.test") as tls:
            return get(tls, path, "allowed.test"), tls.client

    response, _ = fetch("/before")
    assert response.status == 200
    assert ("X-Token", f"Bearer {SECRET}") in server.requests[-1].headers

    rig.secret_path.unlink()
    try:
        response, client = fetch("/during")
        assert_refused(response, 502, "secret_unavailable", rule="cred")
        assert "secret 'token' is unavailable" in response.text and str(rig.secret_path) not in response.text
        assert [r.path for r in server.requests] == ["/before"]  # nothing went out without it
        rig.control()  # requests that need no secret are unaffected
        line = [a for a in rig.audit(client, 2) if a["event"] == "request"][0]
        assert (line["decision"], line["reason"], line["status"]) == ("deny", "secret_unavailable", 502)
    finally:
        rig.secret_path.write_text(SECRET + "\n")
    response, _ = fetch("/after")
    assert response.status == 200
    assert [r.path for r in server.requests] == ["/before", "/after"]

