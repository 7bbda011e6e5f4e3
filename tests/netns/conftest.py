"""Fixtures for the network-namespace tests: one closed lab network per session, and gateways
running inside its gateway namespace.

Safety: every socket these tests open toward a non-loopback address is opened inside a namespace
created here (checked before each connect), and the gateway runs inside that namespace too. The
namespaces have only lo and one veth pair between themselves: no default route, no link to the host.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.gateway import GatewayProcess

from .lab import GATEWAY_OWN, Client, Lab, netns_unavailable_reason

# name -> address, in the policy's static_hosts; every address is in the default deny list.
FORBIDDEN_STATIC = {
    "metadata.test": "169.254.169.254",
    "rfc1918-10.test": "10.0.0.5",
    "rfc1918-172.test": "172.16.0.5",
    "rfc1918-192.test": "192.168.1.5",
    "cgnat.test": "100.64.0.5",
    "alibaba-metadata.test": "100.100.100.200",
    "azure-wireserver.test": "168.63.129.16",
    "ula.test": "fd00::5",
    "linklocal6.test": "fe80::5",
    "mapped-metadata.test": "::ffff:169.254.169.254",
    "nat64-metadata.test": "64:ff9b::a9fe:a9fe",
    "sixtofour-metadata.test": "2002:a9fe:a9fe::1",
}

# Addresses that get recording upstreams in the upstream namespace, all forbidden under the
# default deny list. (::ffff:169.254.169.254 reaches the IPv4 server on 169.254.169.254.)
FORBIDDEN_SERVED = [
    "169.254.169.254", "10.0.0.5", "172.16.0.5", "192.168.1.5", "100.64.0.5", "100.100.100.200",
    "168.63.129.16", "10.1.3.3", "fd00::5", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1",
]
LINK_LOCAL = "fe80::5"

PUBLIC_V4 = "93.184.216.34"
PUBLIC_V6 = "2606:4700::1111"
MIRROR = "10.1.2.3"

# /etc/hosts of the gateway namespace: names the gateway resolves with getaddrinfo.
HOSTS_FILE = f"""\
{PUBLIC_V4} public.example
{PUBLIC_V6} public6.example
{PUBLIC_V4} mixed.example
10.0.0.5 mixed.example
169.254.169.254 mixed-rev.example
{PUBLIC_V4} mixed-rev.example
{PUBLIC_V6} mixed6.example
fd00::5 mixed6.example
192.168.1.5 private.example
169.254.169.254 metadata.example
fd00::5 ula.example
"""


def _yaml_list(items) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def static_hosts_yaml(mapping: dict[str, list[str]]) -> str:
    return "\n".join(f"    {name}: {_yaml_list(addresses)}" for name, addresses in mapping.items())


DEFAULT_POLICY = f"""\
version: 1
network:
  deny_ip_ranges: default
resolver:
  static_hosts:
{static_hosts_yaml({**{k: [v] for k, v in FORBIDDEN_STATIC.items()},
                    "mixed-static.test": [PUBLIC_V4, "169.254.169.254"],
                    "gwself.test": [GATEWAY_OWN]})}
rules:
  - id: test-names
    hosts: ["*.test", "*.example"]
    schemes: [https, http]
  # Deny list beats rules: naming the metadata address itself allows nothing.
  - id: metadata-literal
    hosts: ["169.254.169.254", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "::a9fe:a9fe"]
    schemes: [https, http]
"""

MIRROR_POLICY = f"""\
version: 1
network:
  allow_ip_ranges: [10.1.2.0/24]
resolver:
  static_hosts:
    mirror.internal: ["{MIRROR}"]
    neighbour.internal: ["10.1.3.3"]
    metadata.internal: ["169.254.169.254"]
rules:
  - id: mirror
    hosts: [mirror.internal, neighbour.internal, metadata.internal]
    schemes: [https, http]
