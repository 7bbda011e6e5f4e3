"""Sandboxes are isolated from each other and cannot borrow another sandbox's identity: the gateway
picks a sandbox's rules by source address, and sandbox-net.sh drops (on the gateway side) whatever
arrives on a sandbox's veth from any other source address."""

from __future__ import annotations

import contextlib
import socket

import pytest

from .clients import curl, http_exchange, http_request
from tests.support.topology import ALLOWED, OTHER, TcpRecorder, UdpRecorder, dns_query_packet, ip

pytestmark = pytest.mark.netns


@pytest.fixture
def beta_listeners(topology, beta):
    """Listeners inside the beta sandbox on its own address: TCP 80 and 8080, UDP 5300."""
    address = beta.sandbox.address
    with topology.inside(beta.ns):
        servers = {"tcp80": TcpRecorder("beta:80", address, 80), "tcp8080": TcpRecorder("beta:8080", address, 8080),
                   "udp5300": UdpRecorder("beta:udp5300", address, 5300)}
    yield servers
    for server in servers.values():
        server.stop()


def test_sandboxes_cannot_reach_each_other(topology, alpha, beta, beta_listeners):
    target = beta.sandbox.address
    with pytest.raises(OSError):
        topology.connect(alpha.sandbox, target, 8080, timeout=1.5).close()
    topology.udp_send(alpha.ns, target, 5300, b"hello neighbour")
    # Port 80 is redirected to the gateway, which never dials a sandbox (no rule names it).
    with topology.connect(alpha.sandbox, target, 80) as sock:
        (reply,) = http_exchange(sock, [http_request(target, "/", close=True)])
    assert (reply.status, reply.egress_reason) == (403, "no_rule"), reply.text()
    with topology.connect(alpha.sandbox, target, 80) as sock:
        (reply,) = http_exchange(sock, [http_request("allowed.test", "/via-neighbour", close=True)])
    assert reply.status == 200, reply.text()  # named allowed.test: goes to allowed.test, not to beta
    assert [r.path for r in topology.server(f"{ALLOWED}:80").requests] == ["/via-neighbour"]
    with topology.inside(beta.ns):  # fenced: whatever is queued at beta's listeners is counted
        for server in beta_listeners.values():
            server.settle()
    assert {k: s.connections for k, s in beta_listeners.items()} == {"tcp80": 0, "tcp8080": 0, "udp5300": 0}


@pytest.fixture
def alpha_with_betas_address(topology, alpha, beta):
    """Root inside alpha adds beta's address to its own interface (to pose as beta)."""
    spoofed = beta.sandbox.address
    ip("-n", alpha.ns, "addr", "add", f"{spoofed}/32", "dev", "eth0")
    yield spoofed
    ip("-n", alpha.ns, "addr", "del", f"{spoofed}/32", "dev", "eth0", check=False)


def test_a_sandbox_cannot_pose_as_another(topology, alpha, beta, alpha_with_betas_address):
    spoofed = alpha_with_betas_address
    mark = alpha.audit_mark()
    with topology.inside(alpha.ns):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((spoofed, 0))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.bind((spoofed, 0))
    with contextlib.closing(udp), contextlib.closing(tcp):
        udp.settimeout(1.5)
        udp.sendto(dns_query_packet("other.test", "A"), (alpha.sandbox.gateway_address, 53))
        with pytest.raises(OSError):
            udp.recvfrom(4096)
        tcp.settimeout(1.5)
        with pytest.raises(OSError):
            tcp.connect((OTHER, 443))
    assert topology.touched() == []
    spoofed_lines = [e for e in alpha.gateway.audit()[mark:] if (e.get("client") or "").startswith(spoofed + ":")]
    assert spoofed_lines == [], "the gateway saw traffic from a spoofed source on alpha's veth"
    # Alpha's own address still works (the fixture did not break the sandbox).
    assert curl(alpha.sandbox, alpha.ca, "https://allowed.test/still-alpha").status == 200


def test_the_gateway_itself_is_not_a_destination(topology, main):
    result = curl(main.sandbox, main.ca, f"https://{main.sandbox.gateway_address}/", "-k")
    assert (result.status, result.egress_reason) == (403, "no_rule"), result
    assert topology.touched() == []
