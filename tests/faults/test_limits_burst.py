"""The limits the README documents, each under a small concurrent burst: `egress_max_head_bytes`
(431), `egress_head_timeout` (408), `egress_max_connections_per_sandbox` (closed at once, audited
`too_many_connections`) and mitmproxy's `body_size_limit` (413 for requests, 502 for responses).
Nothing over a limit reaches an upstream, and everything under it still works.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.helpers import Conn, connect_proxy, get, open_clients
from tests.support.waiting import value_when, wait_for

from .conftest import address
from .harness import drain, make_gateway

RULES = """
- id: allowed
  hosts: [allowed.test]
  schemes: [http]
"""
MAX_HEAD = 4096
HEAD_TIMEOUT = 2
MAX_CONNECTIONS = 6
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def limited(tmp_path_factory, upstreams, pki):
    gateway = make_gateway(tmp_path_factory.mktemp("limits"), upstreams, pki, RULES, args=[
        "--set", f"egress_max_head_bytes={MAX_HEAD}",
        "--set", f"egress_head_timeout={HEAD_TIMEOUT}",
        "--set", f"egress_max_connections_per_sandbox={MAX_CONNECTIONS}",
        "--set", "body_size_limit=64k",
    ])
    yield gateway
    gateway.stop()


@pytest.fixture(autouse=True)
def fresh(upstreams):
    upstreams.reset()


def connect_from(gateway, source: str, timeout: float = 5.0) -> Conn:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect((gateway.host, gateway.port))
    return Conn(sock)


def burst(n: int, job):
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(job, range(n)))


SOURCES: list[str] = []


@pytest.fixture(autouse=True)
def sources(upstreams):
    """Burst workers connect from addresses of their own (127.X.0.100+i), so that only the
    connection-limit test meets the per-client connection limit."""
    SOURCES[:] = [address(upstreams, 100 + i) for i in range(16)]


def client(gateway, i: int, timeout: float = 5.0) -> Conn:
    return connect_from(gateway, SOURCES[i], timeout)


def test_connection_limit_under_a_burst(limited, upstreams):
    """2 x the limit at once from one client address (its own source address, so that the other
    tests' connections do not count): exactly the limit is served, the rest closed at once."""
    source = address(upstreams, 90)
    barrier = threading.Barrier(2 * MAX_CONNECTIONS)

    def open_one(_):
        barrier.wait()
        return connect_from(limited, source)

    def refused() -> list[dict]:
        return [a for a in limited.audit() if a["reason"] == "too_many_connections"
                and a["client"].startswith(source + ":")]

    conns = burst(2 * MAX_CONNECTIONS, open_one)
    try:
        # every connection over the limit is refused (audited, then closed)
        value_when(refused, lambda lines: len(lines) >= MAX_CONNECTIONS)
        refused_clients = {a["client"] for a in refused()}
        closed = [c for c in conns if c.client in refused_clients and c.closed()]
        assert len(closed) == MAX_CONNECTIONS, len(closed)
        # the ones kept are fully served
        kept = [c for c in conns if c not in closed]
        for i, conn in enumerate(kept):
            assert get(conn, f"http://allowed.test/kept/{i}", "allowed.test").status == 200
        assert len(refused()) == MAX_CONNECTIONS and all(a["decision"] == "deny" for a in refused())
    finally:
        for conn in conns:
            conn.close()
    wait_for(lambda: not open_clients(limited) & {c.client for c in conns},
             what="the burst's client disconnects", detail=limited.log)
    with connect_from(limited, source) as conn:  # the slots are given back
        assert get(conn, "http://allowed.test/after", "allowed.test").status == 200


def test_oversized_heads_under_a_burst(limited, upstreams):
    def oversized(i):
        with client(limited, i) as conn:
            return get(conn, f"http://allowed.test/big/{i}", "allowed.test", extra=[("X-Pad", "p" * (MAX_HEAD + 100))])

    responses = burst(8, oversized)
    assert {(r.status, r.egress_reason) for r in responses} == {(431, "request_head_too_large")}
    assert upstreams.untouched("allowed.test")
    with connect_proxy(limited) as conn:  # just under the limit is fine
        assert get(conn, "http://allowed.test/small", "allowed.test", extra=[("X-Pad", "p" * (MAX_HEAD - 200))]).status == 200


def test_heads_with_too_many_fields_under_a_burst(limited, upstreams):
    """Each field costs every later header lookup (12,000 tiny ones cost ~100 ms of the loop per
    request): past egress_max_header_fields (256) the head is refused 431 before it is parsed."""
    def many(i):
        with client(limited, i) as conn:
            return get(conn, f"http://allowed.test/many/{i}", "allowed.test", extra=[(f"X-F{n}", "0") for n in range(256)])

    responses = burst(8, many)  # with Host: 257 fields
    assert {(r.status, r.egress_reason) for r in responses} == {(431, "too_many_header_fields")}
    assert upstreams.untouched("allowed.test")
    with connect_proxy(limited) as conn:  # under it is fine (the test origin itself takes at most 100)
        assert get(conn, "http://allowed.test/few", "allowed.test", extra=[(f"X-F{n}", "0") for n in range(90)]).status == 200


def test_a_request_trailer_section_of_too_many_fields_is_refused_before_it_is_parsed(limited, upstreams):
    """Request trailers are refused anyway (mitmproxy cannot relay them), but only once h11 had
    parsed them: 12,000 fields cost ~80 ms of the loop per request. Now counted first: 431."""
    with client(limited, 0) as conn:
        conn.send(b"POST http://allowed.test/trailers HTTP/1.1\r\nHost: allowed.test\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n" + b"a:0\r\n" * 300 + b"\r\n")
        response = conn.read_response()
    assert (response.status, response.egress_reason) == (431, "too_many_header_fields"), response


def test_slowloris_burst_gets_408(limited, upstreams):
    """Clients that trickle their head a header line at a time get a 408 once egress_head_timeout is
    over, each of them, at once."""

    def trickle(i):
        conn = client(limited, i, timeout=HEAD_TIMEOUT + 5)
        started = time.monotonic()
        conn.send(f"GET http://allowed.test/slow/{i} HTTP/1.1\r\nHost: allowed.test\r\n".encode())
        while time.monotonic() - started < HEAD_TIMEOUT + 4:
            time.sleep(0.25)  # pacing, not synchronisation: the slowloris client drips a header line
            try:
                conn.send(b"X-Slow: 1\r\n")
            except OSError:
                break
            conn.sock.settimeout(0.01)
            try:
                if conn._fill():
                    break
            except (TimeoutError, socket.timeout):
                pass
            except OSError:
                break
        conn.sock.settimeout(5)
        response = conn.read_response()
        conn.close()
        return response, time.monotonic() - started

    results = burst(6, trickle)
    assert {(r.status, r.egress_reason) for r, _ in results} == {(408, "request_head_timeout")}
    assert all(elapsed < HEAD_TIMEOUT + 1.5 for _, elapsed in results), [e for _, e in results]
    assert upstreams.untouched("allowed.test")


@pytest.mark.parametrize("sent", [
    b"GET http://allowed.test/silent HTTP/1.1\r\nHost: allowed.test\r\nX-Partial: ",
    b"GET http://allowed.te",
], ids=["partial-head", "partial-first-line"])
def test_silent_partial_head_is_cut_off_by_the_head_timeout(limited, upstreams, sent):
    """README: egress_head_timeout is the time a client may take to send one request head or first
    line. A client that sends part of it and then nothing at all must be cut off after it too, not
    only one that keeps trickling (else tcp_timeout, 600 s by default, is the only bound)."""
    conns = []

    def silent(i):
        conn = client(limited, i, timeout=HEAD_TIMEOUT + 5)
        conns.append(conn)
        conn.send(sent)
        return drain(conn.sock, HEAD_TIMEOUT + 2)

    try:
        outcomes = burst(3, silent)
    finally:
        for conn in conns:
            conn.close()
    for outcome in outcomes:
        assert not outcome.timed_out, (
            f"BUG: a silent client is not cut off after egress_head_timeout={HEAD_TIMEOUT}s "
            f"(nothing within {HEAD_TIMEOUT + 2}s): {outcome}")
        assert all(s == 408 for s in outcome.statuses), outcome
    assert upstreams.untouched("allowed.test")


def test_body_size_limit_under_a_burst(limited, upstreams):
    big = b"B" * (BODY_LIMIT + 1000)

    def big_post(i):
        with client(limited, i) as conn:
            if i % 2:
                chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (big[:40000], big[40000:])) + b"0\r\n\r\n"
                conn.send(b"POST http://allowed.test/up/%d HTTP/1.1\r\nHost: allowed.test\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n" % i + chunked)
                return conn.read_response()
            return get(conn, f"http://allowed.test/up/{i}", "allowed.test", method="POST", body=big)

    def big_download(i):
        with client(limited, i) as conn:
            return get(conn, f"http://allowed.test/bytes/{BODY_LIMIT * 3}", "allowed.test")

    posts = burst(6, big_post)
    assert {(r.status, r.egress_reason) for r in posts} == {(413, "request_too_large")}
    # A body of declared length is refused before anything goes upstream. A chunked one streams
    # (docs/streaming.md): its upstream connection is aborted when the limit is crossed, so the
    # upstream may see the head, never a complete request.
    seen = [r for r in upstreams.plain["allowed.test"].requests if r.method == "POST"]
    assert all(r.headers and ("Transfer-Encoding", "chunked") in r.headers for r in seen), seen
    assert not [r for r in seen if len(r.body) > BODY_LIMIT], "a body over the limit reached the upstream"
    downloads = burst(4, big_download)
    assert {(r.status, r.egress_reason) for r in downloads} == {(502, "response_too_large")}
    # under the limit, both ways
    with connect_proxy(limited) as conn:
        ok = get(conn, "http://allowed.test/up/small", "allowed.test", method="POST", body=b"s" * (BODY_LIMIT - 1000))
        assert ok.status == 200
        assert get(conn, f"http://allowed.test/bytes/{BODY_LIMIT - 1000}", "allowed.test").status == 200


def test_a_streamed_response_over_the_body_size_limit_is_cut_off(limited, upstreams):
    """A chunked download streams (no length to check up front): past body_size_limit the response
    is cut off (no final chunk, the connection closed) and audited, never relayed whole."""
    with client(limited, 0) as conn:
        conn.send(b"GET http://allowed.test/chunked/%d HTTP/1.1\r\nHost: allowed.test\r\n\r\n" % (BODY_LIMIT * 3))
        raw = drain(conn.sock, 10)
    assert not raw.timed_out and raw.closed
    data = raw.data
    assert data.startswith(b"HTTP/1.1 200")
    assert b"\r\n0\r\n\r\n" not in data, "the cut-off response must not end like a complete one"
    assert len(data) < BODY_LIMIT * 2
    assert any(e.get("reason") == "response_too_large" for e in limited.audit())
