"""Every early refusal closes its socket: the gateway's file descriptors return to their count.

A refusal decided on a connection's first bytes (a ClientHello too large, malformed, in too many
records or unparseable; non-HTTP bytes on the proxy port), sent in one burst with tens of KiB
more, used to leave its socket open: mitmproxy's connection handler was cancelled while it waited
to deliver the queued bytes and skipped its close. The alert was sent and `client disconnect`
logged, but the socket stayed ESTAB (then CLOSE-WAIT) until the garbage collector found it, out of
the per-sandbox connection count and of `tcp_timeout` (300 refusals: 300 descriptors held > 30 s).
The client here keeps its end open: only the gateway's close ends the connection."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from tests.e2e.helpers import shared_gateway, tunnel
from tests.support.waiting import wait_for
from tests.transparent.clients import wait_closed

RULES = """
- id: inspected
  hosts: [allowed.test]
"""
JUNK = bytes(70_000)  # what a client still had to send when the refusal was decided
N = 12


def _records(message: bytes, size: int = 16384) -> bytes:
    return b"".join(b"\x16\x03\x01" + struct.pack("!H", len(message[i:i + size])) + message[i:i + size]
                    for i in range(0, len(message), size))


BURSTS = {
    # a record declaring a 65,537-byte hello (over the 64 KiB budget)
    "client_hello_too_large": b"\x16\x03\x01\x40\x00\x01\x01\x00\x01" + JUNK,
    # a handshake message that is not a ClientHello
    "bad_client_hello": b"\x16\x03\x01\x40\x00\x02\x00\x00\x01" + JUNK,
    # more than 256 records of one byte each
    "too_many_records": b"".join(b"\x16\x03\x01\x00\x01\x01" for _ in range(300)) + JUNK,
    # complete by its lengths, not a ClientHello inside
    "unparseable": _records(b"\x01" + (600).to_bytes(3, "big") + b"\xff" * 600) + JUNK,
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstreams, pki):
    process = shared_gateway(tmp_path_factory, upstreams, pki, RULES, name="sockets")
    yield process
    process.stop()


def open_fds(gateway) -> int:
    return len(os.listdir(f"/proc/{gateway.process.pid}/fd"))


def settle(gateway, at_most: int, deadline: float = 15.0) -> int:
    """The gateway's descriptor count once it is at most `at_most` (or, after `deadline`, as it is)."""
    try:
        return wait_for(lambda: (count,) if (count := open_fds(gateway)) <= at_most else None, deadline,
                        f"at most {at_most} descriptors")[0]
    except AssertionError:
        return open_fds(gateway)


def refused_bursts(gateway, burst: bytes, through_tunnel: bool) -> None:
    socks = []
    try:
        for _ in range(N):
            if through_tunnel:
                conn, answer = tunnel(gateway, "allowed.test:443", timeout=10)
                assert answer.status == 200, answer.body
                sock = conn.sock
            else:
                sock = socket.create_connection((gateway.host, gateway.port), timeout=10)
            try:
                sock.sendall(burst)
            except OSError:
                pass  # the gateway may close before it has read everything
            socks.append(sock)
        for sock in socks:  # the gateway closes each one (before the fix: none, until GC)
            wait_closed(sock, timeout=10)
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("case", [*BURSTS, "non_http"])
def test_an_early_refusal_closes_its_socket(gateway, case):
    baseline = open_fds(gateway)
    if case == "non_http":  # TLS straight to the proxy port: a 400 and a close
        refused_bursts(gateway, BURSTS["client_hello_too_large"], through_tunnel=False)
    else:
        refused_bursts(gateway, BURSTS[case], through_tunnel=True)
    assert settle(gateway, baseline) <= baseline, f"{open_fds(gateway) - baseline} descriptors left open"
