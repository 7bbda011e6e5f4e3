"""The closed three-namespace network of the transparent- and DNS-mode tests and of bench/'s
transparent group: no recorders, no upstreams, only the namespaces, their links and routes, and the
sandboxes built by the documented script. The tests' world on top of it (recorders, the test CA's
upstreams, sockets from inside a namespace) is tests/support/topology.py; bench/lib/transparent.py
uses it as it is. Standard library only: it imports as `lib.closed_net` and as `bench.lib.closed_net`.

    [sandbox ns SB*]  built by docker/sandbox-net.sh (the documented script, run with GATEWAY_NS set)
        eth0 10.203.K.2/24, default route via 10.203.K.1, resolv.conf -> 10.203.K.1, IPv6 off
            |  veth made by the script
        HOST_IF 10.203.K.1/24
    [gateway ns GW]  the gateway processes run here; iptables REDIRECT/DROP rules from the script;
        ip_forward=1 (as on a typical Docker host), so only the script's FORWARD drops stop the
        sandbox from routing around the gateway
        veth GW_IF 10.210.0.1/30, fd99::1/64      /etc/netns/GW/resolv.conf -> TRAP_RESOLVER
            |  veth between the two test namespaces, nothing else
        veth IN_IF 10.210.0.2/30, fd99::2/64
    [internet ns IN]  lo: every upstream address; routes back to the sandboxes (so that a packet the
        gateway wrongly forwarded would arrive, and a recorder there would count it)

None of the namespaces has a link to the host namespace or a route off the machine (checked by
`check_closed` before any traffic).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
SANDBOX_NET_SH = PROJECT_ROOT / "docker" / "sandbox-net.sh"

GW_V4, IN_V4 = "10.210.0.1", "10.210.0.2"
GW_V6, IN_V6 = "fd99::1", "fd99::2"

TRAP_RESOLVER = "93.184.216.53"  # where the gateway namespace's resolv.conf points: must never hear a thing

PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy"}


def run(argv: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({result.returncode}): "
                           f"{result.stderr.strip()} {result.stdout.strip()}")
    return result


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *args], check=check)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for programs in a sandbox: no proxy variables at all (transparent mode),
    no pip/requests CA overrides."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in PROXY_VARS and not k.startswith(("PIP_", "REQUESTS_", "SSL_CERT", "CURL_"))}
    env.update(extra)
    return env


def unavailable_reason() -> str | None:
    if not hasattr(os, "setns"):
        return "os.setns is unavailable (needs Python 3.12 on Linux)"
    if os.geteuid() != 0:
        return "transparent-mode tests need root"
    for tool in ("ip", "bash"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not (shutil.which("iptables") or shutil.which("iptables-legacy")):
        return "iptables is not installed"
    probe = f"egtprobe{os.getpid()}x{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        works = any(
            shutil.which(tool) and run(["ip", "netns", "exec", probe, tool, "-t", "nat", "-L", "-n"],
                                       check=False).returncode == 0
            for tool in ("iptables", "iptables-legacy"))
        if not works:
            return "iptables (nat table) does not work inside a network namespace here"
    finally:
        ip("netns", "del", probe, check=False)
    return None

# -- the sandboxes, built by the documented script ------------------------------------------------


@dataclass
class Sandbox:
    key: str
    ns: str
    host_if: str
    index: int  # K in 10.203.K.0/24
    proxy_port: int
    dns_port: int
    gateway_ns: str
    redirect_tcp_ports: str = "80 443"
    is_up: bool = False

    @property
    def address(self) -> str:
        return f"10.203.{self.index}.2"

    @property
    def gateway_address(self) -> str:
        return f"10.203.{self.index}.1"

    @property
    def subnet(self) -> str:
        return f"10.203.{self.index}.0/24"

    def env(self) -> dict[str, str]:
        return dict(os.environ, SANDBOX_NS=self.ns, GATEWAY_NS=self.gateway_ns, HOST_IF=self.host_if,
                    SANDBOX_ADDR=f"{self.address}/24", GATEWAY_ADDR=f"{self.gateway_address}/24",
                    PROXY_PORT=str(self.proxy_port), DNS_PORT=str(self.dns_port),
                    REDIRECT_TCP_PORTS=self.redirect_tcp_ports)

    def up(self) -> None:
        self.is_up = True  # even a half-built sandbox gets `down`
        run(["bash", str(SANDBOX_NET_SH), "up"], env=self.env())

    def down(self) -> None:
        run(["bash", str(SANDBOX_NET_SH), "down"], env=self.env(), check=False)
        # If the script died between creating the veth and moving it, its host end is still here.
        if Path(f"/sys/class/net/{self.host_if}").exists():
            ip("link", "del", self.host_if, check=False)
        ip("netns", "del", self.ns, check=False)
        shutil.rmtree(ETC_NETNS / self.ns, ignore_errors=True)

    def exec(self, argv: list[str], timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
        """Run a program inside the sandbox (no proxy variables in its environment)."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, env=clean_env(**env), cwd="/")

# -- the whole network -----------------------------------------------------------------------------


def link_pair(*ends: tuple[str, str, str, str]) -> None:
    """Two namespaces joined by one veth and nothing else: each end (namespace, interface, IPv4 of
    a /30, IPv6 of a /64) gets its address and its loopback up. tests/netns/lab.py builds on it too."""
    (ns_a, if_a, _, _), (ns_b, if_b, _, _) = ends
    ip("link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
    for ns, ifname, v4, v6 in ends:
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "set", ifname, "up")
        ip("-n", ns, "addr", "add", f"{v4}/30", "dev", ifname)
        ip("-n", ns, "-6", "addr", "add", f"{v6}/64", "dev", ifname, "nodad")


