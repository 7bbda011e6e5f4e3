"""The red-team suite: markers, the attack summary, and the gateways every module shares.

- `rt` (session): one explicit-mode gateway on loopback (with --metrics) in front of the standard
  recording upstreams (allowed.test, other.test, api.test, deep.wild.test) plus the red-team ones:
  upstreams with bad certificates, credential echo upstreams (tests.credentials.servers), a
  reflecting upstream, and a rogue plain-HTTP upstream that answers with an unsolicited 101.
  `other.test` has no rule at all: it is the forbidden destination.
- `world` (session): the namespace topology for transparent mode and non-loopback addresses
  (tests/redteam/world.py), built only when a test asks for it.

The summary (pytest_terminal_summary) counts the tests marked `redteam` that ran in this session,
per category, and ends with exactly `N attacks, M bypasses` where a bypass is a failed attack.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest

from tests.credentials.clients import leaks
from tests.credentials.servers import EchoUpstream
from tests.e2e.helpers import ScriptedUpstream, extra_static_hosts, shared_gateway
from tests.support.gateway import GatewayProcess, free_port

from .common import CATEGORIES, marker_name
from .servers import ReflectingUpstream, bad_tls_upstream

# --- markers and the summary ------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "redteam: an attack on the egress gateway (tests/redteam)")
    config.addinivalue_line("markers", "attack(category): the red-team category of an attack")
    for category, what in CATEGORIES.items():
        config.addinivalue_line("markers", f"{marker_name(category)}: red-team attacks: {what}")


# nodeid -> category of the collected red-team attacks; nodeid -> (category, outcome) of those run
# (outcome: passed = the attack held, failed = a bypass, error = could not run, skipped); nodeids
# whose teardown failed after the attack ran (infrastructure, reported separately)
_CATEGORIES: dict[str, str] = {}
_OUTCOMES: dict[str, tuple[str, str]] = {}
_TEARDOWN_ERRORS: list[str] = []


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if item.get_closest_marker("redteam") is not None:
            mark = item.get_closest_marker("attack")
            _CATEGORIES[item.nodeid] = mark.args[0] if mark and mark.args else "uncategorised"


def pytest_runtest_logreport(report):
    if report.nodeid not in _CATEGORIES:
        return
    outcomes = _OUTCOMES
    category = _CATEGORIES[report.nodeid]
    if report.when == "setup":
        if report.failed:
            outcomes[report.nodeid] = (category, "error")
        elif report.skipped:
            outcomes[report.nodeid] = (category, "skipped")
    elif report.when == "call":
        outcomes[report.nodeid] = (category, "failed" if report.failed else "skipped" if report.skipped else "passed")
    elif report.when == "teardown" and report.failed:
        _TEARDOWN_ERRORS.append(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    outcomes = _OUTCOMES
    if not outcomes:
        return
    table: dict[str, Counter] = defaultdict(Counter)
    for category, outcome in outcomes.values():
        table[category][outcome] += 1
    write = terminalreporter.write_line
    terminalreporter.section("egress gateway red team")
    write(f"{'category':<13} {'attacks':>7} {'held':>5} {'bypass':>6} {'error':>5} {'skip':>5}  what")
    order = [c for c in CATEGORIES if c in table] + sorted(c for c in table if c not in CATEGORIES)
    total = Counter()
    for category in order:
        counts = table[category]
        total.update(counts)
        ran = counts["passed"] + counts["failed"]
        write(f"{category:<13} {ran:>7} {counts['passed']:>5} {counts['failed']:>6} {counts['error']:>5} "
              f"{counts['skipped']:>5}  {CATEGORIES.get(category, '')}")
    failed = [nodeid for nodeid, (_c, outcome) in outcomes.items() if outcome == "failed"]
    for nodeid in failed:
        write(f"BYPASS: {nodeid}", red=True)
    errors = [nodeid for nodeid, (_c, outcome) in outcomes.items() if outcome == "error"]
    for nodeid in errors:
        write(f"COULD NOT RUN (setup error): {nodeid}", yellow=True)
    for nodeid in _TEARDOWN_ERRORS:
        write(f"teardown error after the attack ran: {nodeid}", yellow=True)
    if total["skipped"]:
        write(f"{total['skipped']} attack(s) skipped")
    ran = total["passed"] + total["failed"]
    write(f"{ran} attacks, {total['failed']} bypasses", bold=True, red=bool(total["failed"]), green=not total["failed"])


# --- the explicit-mode gateway on loopback ------------------------------------------------------

SECRETS = {
    "api_token": "rt-Tok9+Zq/Ww3=Ee5&Rr7_live",
    "query_key": "rt-qk 4Xx/8Yy+2Zz=6Vv?1Uu#",
}
ENV = {"api_token": "EGRESS_RT_API_TOKEN", "query_key": "EGRESS_RT_QUERY_KEY"}

# last octet in the session's 127.X.0.0/24 block -> names served there
EXTRA = {
    "expired.test": 30, "wrongname.test": 31, "selfsigned.test": 32,
    "echo.test": 33, "qecho.test": 33, "mirror.test": 34, "reflect.test": 35, "rogue.test": 36,
}

RULES = """
- id: allowed
  hosts: [allowed.test, alias.test]
  schemes: [https, http]
