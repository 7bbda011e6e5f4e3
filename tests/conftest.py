"""Shared fixtures: a test CA, recording upstream hosts on loopback, and gateway processes.

Each test session takes its own loopback block 127.X.0.0/24 (X from the process id, or from the
xdist controller's and the worker's number) and binds the
fake upstream hosts on ports 443 (TLS) and 80 there, so that parallel sessions do not collide and
policies can use the scheme's default ports like real ones.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import failure_logs
from tests.support.gateway import GatewayProcess
from bench.lib.pki import TestPKI
from tests.support.upstream import RecordingUpstream

# Every gateway a test starts is one process unless the test asks for `--workers N` itself
# (tests/workers): the suites check one process's behaviour, and a supervisor per test would only
# add start-up time. `egress-gateway run` defaults to the machine's cores otherwise.
os.environ.setdefault("EGRESS_WORKERS", "1")

UPSTREAM_NAMES = ("allowed.test", "other.test", "api.test", "deep.wild.test")


@dataclass
class Upstreams:
    block: str
    hosts: dict[str, str]  # name -> address
    tls: dict[str, RecordingUpstream] = field(default_factory=dict)
    plain: dict[str, RecordingUpstream] = field(default_factory=dict)

    def all(self) -> list[RecordingUpstream]:
        return [*self.tls.values(), *self.plain.values()]

    def reset(self) -> None:
        for server in self.all():
            server.reset()

    def untouched(self, *names: str) -> bool:
        """Nothing reached these hosts, a connection still in an accept queue included."""
        servers = [s for n in names for s in (self.tls.get(n), self.plain.get(n)) if s]
        for server in servers:
            server.settle()
        return not any(s.touched for s in servers)

    def static_hosts_yaml(self) -> str:
        return "\n".join(f"    {name}: [{address}]" for name, address in self.hosts.items())


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


def _block_octet() -> int:
    """X of this session's 127.X.0.0/24. Under pytest-xdist the workers of one run are numbered
    children of one controller, so they take consecutive blocks (pids alone may collide)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return 20 + (os.getppid() + int(worker[2:])) % 200
    return 20 + os.getpid() % 200


@pytest.fixture(scope="session")
def upstreams(pki) -> Upstreams:
    block = f"127.{_block_octet()}.0"
    hosts = {name: f"{block}.{i + 2}" for i, name in enumerate(UPSTREAM_NAMES)}
    result = Upstreams(block, hosts)
    for name, address in hosts.items():
        cert, key = pki.issue([name, f"*.{name}"], [address], stem=name)
        result.tls[name] = RecordingUpstream(name, address, 443, cert, key)
        result.plain[name] = RecordingUpstream(name, address, 80)
    yield result
    for server in result.all():
        server.stop()


def policy_text(upstreams: Upstreams, rules: str, extra: str = "") -> str:
    """A policy whose static_hosts point the test names at the recording upstreams."""
    return (
        "version: 1\n"
        "network:\n"
        "  allow_ip_ranges: [127.0.0.0/8]\n"
        "resolver:\n"
        "  static_hosts:\n"
        f"{upstreams.static_hosts_yaml()}\n"
        f"{textwrap.dedent(extra)}"
        "rules:\n"
        f"{textwrap.indent(textwrap.dedent(rules).strip(), '  ')}\n"
    )


@pytest.fixture
def start_gateway(request, tmp_path, pki, upstreams):
    """start_gateway(rules_yaml, extra="", args=[]) -> a running GatewayProcess; stopped after the test."""
    started: list[GatewayProcess] = []
    failure_logs.watch(request, started)

    def start(rules: str, extra: str = "", args: list[str] | None = None) -> GatewayProcess:
        policy = tmp_path / f"policy{len(started)}.yaml"
        policy.write_text(policy_text(upstreams, rules, extra))
        gateway = GatewayProcess(policy, tmp_path / f"gw{len(started)}", extra_args=args or [],
                                 upstream_ca=pki.ca_cert)
        started.append(gateway.start())
        upstreams.reset()
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The one failure hook: a failed test's report ends with the log of each gateway it used
    (what mitmproxy said about it; tests/support/failure_logs.py finds them)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.extend(failure_logs.log_sections(item))


def pytest_terminal_summary(terminalreporter):
    """The lines tests/deploy reports (image build times and sizes). Here, not in tests/deploy: under
    xdist the controller that prints the summary loads only this conftest."""
    lines = []
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for key, value in getattr(rep, "user_properties", ()):
                if key == "image-report" and getattr(rep, "when", "call") == "call" and value not in lines:
                    lines.append(value)
    if lines:
        terminalreporter.section("real images")
        for line in lines:
            terminalreporter.write_line(line)
