"""What the revocation tests share (tests/e2e/test_revocation.py, tests/redteam/test_revocation.py):
origins that report when each connection closes, and a gateway whose policy a test rewrites and
reloads (SIGHUP, polling off: the test decides when a reload happens).

Origins, on this session's loopback block (.181-.185 belong to the revocation tests), certificates
from the session's test CA:
- ws.test    (.181): WebSocket echo, `wss` on 443 and `ws` on 80 (the `websockets` library's server)
- relay.test (.182): TLS echo on 443 with its own certificate: the far end of a passthrough tunnel
- kept.test  (.183): HTTP/1.1 keep-alive 200s, TLS on 443 and plain on 80: an inspected tunnel
- gone.test  (.184): the same, a second host whose rule a reload removes

Every wait here is on an event (an audit line written, a connection closed at an origin) with a
bound, never a sleep that hopes something happened.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import policy_text
from tests.e2e.helpers import extra_static_hosts
from tests.support.gateway import GatewayProcess
from tests.support.waiting import wait_for
from tests.support.watched import WatchedServer, WebSocketOrigin

WAIT = 10.0

BASE_RULES = """
- id: ws
  hosts: [ws.test]
  schemes: [https, http]
  paths: ["/ws/**"]
- id: relay
  hosts: [relay.test]
  inspect: false
- id: kept
  hosts: [kept.test]
  schemes: [https, http]
- id: gone
  hosts: [gone.test]
"""


@dataclass
class Origins:
    ws: WebSocketOrigin
    ws_plain: WebSocketOrigin
    relay: WatchedServer
    kept: WatchedServer
    kept_plain: WatchedServer
    gone: WatchedServer
    addresses: dict[str, str]

    def all(self) -> list:
        return [self.ws, self.ws_plain, self.relay, self.kept, self.kept_plain, self.gone]

    def reset(self) -> None:
        for server in self.all():
            server.reset()

    def stop(self) -> None:
        for server in self.all():
            server.stop()


_SHARED: dict[str, object] = {}  # one set of origins per process, however many modules import the fixture


@pytest.fixture(scope="session")
def origins(upstreams, pki):
    """Session-scoped, and imported by several test modules: pytest then holds one fixture per module,
    so the servers (fixed ports) are made once and shared, and stopped when the last user is done."""
    if "origins" not in _SHARED:
        _SHARED["origins"], _SHARED["users"] = _make_origins(upstreams, pki), 0
    _SHARED["users"] += 1
    yield _SHARED["origins"]
    _SHARED["users"] -= 1
    if not _SHARED["users"]:
        _SHARED.pop("origins").stop()


def _make_origins(upstreams, pki) -> Origins:
    block = upstreams.block
    addresses = {"ws.test": f"{block}.181", "relay.test": f"{block}.182", "kept.test": f"{block}.183",
                 "gone.test": f"{block}.184"}
    certs = {name: pki.issue([name], [address], stem=f"revoke-{name}") for name, address in addresses.items()}
    servers = Origins(
        WebSocketOrigin(addresses["ws.test"], 443, *certs["ws.test"]),
        WebSocketOrigin(addresses["ws.test"], 80),
        WatchedServer(addresses["relay.test"], 443, *certs["relay.test"], mode="echo"),
        WatchedServer(addresses["kept.test"], 443, *certs["kept.test"], mode="http"),
        WatchedServer(addresses["kept.test"], 80, mode="http"),
        WatchedServer(addresses["gone.test"], 443, *certs["gone.test"], mode="http"),
        addresses,
    )
    return servers


@dataclass
class ReloadableGateway:
    """A gateway process and its policy file; `reload` rewrites the file and signals SIGHUP."""

    process: GatewayProcess
    policy: Path
    upstreams: object
    origins: Origins
    reloads: int = 0
    marks: list[int] = field(default_factory=list)

    def text(self, rules: str, extra: str = "") -> str:
        hosts = extra_static_hosts(self.origins.addresses)
        return policy_text(self.upstreams, rules, hosts + extra)

    def reload(self, rules: str, extra: str = "") -> dict:
        """Install a new policy and return its `policy_reload` line (written before any revocation)."""
        self.policy.write_text(self.text(rules, extra))
        self.process.process.send_signal(signal.SIGHUP)
        self.reloads += 1
        lines = self.wait(lambda: len(self.lines(event="policy_reload", result="ok")) >= self.reloads,
                          "the policy_reload line")
        return lines[-1]

    def lines(self, **match) -> list[dict]:
        return [e for e in self.process.audit() if all(e.get(k) == v for k, v in match.items())]

    def wait(self, predicate, what: str, timeout: float = WAIT):
        """wait_for `predicate()` (the event happened), failing with the audit and log tails; the
        policy_reload ok lines."""
        wait_for(predicate, timeout, what, interval=0.02,
                 detail=lambda: f"audit tail: {self.process.audit()[-6:]}\nlog tail: {self.process.log()[-3000:]}")
        return self.lines(event="policy_reload", result="ok")

    def revoked(self, count: int = 1, **match) -> list[dict]:
        """Wait for `count` revocation lines (event connection, reason revoked) matching `match`."""
        match = {"event": "connection", "reason": "revoked", **match}
        self.wait(lambda: len(self.lines(**match)) >= count, f"{count} revocation line(s) {match}")
        return self.lines(**match)

    @property
    def metrics_url(self) -> str | None:
        args = self.process.extra_args
        return f"http://{args[args.index('--metrics') + 1]}/metrics" if "--metrics" in args else None


@pytest.fixture
def reloadable(tmp_path, pki, upstreams, origins):
    """reloadable(rules=BASE_RULES, extra="", args=[]) -> a running ReloadableGateway."""
    started: list[GatewayProcess] = []

    def start(rules: str = BASE_RULES, extra: str = "", args: list[str] | None = None) -> ReloadableGateway:
        policy = tmp_path / f"policy{len(started)}.yaml"
        process = GatewayProcess(policy, tmp_path / f"gw{len(started)}", upstream_ca=pki.ca_cert,
                                 extra_args=["--set", "egress_policy_poll=0", *(args or [])])
        gateway = ReloadableGateway(process, policy, upstreams, origins)
        policy.write_text(gateway.text(rules, extra))
        started.append(process.start())
        origins.reset()
        upstreams.reset()
        return gateway

    yield start
    for process in started:
        process.stop()


def without(rules: str, *ids: str) -> str:
    """BASE_RULES-style text with the rules of these ids left out (each rule starts with `- id:`)."""
    blocks = ("\n" + rules.strip()).split("\n- id: ")
    kept = [b for b in blocks[1:] if b.split("\n", 1)[0].strip() not in ids]
    return "".join(f"- id: {b}\n" for b in kept)
