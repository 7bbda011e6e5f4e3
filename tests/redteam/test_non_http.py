"""Non-HTTP egress: what the gateway cannot inspect is refused at once, not relayed: SSH and other
client-speaks-first protocols (SMTP, Redis, FTP, raw binary) in tunnels, on the proxy port and on
redirected transparent ports; TLS inside TLS; QUIC and other UDP, which has no path at all."""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.helpers import TIMEOUT, Conn, assert_refused, connect_proxy, start_tls, tls_tunnel, tunnel
from tests.transparent.clients import client_hello, wait_closed
from tests.support.topology import ALLOWED, OTHER, TCP_HOST

from .common import attack, nothing_reached

pytestmark = attack("non-http")

PAYLOADS = {
    "ssh": b"SSH-2.0-OpenSSH_9.6\r\n",
    "smtp": b"EHLO attacker.example\r\n",
    "redis": b"*1\r\n$4\r\nPING\r\n",
    "ftp": b"USER anonymous\r\n",
    "binary": b"\x00\x00\x00\x2a\x17\x03\x03" + os.urandom(32),
}
QUIC_INITIAL = bytes([0xC3]) + b"\x00\x00\x00\x01" + bytes([8]) + os.urandom(8) + bytes([8]) + os.urandom(8)
QUIC_INITIAL += os.urandom(1200 - len(QUIC_INITIAL))


def _refused_promptly(conn: Conn) -> None:
    started = time.monotonic()
    try:
        response = conn.read_response()
    except (ConnectionError, OSError):
        response = None
    assert time.monotonic() - started < TIMEOUT, "not refused at once"
    if response is not None:
        assert_refused(response, 400, "non_http")


@pytest.mark.parametrize("protocol", sorted(PAYLOADS))
def test_non_http_in_a_plain_tunnel(rt, protocol):
    conn, answer = tunnel(rt.gateway, "allowed.test:443")
    with conn:
        assert answer.status == 200
        conn.send(PAYLOADS[protocol])
        _refused_promptly(conn)
    nothing_reached(rt.everything())


def test_ssh_to_the_proxy_port(rt):
    with connect_proxy(rt.gateway) as conn:
        conn.send(PAYLOADS["ssh"])
        _refused_promptly(conn)
    nothing_reached(rt.everything())


def test_non_http_inside_tls(rt):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        tls.send(PAYLOADS["ssh"])
        _refused_promptly(tls)
    nothing_reached(rt.everything())


def test_tls_inside_tls(rt):
    """A second TLS handshake inside the first (to hide the real protocol from the gateway)."""
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        tls.send(client_hello("other.test"))
        _refused_promptly(tls)
    nothing_reached(rt.everything())


def test_tls_inside_a_plain_port_80_tunnel_to_another_sni(rt):
    """CONNECT to port 80 (an http rule), then TLS naming another host."""
    conn, answer = tunnel(rt.gateway, "allowed.test:80")
    assert answer.status == 200
    with start_tls(conn, rt.gateway, "other.test") as tls:
        response = tls.request("GET", "/", [("Host", "allowed.test:80")])
    assert response.status in (403, 421), response.text
    nothing_reached(rt.everything())


# --- transparent mode -------------------------------------------------------------------------------


@pytest.mark.parametrize("address,port", [(ALLOWED, 443), (ALLOWED, 80), (OTHER, 22), (TCP_HOST, 443)],
                         ids=["ssh-to-443", "ssh-to-80", "ssh-to-22-no-rule", "ssh-to-443-of-a-tcp-rule-host"])
def test_transparent_ssh(world, address, port):
    with world.connect(address, port) as sock:
        sock.sendall(PAYLOADS["ssh"])
        elapsed, data = wait_closed(sock, timeout=6)
    assert elapsed < 3, f"closed after {elapsed:.1f}s"
    assert data == b"" or data.startswith(b"HTTP/1.1 400"), data[:200]
    assert world.touched() == []


def test_transparent_tls_inside_tls(world):
    with start_tls(Conn(world.connect(ALLOWED, 443)), world.gateway, "allowed.test") as tls:
        tls.send(client_hello("other.test"))
        _refused_promptly(tls)
    assert world.touched() == []


@pytest.mark.parametrize("port", [443, 8443, 53])
def test_transparent_quic_and_udp(world, port):
    """UDP to anything but the DNS redirect has no path (the sandbox's UDP 53 goes to the gateway's
    DNS listener, which drops a datagram that is not DNS)."""
    for _ in range(3):
        world.topology.udp_send(world.sandbox.ns, ALLOWED, port, QUIC_INITIAL)
    assert world.touched() == []
