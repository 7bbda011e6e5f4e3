"""Fixtures for the transparent/DNS-mode tests: one closed network per session (see tests/support/topology.py),
eight sandboxes built by docker/sandbox-net.sh, and six gateways in the gateway namespace.

    sandbox  gateway  policy
    main     main     allowed.test + pypi.test (http/https), 93.184.216.34 by IP (https),
                      raw TCP :22 to tcp.test's IP and to the name tcpname.test
    strict   strict   allowed.test only, network.strict_original_destination: true
    alpha    multi    `sandboxes:` alpha -> allowed.test only
    beta     multi    `sandboxes:` beta  -> other.test only
    report   report   `mode: report`: allowed.test (GET), raw TCP :22 to tcp.test's IP; the rest would_deny
    revoke   revoke   allowed.test, other.test, raw TCP :22 to tcp.test's IP; rewritten and reloaded by
                      test_revocation.py (open connections after a policy change)
    limited  limited  main's policy, with per-sandbox buckets that do not refill within a test run
    neighbour limited (LIMITED_ARGS): test_rate_limits.py spends limited's, neighbour keeps its own

Safety: everything that is sent to a non-loopback address is sent from inside a namespace created
here (the test process switches only a thread's namespace, programs run under `ip netns exec`);
the gateways run in the gateway namespace; no namespace has a link to the host or a default route
off the machine (checked after every change). Every namespace, veth and /etc/netns directory is
removed at the end, and the test run fails if anything is left over.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.support.gateway import NamespacedGateway
from tests.support.namespaced import Site, built_topology, start_gateways, transparent_gateway
from tests.support.topology import (
    ALLOWED, HOSTS, OTHER, PUBLIC_V6, PYPI, TCP_HOST, TCP_NAMED, TRAP_RESOLVER, Topology,
)


def _static_hosts() -> str:
    return "\n".join(f'    {name}: ["{address}"]' for name, address in HOSTS.items())


MAIN_POLICY = f"""\
version: 1
resolver:
  static_hosts:
{_static_hosts()}
rules:
  - id: web
    hosts: [allowed.test, pypi.test]
    schemes: [https, http]
  - id: web-by-ip
    hosts: ["{ALLOWED}"]
    schemes: [https]
  - id: ssh-by-ip
    protocol: tcp
    hosts: ["{TCP_HOST}"]
    ports: [22]
  - id: ssh-by-name
    protocol: tcp
    hosts: [tcpname.test]
    ports: [22]
"""

STRICT_POLICY = f"""\
version: 1
network:
  strict_original_destination: true
resolver:
  static_hosts:
{_static_hosts()}
rules:
  - id: web
    hosts: [allowed.test]
    schemes: [https, http]
"""

MULTI_POLICY = f"""\
version: 1
resolver:
  static_hosts:
{_static_hosts()}
rules:
  - id: alpha-web
    hosts: [allowed.test]
    schemes: [https, http]
  - id: beta-web
    hosts: [other.test]
    schemes: [https, http]
sandboxes:
  - id: alpha
    source_ips: [10.203.3.0/24]
    rules: [alpha-web]
  - id: beta
    source_ips: [10.203.4.0/24]
    rules: [beta-web]
"""

REPORT_POLICY = f"""\
version: 1
mode: report
resolver:
  static_hosts:
{_static_hosts()}
rules:
  - id: web
    hosts: [allowed.test]
    schemes: [https, http]
    methods: [GET]
  - id: ssh-by-ip
    protocol: tcp
    hosts: ["{TCP_HOST}"]
    ports: [22]
"""

# Rewritten and reloaded by test_revocation.py (which puts it back after each test).
REVOKE_POLICY = f"""\
version: 1
resolver:
  static_hosts:
{_static_hosts()}
rules:
  - id: web
    hosts: [allowed.test]
    schemes: [https, http]
  - id: other-web
    hosts: [other.test]
    schemes: [https, http]
  - id: ssh-by-ip
    protocol: tcp
    hosts: ["{TCP_HOST}"]
    ports: [22]
