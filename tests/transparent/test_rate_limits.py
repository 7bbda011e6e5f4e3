"""A sandbox's buckets on redirected connections (the `limited` sandbox and gateway: a burst of 4
new connections and 2 requests, refilled at one token per 1,000 s): requests past the request
bucket get 429 `rate_limited` and reach no upstream; a connection past the connection bucket is
closed at accept, before any byte is read, with a `connection_rate_limited` line; raw TCP relays
take a connection token and no request token; the neighbour sandbox, behind the same gateway,
keeps buckets of its own."""

from __future__ import annotations

import pytest

from .clients import curl, http_exchange, http_request, wait_closed
from tests.support.topology import ALLOWED, TCP_HOST

pytestmark = pytest.mark.netns

SSH_BANNER = b"SSH-2.0-OpenSSH_9.6\r\n"


def _echoed(sock) -> bytes:
    sock.sendall(SSH_BANNER)
    echoed = b""
    while len(echoed) < len(SSH_BANNER) and (chunk := sock.recv(1024)):
        echoed += chunk
    return echoed


def test_the_request_and_connection_buckets_hold_on_redirected_connections(topology, limited, neighbour):
    mark = limited.audit_mark()
    address = limited.sandbox.address
    with topology.connect(limited.sandbox, ALLOWED, 80) as sock:  # connection token 1
        first, second, third = http_exchange(sock, [http_request("allowed.test", f"/r{n}") for n in (1, 2, 3)])
        _, after = wait_closed(sock)  # a 429 closes an HTTP/1 connection
    assert (first.status, second.status) == (200, 200)
    assert (third.status, third.egress_reason) == (429, "rate_limited"), third.text()
    assert 1 <= int(third.headers["retry-after"]) <= 3600
    assert after == b""
    assert [r.path for r in topology.server(f"{ALLOWED}:80").requests] == ["/r1", "/r2"]

    for _ in range(3):  # connection tokens 2-4: raw TCP takes no request token
        with topology.connect(limited.sandbox, TCP_HOST, 22) as sock:
            assert _echoed(sock) == SSH_BANNER
    with topology.connect(limited.sandbox, TCP_HOST, 22) as sock:  # the fifth: closed at accept
        try:
            sock.sendall(SSH_BANNER)
        except OSError:
            pass
        _, answer = wait_closed(sock)
    assert answer == b""
    assert topology.server(f"{TCP_HOST}:22").connections == 3

    lines = limited.audit_since(mark, reason="connection_rate_limited")
    assert [(e["event"], e["decision"], e["status"]) for e in lines] == [("connection", "deny", None)], lines
    assert lines[0]["client"].startswith(address), lines
    refusals = limited.audit_since(mark, reason="rate_limited")
    assert [(e["event"], e["status"], e["host_header"]) for e in refusals] == [("request", 429, "allowed.test")]

    # The neighbour, on the same gateway: its own connection and request buckets are untouched.
    assert curl(neighbour.sandbox, neighbour.ca, "http://allowed.test/neighbour").status == 200
    with topology.connect(neighbour.sandbox, TCP_HOST, 22) as sock:
        assert _echoed(sock) == SSH_BANNER