class ClosedNetwork:
    def __init__(self):
        self.tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.gw = f"egt{self.tag}g"
        self.inet = f"egt{self.tag}i"
        self.gw_if = f"tg{self.tag}"
        self.in_if = f"ti{self.tag}"
        self.sandboxes: dict[str, Sandbox] = {}
        self._namespaces: list[str] = []

    def create(self) -> "ClosedNetwork":
        for ns in (self.gw, self.inet):
            ip("netns", "add", ns)
            self._namespaces.append(ns)
        link_pair((self.gw, self.gw_if, GW_V4, GW_V6), (self.inet, self.in_if, IN_V4, IN_V6))
        # The internet knows its way back to the sandboxes (only through the gateway namespace):
        # if the gateway ever forwarded a sandbox packet, TCP handshakes would complete.
        ip("-n", self.inet, "route", "add", "10.203.0.0/16", "via", GW_V4)
        ip("-n", self.inet, "-6", "route", "add", "fd10::/16", "via", GW_V6)
        # A gateway host usually forwards (Docker turns it on): the script's drops must hold anyway.
        run(["ip", "netns", "exec", self.gw, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=False)
        run(["ip", "netns", "exec", self.gw, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"], check=False)
        etc = ETC_NETNS / self.gw
        etc.mkdir(parents=True, exist_ok=True)
        # Names the gateway resolves itself come from the policy's static_hosts; anything it looks up
        # with getaddrinfo would go to the trap resolver, which records and never answers.
        (etc / "resolv.conf").write_text(f"nameserver {TRAP_RESOLVER}\noptions timeout:1 attempts:1\n")
        (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
        self.check_closed()
        return self

    def add_sandbox(self, key: str, index: int, proxy_port: int, dns_port: int,
                    redirect_tcp_ports: str = "80 443") -> Sandbox:
        sandbox = Sandbox(key, f"egt{self.tag}s{index}", f"eh{self.tag}{index}"[:15], index, proxy_port, dns_port,
                          self.gw, redirect_tcp_ports)
        self.sandboxes[key] = sandbox
        sandbox.up()
        self.check_closed()
        return sandbox

    def destroy(self) -> None:
        for sandbox in self.sandboxes.values():
            if sandbox.is_up:
                sandbox.down()
        for ns in reversed(self._namespaces):
            ip("netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / self.gw, ignore_errors=True)
        with contextlib.suppress(OSError):
            ETC_NETNS.rmdir()  # only if empty

    def leftovers(self) -> list[str]:
        """Anything of ours still present after destroy (namespaces, /etc/netns dirs, host links)."""
        found = [ns for ns in run(["ip", "netns", "list"]).stdout.split() if self.tag in ns]
        found += [str(p) for p in ETC_NETNS.glob(f"*{self.tag}*")] if ETC_NETNS.exists() else []
        found += [p.name for p in Path("/sys/class/net").iterdir() if self.tag in p.name]
        return found

    def check_closed(self) -> None:
        """Refuse to go on if any namespace has a way off the machine."""
        allowed_links = {self.gw: {"lo", self.gw_if, *(s.host_if for s in self.sandboxes.values())},
                         self.inet: {"lo", self.in_if}}
        for s in self.sandboxes.values():
            allowed_links[s.ns] = {"lo", "eth0"}
        for ns, links_ok in allowed_links.items():
            if not (NETNS_DIR / ns).exists():
                continue
            for family in ("-4", "-6"):
                routes = run(["ip", "-n", ns, family, "route", "show", "table", "all"], check=False).stdout
                for line in routes.splitlines():
                    if line.startswith("default") or " default " in f" {line} ":
                        sandbox = next((s for s in self.sandboxes.values() if s.ns == ns), None)
                        if sandbox and family == "-4" and f"via {sandbox.gateway_address} " in f"{line} ":
                            continue  # the sandbox's default route points at the gateway namespace
                        if line.startswith(("local ", "multicast ", "unreachable ")) or "table local" in line:
                            continue
                        if family == "-6" and ("dev lo" in line or line.startswith(("anycast", "ff00::/8"))):
                            continue
                        raise RuntimeError(f"namespace {ns} has a default route: {line}")
            links = run(["ip", "-n", ns, "-o", "link"]).stdout
            for line in links.splitlines():
                name = line.split(":")[1].strip().split("@")[0]
                if name not in links_ok:
                    raise RuntimeError(f"namespace {ns} has an unexpected link {name!r}")
        # Nothing of ours is left in the host namespace.
        for sandbox in self.sandboxes.values():
            if Path(f"/sys/class/net/{sandbox.host_if}").exists():
                raise RuntimeError(f"{sandbox.host_if} is still in the host namespace")

    def add_address(self, address: str) -> None:
        if ":" in address:
            ip("-n", self.inet, "-6", "addr", "add", f"{address}/128", "dev", "lo", "nodad")
            ip("-n", self.gw, "-6", "route", "add", f"{address}/128", "via", IN_V6)
        else:
            ip("-n", self.inet, "addr", "add", f"{address}/32", "dev", "lo")
            ip("-n", self.gw, "route", "add", f"{address}/32", "via", IN_V4)
