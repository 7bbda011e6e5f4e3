"""The closed namespace network for attacks that name non-loopback addresses or need transparent
mode: tests.support.topology (sandbox built by docker/sandbox-net.sh, a gateway namespace, an
"internet" namespace with recorders on every address), with ONE sandbox and ONE gateway that
listens three ways inside the gateway namespace:

    transparent@0.0.0.0:TPROXY   the sandbox's redirected TCP 80/443/22
    dns@0.0.0.0:DNS              the sandbox's resolver (udp/tcp 53 redirected)
    regular@127.0.0.1:REGULAR    explicit-mode attacks, from sockets opened in the gateway namespace
    --metrics 127.0.0.1:METRICS  the metrics endpoint (a listener of the gateway's own)

Safety: every socket toward a non-loopback address is opened inside one of the topology's
namespaces, none of which has a route off the machine (Topology.check_closed, run after every
change); the gateway runs inside the gateway namespace, whose resolv.conf points at a trap
resolver in the internet namespace that records and never answers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from tests.support.gateway import GatewayProcess
from tests.support.namespaced import built_topology, start_gateways, transparent_gateway
from tests.support.topology import ALLOWED, ETC_NETNS, HOSTS, OTHER, TCP_HOST, TRAP_RESOLVER, Sandbox, Topology, dns_query

SANDBOX_INDEX = 7
TPROXY, DNS, REGULAR, METRICS = 18091, 15391, 18191, 19191
GATEWAY_SIDE = f"10.203.{SANDBOX_INDEX}.1"  # the gateway's own address on the sandbox's veth

METADATA = "169.254.169.254"
ALIBABA = "100.100.100.200"
AWS6 = "fd00:ec2::254"
CGNAT = "100.64.0.5"
MAPPED = "::ffff:169.254.169.254"
NAT64 = "64:ff9b::a9fe:a9fe"
SIXTOFOUR = "2002:a9fe:a9fe::1"
TEREDO = "2001:0:4136:e378:8000:63bf:5601:5601"  # Teredo client 169.254.169.254 (obfuscated)
RESOLVER = TRAP_RESOLVER  # also stands in for a public DoH/DoT resolver

# addresses on the internet side that must never hear a thing, with the TCP ports recorded there
FORBIDDEN_V4 = [METADATA, ALIBABA, CGNAT]
FORBIDDEN_V6 = [AWS6, NAT64, SIXTOFOUR, TEREDO]

STATIC = {
    "allowed.test": [ALLOWED],
    "other.test": [OTHER],
    "meta.test": [METADATA],
    "alibaba.test": [ALIBABA],
    "meta6.test": [AWS6],
    "cgnat.test": [CGNAT],
    "mapped.test": [MAPPED],
    "nat64.test": [NAT64],
    "sixtofour.test": [SIXTOFOUR],
    "teredo.test": [TEREDO],
    "mixed.test": [ALLOWED, METADATA],
    "gwself.test": [GATEWAY_SIDE],
}
HOSTS_FILE_REBIND = "hostsrebind.test"  # in the gateway namespace's /etc/hosts only: 169.254.169.254

SPECIAL_NAMES = [n for n in STATIC if n not in ("allowed.test", "other.test")] + [HOSTS_FILE_REBIND]
SPECIAL_IPS = [METADATA, ALIBABA, AWS6, CGNAT, MAPPED, NAT64, SIXTOFOUR, TEREDO, GATEWAY_SIDE]


def _quoted(items) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


POLICY = f"""\
version: 1
resolver:
  static_hosts:
{chr(10).join(f"    {name}: {_quoted(addresses)}" for name, addresses in STATIC.items())}
rules:
  - id: web
    hosts: [allowed.test]
    schemes: [https, http]
  - id: web-by-ip
    hosts: ["{ALLOWED}"]
    schemes: [https]
  # The deny list beats every rule: these names and literals are all allowed by policy.
  - id: specials
    hosts: {_quoted(SPECIAL_NAMES + SPECIAL_IPS + ["169.254.0.0/16"])}
    schemes: [https, http]
  # The gateway's own listeners, allowed by a rule: self-protection must still refuse them.
  - id: loopback
    hosts: ["127.0.0.1", "0.0.0.0", "::ffff:127.0.0.1", "{GATEWAY_SIDE}"]
    schemes: [https, http]
    ports: [{REGULAR}, {METRICS}, {TPROXY}, {DNS}]
  - id: ssh-by-ip
    protocol: tcp
    hosts: ["{TCP_HOST}"]
    ports: [22]
"""


@dataclass
class World:
    topology: Topology
    sandbox: Sandbox
    gateway: GatewayProcess

    @property
    def ca(self) -> Path:
        return self.gateway.ca_cert

    @contextlib.contextmanager
    def gateway_ns(self):
        """Open sockets in the gateway namespace (the explicit listener is 127.0.0.1 there)."""
        with self.topology.inside(self.topology.gw):
            yield

    def connect(self, address: str, port: int, timeout: float = 5.0):
        """A TCP connection from the sandbox (redirected to the gateway for 80/443/22)."""
        return self.topology.connect(self.sandbox, address, port, timeout)

    def dns(self, name: str, qtype: str = "A", tcp: bool = False):
        return dns_query(self.topology, self.sandbox.ns, self.sandbox.gateway_address, name, qtype, tcp=tcp)

    def touched(self) -> list[str]:
        return self.topology.touched()

    def audit_mark(self) -> int:
        return len(self.gateway.audit())

    def audit_since(self, mark: int, count: int = 1, **match) -> list[dict]:
        """Audit lines after `mark` whose fields equal `match`, once there are `count` (after 3 s:
        as many as there are; the caller's assertion says what is missing)."""
        return self.gateway.audit_lines(mark, count, 3, **match)


def build_world():
    """A generator: yields a World, tears everything down afterwards (and checks nothing is left)."""
    with built_topology("egress-redteam-") as (topology, root):
        gateway = None
        try:
            # A name whose /etc/hosts address (in the gateway namespace) is the metadata service.
            hosts = ETC_NETNS / topology.gw / "hosts"
            hosts.write_text(hosts.read_text() + f"{METADATA} {HOSTS_FILE_REBIND}\n")
            for name in ("allowed.test", "other.test"):
                topology.add_address(HOSTS[name])
                topology.serve_web(name, HOSTS[name])
            for address in (TCP_HOST, RESOLVER, *FORBIDDEN_V4, *FORBIDDEN_V6):
                topology.add_address(address)
            for address in (*FORBIDDEN_V4, *FORBIDDEN_V6):
                topology.serve_tcp(address, 443)
                topology.serve_tcp(address, 80)
            topology.serve_tcp(TCP_HOST, 443)
            topology.serve_tcp(TCP_HOST, 22, echo=True)
            topology.serve_tcp(OTHER, 22)
            topology.serve_udp(ALLOWED, 443)  # QUIC
            topology.serve_udp(RESOLVER, 53)
            topology.serve_tcp(RESOLVER, 53)
            topology.serve_tcp(RESOLVER, 443)  # DoH
            topology.serve_tcp(RESOLVER, 853)  # DoT
            topology.serve_udp(RESOLVER, 853)  # DoQ
            sandbox = topology.add_sandbox("redteam", SANDBOX_INDEX, TPROXY, DNS, "80 443 22")
            gateway = transparent_gateway(topology, root / "gw", POLICY, REGULAR, TPROXY, DNS,
                                          ["--metrics", f"127.0.0.1:{METRICS}"])
            start_gateways(topology, [gateway], [sandbox])
            yield World(topology, sandbox, gateway)
        finally:
            if gateway is not None:
                gateway.stop()
