"""Limits that protect the gateway: request head size and time, connections per sandbox."""

import socket
import time

import pytest

from tests.e2e.helpers import audit_for, connect_proxy, curl, open_clients
from tests.support.waiting import wait_for

RULES = """
- id: allowed
  hosts: [allowed.test]
  schemes: [http, https]
"""


def test_oversized_request_head_is_431(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_max_head_bytes=4096"])
    conn = connect_proxy(gateway)
    conn.send(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    response = conn.read_response()
    assert (response.status, response.egress_reason) == (431, "request_head_too_large")
    assert upstreams.untouched("allowed.test")
    # a head under the limit still works
    assert curl(gateway, "http://allowed.test/ok", "-H", "X-Small: " + "b" * 1000).status == 200


def test_slowloris_head_is_cut_off_with_408(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_head_timeout=1"])
    conn = connect_proxy(gateway, timeout=10)
    conn.send(b"GET http://allowed.test/ HTTP/1.1\r\n")
    started = time.monotonic()
    response = None
    while time.monotonic() - started < 8:
        time.sleep(0.3)  # not synchronisation: the slow client under test drips a header line every 0.3 s
        try:
            conn.send(b"X-Slow: 1\r\n")
        except OSError:
            break
        conn.sock.settimeout(0.05)
        try:
            if conn._fill():
                break
        except (TimeoutError, socket.timeout):
            pass
        finally:
            conn.sock.settimeout(10)
    response = conn.read_response()
    assert (response.status, response.egress_reason) == (408, "request_head_timeout")
    assert time.monotonic() - started < 5
    assert upstreams.untouched("allowed.test")
    assert audit_for(gateway, conn.client)[0]["reason"] == "request_head_timeout"


def test_an_empty_line_after_a_request_does_not_start_the_next_heads_clock(start_gateway, upstreams):
    """Review 9: a POST body followed by a CRLF (as clients send), then an idle keep-alive
    connection, got an unsolicited 408 request_head_timeout at egress_head_timeout: the skipped
    empty line had started the next head's clock. Now only a head's own bytes start it; the idle
    connection hears nothing (checked for twice the timeout) and its next request is served."""
    gateway = start_gateway(RULES, args=["--set", "egress_head_timeout=1"])
    conn = connect_proxy(gateway, timeout=10)
    conn.send(b"POST http://allowed.test/a HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\n\r\nx=1\r\n")
    assert conn.read_response().status == 200
    conn.sock.settimeout(2.0)  # twice the head timeout: an unsolicited 408 would have come by then
    with pytest.raises((TimeoutError, socket.timeout)):
        conn.sock.recv(1)
    conn.sock.settimeout(10)
    assert conn.request("GET", "http://allowed.test/b", [("Host", "allowed.test")]).status == 200
    assert [a["reason"] for a in audit_for(gateway, conn.client, 2)] == ["allowed", "allowed"]


def test_connections_per_client_are_capped(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_max_connections_per_sandbox=2"])
    # The start-up probe's connection must be gone first. The gateway accepts in order, so once a
    # connection of ours is answered the probe's was accepted (and logged) before it; then its
    # disconnect is waited for.
    first = connect_proxy(gateway)
    assert first.request("GET", "http://allowed.test/held", [("Host", "allowed.test")]).status == 200
    wait_for(lambda: open_clients(gateway) == {first.client}, what="the start-up probe's client disconnect",
             detail=gateway.log)
    second = connect_proxy(gateway)  # answered: the gateway has counted it (at connect, before any request)
    assert second.request("GET", "http://allowed.test/held", [("Host", "allowed.test")]).status == 200
    held = [first, second]
    extra = connect_proxy(gateway)
    extra.sock.settimeout(3)
    assert extra.sock.recv(100) == b""  # closed at once, nothing read or answered
    lines = wait_for(lambda: [a for a in gateway.audit() if a["reason"] == "too_many_connections"],
                     what="the too_many_connections line")
    assert len(lines) == 1 and lines[0]["decision"] == "deny"
    for conn in held:
        conn.sock.close()
    wait_for(lambda: not open_clients(gateway) & {conn.client for conn in held},
             what="the held connections' client disconnect", detail=gateway.log)
    assert curl(gateway, "http://allowed.test/after").status == 200  # slots are given back