- id: api
  hosts: [api.test]
  schemes: [https, http]
  methods: [GET, HEAD]
  paths: ["/ok/**"]
- id: wild
  hosts: ["*.wild.test"]
- id: idn
  hosts: [bücher.test]
  schemes: [https, http]
- id: ip-literal
  hosts: ["{allowed_ip}"]
  schemes: [https, http]
- id: self
  hosts: [self.test, 127.0.0.1, "::ffff:127.0.0.1", 0.0.0.0, "::", "::ffff:0.0.0.0"]
  schemes: [https, http]
  ports: [{gw_port}, {metrics_port}]
- id: badtls
  hosts: [expired.test, wrongname.test, selfsigned.test]
  inject:
    - header: X-Api-Key
      value: "${secrets.api_token}"
- id: echo
  hosts: [echo.test]
  methods: [GET, POST, HEAD, OPTIONS]
  paths: ["/v1/**"]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.api_token}"
- id: qecho
  hosts: [qecho.test]
  paths: ["/v1/**"]
  inject:
    - query: api_key
      value: "${secrets.query_key}"
- id: mirror
  hosts: [mirror.test]
- id: reflect
  hosts: [reflect.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.api_token}"
- id: rogue
  hosts: [rogue.test]
  schemes: [http]
"""


@dataclass
class RedTeam:
    gateway: GatewayProcess
    upstreams: object  # tests.conftest.Upstreams
    servers: dict[str, object]  # label -> extra recorder
    metrics_port: int
    secrets: dict[str, str] = field(default_factory=lambda: dict(SECRETS))

    def ip(self, name: str) -> str:
        return self.upstreams.hosts[name]

    def recorders(self, *names: str) -> dict[str, object]:
        """label -> recorder for standard upstream names (tls and plain) and extra server labels."""
        found = {}
        for name in names:
            if name in self.upstreams.tls:
                found[f"{name}:443"] = self.upstreams.tls[name]
                found[f"{name}:80"] = self.upstreams.plain[name]
            else:
                found[name] = self.servers[name]
        return found

    def everything(self) -> dict[str, object]:
        return self.recorders(*self.upstreams.tls, *self.servers)

    def reset(self) -> None:
        self.upstreams.reset()
        for server in self.servers.values():
            server.reset()


@pytest.fixture(scope="session")
def rt(tmp_path_factory, upstreams, pki):
    block = upstreams.block
    servers: dict[str, object] = {}
    for kind in ("expired", "wrongname", "selfsigned"):
        name = f"{kind}.test"
        servers[name] = bad_tls_upstream(pki, kind, name, f"{block}.{EXTRA[name]}")
    cert, key = pki.issue(["echo.test", "qecho.test"], [f"{block}.33"], stem="redteam-echo")
    servers["echo"] = EchoUpstream("echo", f"{block}.33", 443, cert, key)
    cert, key = pki.issue(["mirror.test"], [f"{block}.34"], stem="redteam-mirror")
    servers["mirror"] = EchoUpstream("mirror", f"{block}.34", 443, cert, key)
    cert, key = pki.issue(["reflect.test"], [f"{block}.35"], stem="redteam-reflect")
    servers["reflect"] = ReflectingUpstream("reflect.test", f"{block}.35", cert, key)
    servers["rogue"] = ScriptedUpstream(f"{block}.36", b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n"
                                        b"Connection: Upgrade\r\n\r\nRAW-BYTES-AFTER-101", port=80)

    gw_port, metrics_port = free_port(), free_port()
    allowed_ip = upstreams.hosts["allowed.test"]
    rules = RULES.replace("{allowed_ip}", allowed_ip).replace("{metrics_port}", str(metrics_port))
    static = {"alias.test": allowed_ip, "bücher.test": allowed_ip, "self.test": "127.0.0.1"}
    static |= {name: f"{block}.{last}" for name, last in EXTRA.items()}
    extra = extra_static_hosts(static) + "secrets:\n" + "".join(
        f"  {name}: {{env: {var}}}\n" for name, var in ENV.items())
    patch = pytest.MonkeyPatch()
    try:
        for name, var in ENV.items():
            patch.setenv(var, SECRETS[name])
        # Every refusal its own audit line: the attacks check their own lines, and hundreds of them
        # from one client in a few seconds tripped the refusal aggregation (a 'suppressed' summary
        # instead: two CI rehearsals lost a method-override test's line so), which
        # tests/faults/test_audit_flood.py tests on its own.
        gateway = shared_gateway(tmp_path_factory, upstreams, pki, rules, extra, port=gw_port, name="redteam",
                                 args=["--metrics", f"127.0.0.1:{metrics_port}",
                                       "--set", "egress_audit_max_refusals_per_second_per_sandbox=0",
                                       "--set", "egress_audit_max_refusals_per_second_per_key=0",
                                       "--set", "egress_audit_max_refusals_per_second=0"])
    finally:
        patch.undo()
    state = RedTeam(gateway, upstreams, servers, metrics_port)
    yield state
    gateway.stop()
    for server in servers.values():
        server.stop()


@pytest.fixture(autouse=True)
def _fresh_recorders(request):
    """Every attack starts with empty recorders (the shared gateways are not restarted)."""
    if "rt" in request.fixturenames:
        request.getfixturevalue("rt").reset()
    if "world" in request.fixturenames:
        request.getfixturevalue("world").topology.reset()
    yield


@pytest.fixture(scope="session")
def world():
    from .world import build_world

    yield from build_world()


# --- the client-side secret oracle, for every attack on the gateway that holds secrets ------------

_RECEIVED: list[bytes] | None = None


def _recording(original):
    def recv(self, *args, **kwargs):
        data = original(self, *args, **kwargs)
        # Only the test's own (client) sockets: the upstream servers read in their own threads,
        # and they legitimately receive the injected secrets.
        if _RECEIVED is not None and isinstance(data, bytes) and threading.current_thread() is threading.main_thread():
            _RECEIVED.append(data)
        return data

    return recv


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Every attack that uses `rt` (a gateway holding secrets) also asserts, from the client side,
    that no form of any secret arrived on any socket the test read from (HTTP/1, HTTP/2, TLS
    records, refusals): everything received is searched with tests.credentials.clients.leaks."""
    global _RECEIVED
    if "rt" not in getattr(item, "fixturenames", ()):
        yield
        return
    had_own = "recv" in vars(socket.socket)
    plain_recv, tls_recv = socket.socket.recv, ssl.SSLSocket.recv
    socket.socket.recv = _recording(plain_recv)
    ssl.SSLSocket.recv = _recording(tls_recv)
    _RECEIVED = []
    try:
        outcome = yield
    finally:
        received, _RECEIVED = b"".join(_RECEIVED or []), None
        ssl.SSLSocket.recv = tls_recv
        if had_own:
            socket.socket.recv = plain_recv
        else:
            del socket.socket.recv
    if outcome.excinfo is None and received:
        found = {name: leaks(received, value)[:4] for name, value in SECRETS.items()}
        found = {name: forms for name, forms in found.items() if forms}
        if found:
            outcome.force_exception(AssertionError(
                f"a secret came back to the client ({len(received)} bytes received): {found}"))