"""

# key -> (sandbox index, proxy port, dns port, redirected TCP ports, gateway key)
SANDBOXES = {
    "main": (1, 18081, 15353, "80 443 22", "main"),
    "strict": (2, 18082, 15354, "80 443 22", "strict"),
    "alpha": (3, 18083, 15355, "80 443", "multi"),
    "beta": (4, 18083, 15355, "80 443", "multi"),
    "report": (5, 18084, 15356, "80 443 22", "report"),
    "revoke": (6, 18085, 15357, "80 443 22", "revoke"),
    "limited": (7, 18086, 15358, "80 443 22", "limited"),
    "neighbour": (8, 18086, 15358, "80 443 22", "limited"),
    "capped": (9, 18087, 15359, "80 443 22", "capped"),
}
# The limited gateway's buckets: a burst of 4 new connections and 2 requests per sandbox, refilled
# at one token per 1,000 s (the least the options take), so a test can count them out exactly.
LIMITED_ARGS = ["--set", "egress_max_new_connections_per_second_per_sandbox=0.001",
                "--set", "egress_new_connection_burst_per_sandbox=4",
                "--set", "egress_max_requests_per_second_per_sandbox=0.001",
                "--set", "egress_request_burst_per_sandbox=2"]
GATEWAYS = {"main": (MAIN_POLICY, 18181, []), "strict": (STRICT_POLICY, 18182, []),
            "multi": (MULTI_POLICY, 18183, []), "report": (REPORT_POLICY, 18184, []),
            "revoke": (REVOKE_POLICY, 18185, []), "limited": (MAIN_POLICY, 18186, LIMITED_ARGS),
            "capped": (MAIN_POLICY, 18187, ["--set", "egress_max_upstream_connections_per_sandbox=1"])}


@dataclass
class World:
    topology: Topology
    sites: dict[str, Site]


@pytest.fixture(scope="session")
def world():
    with built_topology("egress-transparent-") as (topology, root):
        gateways: dict[str, NamespacedGateway] = {}
        try:
            for name in ("allowed.test", "other.test"):
                topology.add_address(HOSTS[name])
                topology.serve_web(name, HOSTS[name])
            for address in (TCP_HOST, TCP_NAMED, PYPI, TRAP_RESOLVER, PUBLIC_V6):
                topology.add_address(address)
            topology.serve_index(PYPI)
            for address in (OTHER, TCP_HOST, TCP_NAMED):
                topology.serve_tcp(address, 22, echo=True)
            topology.serve_tcp(OTHER, 8080)
            topology.serve_udp(OTHER, 5300)
            topology.serve_udp(OTHER, 53)
            topology.serve_udp(ALLOWED, 443)
            topology.serve_udp(TRAP_RESOLVER, 53)
            topology.serve_tcp(TRAP_RESOLVER, 53)
            topology.serve_tcp(PUBLIC_V6, 443)
            topology.serve_tcp(PUBLIC_V6, 8080)
            topology.serve_udp(PUBLIC_V6, 5300)
            topology.record_icmp()
            for key, (index, proxy_port, dns_port, ports, _gw) in SANDBOXES.items():
                topology.add_sandbox(key, index, proxy_port, dns_port, ports)
            for key, (text, regular_port, limits) in GATEWAYS.items():
                proxy_port, dns_port = next((p, d) for (_i, p, d, _r, g) in SANDBOXES.values() if g == key)
                gateways[key] = transparent_gateway(topology, root / key, text, regular_port, proxy_port, dns_port,
                                                    limits)
            sites = {key: Site(topology.sandboxes[key], gateways[gw]) for key, (*_x, gw) in SANDBOXES.items()}
            start_gateways(topology, gateways.values(), [site.sandbox for site in sites.values()])
            yield World(topology, sites)
        finally:
            for gateway in gateways.values():
                gateway.stop()


@pytest.fixture(scope="session")
def topology(world) -> Topology:
    return world.topology


def _site_fixture(key: str):
    """The fixture for one sandbox of SANDBOXES (named after it): its Site in the session's world."""
    @pytest.fixture(scope="session", name=key)
    def site(world) -> Site:
        return world.sites[key]
    return site


for _key in SANDBOXES:  # main, strict, alpha, beta, report, revoke, limited, neighbour
    globals()[_key] = _site_fixture(_key)


@pytest.fixture(autouse=True)
def _fresh_recorders(request):
    if "world" in request.fixturenames or any(name in request.fixturenames for name in SANDBOXES):
        request.getfixturevalue("world").topology.reset()
    yield