"""


def self_policy(port: int, loopback_port: int) -> str:
    return textwrap.dedent(f"""\
        version: 1
        network:
          allow_ip_ranges: [93.184.216.0/24, 127.0.0.0/8, 0.0.0.0/8]
        resolver:
          static_hosts:
            gw.test: ["{GATEWAY_OWN}"]
        rules:
          - id: gateway-itself
            hosts: ["{GATEWAY_OWN}", gw.test, "::ffff:{GATEWAY_OWN}", "127.0.0.0/8", "0.0.0.0/8",
                    "::ffff:127.0.0.1"]
            schemes: [https, http]
            ports: [{port}, {loopback_port}]
        """)


def wildcard_policy(port: int) -> str:
    return textwrap.dedent(f"""\
        version: 1
        network:
          allow_ip_ranges: [93.184.216.0/24, 127.0.0.0/8, 10.200.0.0/30]
        resolver:
          static_hosts:
            gw.test: ["{GATEWAY_OWN}"]
        rules:
          - id: gateway-itself
            hosts: ["{GATEWAY_OWN}", gw.test, "127.0.0.0/8", "10.200.0.0/30"]
            schemes: [https, http]
            ports: [{port}]
        """)


@pytest.fixture(scope="session")
def lab(pki):
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    lab = Lab(pki)
    try:
        lab.create()
    except Exception as exc:  # e.g. veth not supported by this kernel
        lab.destroy()
        pytest.skip(f"cannot build the namespace lab: {exc}")
    try:
        for address in FORBIDDEN_SERVED:
            lab.serve(address, names=["forbidden.test", "*.test"], forbidden=True)
        lab.serve_link_local(LINK_LOCAL, "linklocal6.test")
        lab.serve(PUBLIC_V4, names=["public.example", "mixed.example", "mixed-rev.example"], forbidden=False)
        lab.serve(PUBLIC_V6, names=["public6.example", "mixed6.example"], forbidden=False)
        lab.serve(MIRROR, names=["mirror.internal"], forbidden=False)
        # The gateway's own (non-listening) address gets recorders too, in the gateway namespace.
        lab.serve(GATEWAY_OWN, names=["gw.test"], forbidden=True, in_gateway_ns=True)
        lab.write_hosts(HOSTS_FILE)
        lab.check_closed()
        yield lab
    finally:
        lab.destroy()


@pytest.fixture(scope="session")
def gateways(lab, pki, tmp_path_factory):
    """gateways(key) -> a GatewayProcess running in the gateway namespace (started once per key)."""
    started: dict[str, GatewayProcess] = {}
    root = tmp_path_factory.mktemp("netns-gateways")

    def make(key: str) -> GatewayProcess:
        if key in started:
            return started[key]
        host, extra = "127.0.0.1", []
        if key == "default":
            port = lab.free_port(host)
            text = DEFAULT_POLICY
        elif key == "mirror":
            port = lab.free_port(host)
            text = MIRROR_POLICY
        elif key == "self":
            host = GATEWAY_OWN
            port = lab.free_port(host)
            loopback_port = lab.free_port("127.0.0.1")
            extra = ["--mode", f"regular@127.0.0.1:{loopback_port}"]
            text = self_policy(port, loopback_port)
        elif key == "wildcard":
            host = "0.0.0.0"
            port = lab.free_port(host)
            text = wildcard_policy(port)
        else:
            raise KeyError(key)
        workdir = root / key
        workdir.mkdir()
        policy = workdir / "policy.yaml"
        policy.write_text(text)
        gateway = GatewayProcess(policy, workdir, host=host, port=port, extra_args=extra,
                                 upstream_ca=pki.ca_cert, command_prefix=["ip", "netns", "exec", lab.gw])
        if extra:
            gateway.loopback_port = loopback_port
        started[key] = gateway.start()
        return gateway

    yield make
    for gateway in started.values():
        gateway.stop()


@pytest.fixture(autouse=True)
def _fresh_upstreams(request):
    if "lab" in request.fixturenames:
        request.getfixturevalue("lab").reset()
    yield


@pytest.fixture
def client_for(lab):
    def make(gateway) -> Client:
        return Client(lab, gateway)

    return make
