"""Passthrough in transparent mode: the address is always the gateway's own resolution of the SNI's
name, never the IP the sandbox dialled.

A closed network of its own, built with tests/support/topology.py (the same helpers and the same
docker/sandbox-net.sh as tests/transparent): sandbox namespaces whose TCP 443 is redirected to a
gateway in the gateway namespace, and an "internet" namespace holding

    pass.test   93.184.216.70   RecordingUpstream, certificate for pass.test from the test CA
    decoy.test  93.184.216.71   RecordingUpstream (the IP a sandbox dials with pass.test's SNI)

Nothing has a route off the machine (Topology.check_closed); every namespace is removed at the end.
Two gateways: `lenient` (the default) and `strict` (network.strict_original_destination: true).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench.lib.pki import TestPKI
from tests.support.gateway import GatewayProcess
from tests.support.namespaced import Site, built_topology, start_gateways, transparent_gateway
from tests.support.topology import Topology
from tests.transparent.clients import client_hello, curl, read_tls_record

pytestmark = pytest.mark.netns

PASS_IP, DECOY_IP = "93.184.216.70", "93.184.216.71"


def policy(strict: bool) -> str:
    network = "network:\n  strict_original_destination: true\n" if strict else ""
    return f"""\
version: 1
{network}resolver:
  static_hosts:
    pass.test: ["{PASS_IP}"]
    decoy.test: ["{DECOY_IP}"]
rules:
  - id: pass
    hosts: [pass.test]
    inspect: false
"""


# key -> (sandbox index, transparent port, dns port, regular port)
SITES = {"lenient": (16, 18091, 15361, 18191), "strict": (17, 18092, 15362, 18192)}


@dataclass
class Net:
    topology: Topology
    pki: TestPKI
    sites: dict[str, Site]


@pytest.fixture(scope="module")
def net():
    with built_topology("egress-passthrough-") as (topology, root):
        gateways: dict[str, GatewayProcess] = {}
        try:
            for name, address in (("pass.test", PASS_IP), ("decoy.test", DECOY_IP)):
                topology.add_address(address)
                topology.serve_web(name, address)
            for key, (index, proxy_port, dns_port, regular_port) in SITES.items():
                topology.add_sandbox(key, index, proxy_port, dns_port, "80 443")
                gateways[key] = transparent_gateway(topology, root / key, policy(strict=key == "strict"), regular_port,
                                                    proxy_port, dns_port)
            sites = {key: Site(topology.sandboxes[key], gateways[key]) for key in SITES}
            start_gateways(topology, gateways.values(), [site.sandbox for site in sites.values()])
            yield Net(topology, topology.pki, sites)
        finally:
            for gateway in gateways.values():
                gateway.stop()


@pytest.fixture(autouse=True)
def _reset(net):
    net.topology.reset()
    yield


@pytest.fixture
def lenient(net) -> Site:
    return net.sites["lenient"]


@pytest.fixture
def strict(net) -> Site:
    return net.sites["strict"]


def test_by_name_the_sandbox_sees_the_upstreams_certificate(net, lenient):
    mark = len(lenient.gateway.audit())
    result = curl(lenient.sandbox, net.pki.ca_cert, "https://pass.test/by-name")
    assert result.status == 200, result
    assert result.headers.get("x-upstream") == "pass.test"
    assert [(r.path, r.sni) for r in net.topology.server(f"{PASS_IP}:443").requests] == [("/by-name", "pass.test")]
    assert net.topology.touched() == [f"{PASS_IP}:443"]
    # (Transparent mode also writes the SNI's destination decision as a `tls` line of its own.)
    tls = lenient.gateway.audit_lines(mark, event="tls", passthrough=True)
    assert [(e["decision"], e["rule"], e["host"], e["address"], e["original_destination"])
            for e in tls] == [("allow", "pass", "pass.test", PASS_IP, f"{PASS_IP}:443")], tls
    # Only the upstream's CA works: the gateway's CA is not involved.
    refused = curl(lenient.sandbox, lenient.gateway.ca_cert, "https://pass.test/gateway-ca")
    assert refused.rc == 60, refused


def test_dialling_another_ip_with_the_sni_reaches_only_the_pinned_address(net, lenient):
    mark = len(lenient.gateway.audit())
    result = curl(lenient.sandbox, net.pki.ca_cert, "https://pass.test/fronted",
                  "--resolve", f"pass.test:443:{DECOY_IP}")
    assert result.status == 200, result
    assert result.headers.get("x-upstream") == "pass.test", "the decoy answered"
    assert [r.path for r in net.topology.server(f"{PASS_IP}:443").requests] == ["/fronted"]
    assert net.topology.touched() == [f"{PASS_IP}:443"], "the dialled IP must never be dialled"
    tls = lenient.gateway.audit_lines(mark, event="tls", passthrough=True)
    assert [(e["decision"], e["address"], e["original_destination"]) for e in tls] == [
        ("allow", PASS_IP, f"{DECOY_IP}:443")], tls


def test_strict_original_destination_refuses_another_ip(net, strict):
    mark = len(strict.gateway.audit())
    result = curl(strict.sandbox, net.pki.ca_cert, "https://pass.test/strict",
                  "--resolve", f"pass.test:443:{DECOY_IP}")
    assert result.status != 200, result
    assert net.topology.touched() == [], "nothing may be dialled"
    tls = strict.gateway.audit_lines(mark, event="tls")
    assert [(e["decision"], e["reason"], e["original_destination"]) for e in tls] == [
        ("deny", "original_destination_mismatch", f"{DECOY_IP}:443")], tls


def test_strict_allows_the_names_own_address(net, strict):
    result = curl(strict.sandbox, net.pki.ca_cert, "https://pass.test/strict-ok")
    assert result.status == 200, result
    assert net.topology.touched() == [f"{PASS_IP}:443"]


def test_ech_with_a_passthrough_outer_sni_is_refused_in_transparent_mode(net, lenient):
    mark = len(lenient.gateway.audit())
    with net.topology.connect(lenient.sandbox, DECOY_IP, 443) as sock:
        sock.sendall(client_hello("pass.test", ech=True))
        read_tls_record(sock)
    assert net.topology.touched() == []
    denied = lenient.gateway.audit_lines(mark, event="tls", decision="deny")
    assert [e["reason"] for e in denied] == ["ech_refused"], denied
    assert lenient.gateway.audit()[-1]["reason"] == "ech_refused", "the connection's last word must be the refusal"


def test_no_sni_to_the_decoy_ip_is_refused(net, lenient):
    mark = len(lenient.gateway.audit())
    with net.topology.connect(lenient.sandbox, DECOY_IP, 443) as sock:
        sock.sendall(client_hello(None))
        read_tls_record(sock)
    assert net.topology.touched() == []
    tls = lenient.gateway.audit_lines(mark, event="tls")
    assert tls and all(e["decision"] == "deny" for e in tls), tls
