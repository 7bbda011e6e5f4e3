"""Transparent mode: the closed namespace network the transparent-mode tests also build on
(lib/closed_net.py), with the benchmark's own names, one sandbox per proxy."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from lib.closed_net import ETC_NETNS, ClosedNetwork, Sandbox, unavailable_reason
from lib.names import ORIGIN_NAME, TRANSPARENT_DNS_PORTS, TRANSPARENT_ORIGIN_IP, TRANSPARENT_PORTS, TRANSPARENT_SANDBOX_INDEX


@dataclass
class TransparentNet:
    """Gateway + internet namespaces (lib/closed_net.py's ClosedNetwork, with names of its own:
    egb<tag>g, egb<tag>i) and one sandbox per proxy built by docker/sandbox-net.sh with GATEWAY_NS."""

    topology: object
    sandboxes: dict[str, object] = field(default_factory=dict)  # role -> Sandbox

    @classmethod
    def new(cls) -> "TransparentNet":
        """Names only; `build` creates the namespaces (keep the object first, so that a half-built
        network is still destroyed)."""
        topology = ClosedNetwork()
        # Names distinct from the tests' (egt...), so that a stray namespace is recognisably the benchmark's.
        topology.tag = f"{os.getpid() % 10000}{secrets.token_hex(2)}"
        topology.gw, topology.inet = f"egb{topology.tag}g", f"egb{topology.tag}i"
        topology.gw_if, topology.in_if = f"bg{topology.tag}", f"bi{topology.tag}"
        return cls(topology)

    def build(self) -> None:
        self.topology.create()  # checks that no namespace has a route off the machine
        self.topology.add_address(TRANSPARENT_ORIGIN_IP)  # on the internet namespace's lo, routed from the gateway ns
        self.topology.check_closed()

    def add_sandbox(self, role: str):
        t = self.topology
        index = TRANSPARENT_SANDBOX_INDEX[role]
        sandbox = Sandbox(role, f"egb{t.tag}s{index}", f"bh{t.tag}{index}"[:15], index, TRANSPARENT_PORTS[role],
                          TRANSPARENT_DNS_PORTS[role], t.gw)
        t.sandboxes[role] = self.sandboxes[role] = sandbox
        sandbox.up()  # docker/sandbox-net.sh up, with GATEWAY_NS
        # The sandbox resolves the origin through its own hosts file (`ip netns exec` bind-mounts it);
        # the gateway's DNS mode is not what is measured.
        (ETC_NETNS / sandbox.ns / "hosts").write_text(
            f"127.0.0.1 localhost\n{TRANSPARENT_ORIGIN_IP} {ORIGIN_NAME}\n")
        t.check_closed()
        return sandbox

    def destroy(self) -> list[str]:
        """Remove everything; returns whatever of ours is still present (should be empty)."""
        self.topology.destroy()
        return self.topology.leftovers()


def transparent_unavailable() -> str | None:
    return unavailable_reason()
