"""Gateways with `--workers N`: a supervisor process and N worker processes sharing one port.

Everything runs on loopback: the session's recording upstreams (tests/conftest.py) and a slow plain
HTTP upstream of this suite at <block>.160 (slow.test). Which worker served a connection is read
from /proc (tests/workers/procs.py), never from the gateway's own output, so a test can make
sure it has exercised every worker.
"""

from __future__ import annotations

import pytest

from .harness import BASE_RULES, SlowUpstream, WorkerGateway, log_tail, make_gateway


@pytest.fixture(scope="session")
def slow_upstream(upstreams):
    server = SlowUpstream(f"{upstreams.block}.160")
    yield server
    server.stop()


@pytest.fixture
def worker_gateway(request, tmp_path, upstreams, pki, slow_upstream):
    """worker_gateway(workers=2, rules=BASE_RULES, args=[], expect=None, env={}, prefix=[], metrics=False)."""
    started: list[WorkerGateway] = []
    request.node.egress_gateways = started

    def start(workers: int | None = 2, rules: str = BASE_RULES, args: list[str] | None = None,
              expect: int | None = None, env: dict | None = None, prefix: list[str] | None = None,
              metrics: bool = False) -> WorkerGateway:
        gateway = make_gateway(tmp_path / f"gw{len(started)}", upstreams, pki, workers, rules, args, expect, env,
                               prefix, metrics)
        started.append(gateway)
        gateway.start()
        upstreams.reset()
        slow_upstream.reset()
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the end of each gateway's log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        gateways = list(getattr(item, "egress_gateways", []))
        gateways += [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, WorkerGateway)]
        for gateway in gateways:
            report.sections.append((f"gateway log {gateway.workdir}", log_tail(gateway, 60)))
