"""The harness itself: the network is closed, the sandboxes are what docker/sandbox-net.sh builds
(its `status` shows the rules), and each sandbox resolves only through its gateway."""

from __future__ import annotations

import pytest

from tests.support.topology import SANDBOX_NET_SH, run

pytestmark = pytest.mark.netns


def test_no_namespace_has_a_way_off_the_machine(topology):
    topology.check_closed()
    for ns in (topology.gw, topology.inet):
        route = run(["ip", "-n", ns, "route", "get", "1.1.1.1"], check=False)
        assert route.returncode != 0, f"{ns} has a route to 1.1.1.1: {route.stdout}"
    for sandbox in topology.sandboxes.values():
        route = run(["ip", "-n", sandbox.ns, "route", "get", "1.1.1.1"], check=False).stdout
        assert f"via {sandbox.gateway_address} dev eth0" in route, route


@pytest.mark.parametrize("key", ["main", "strict", "alpha", "beta"])
def test_sandbox_is_built_by_the_documented_script(topology, key):
    sandbox = topology.sandboxes[key]
    status = run(["bash", str(SANDBOX_NET_SH), "status"], env=sandbox.env()).stdout
    ports = sandbox.redirect_tcp_ports.replace(" ", ",")
    assert f"--dports {ports} -j REDIRECT --to-ports {sandbox.proxy_port}" in status, status
    assert f"--dport 53 -j REDIRECT --to-ports {sandbox.dns_port}" in status, status
    assert f"-A FORWARD -i {sandbox.host_if} -j DROP" in status, status
    assert f"-A INPUT -i {sandbox.host_if} -j DROP" in status, status
    resolv = sandbox.exec(["cat", "/etc/resolv.conf"]).stdout
    assert resolv.strip() == f"nameserver {sandbox.gateway_address}"
    env = sandbox.exec(["env"]).stdout.lower()
    assert "proxy=" not in env, "sandbox programs must run without proxy variables"
