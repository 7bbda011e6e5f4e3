"""Gateways with `--workers N`: a supervisor process and N worker processes sharing one port.

Everything runs on loopback: the session's recording upstreams (tests/conftest.py) and a slow plain
HTTP upstream of this suite at <block>.160 (slow.test). Which worker served a connection is read
from /proc (tests/workers/procs.py), never from the gateway's own output, so a test can make
sure it has exercised every worker.
"""

from __future__ import annotations

import pytest

from tests.support import failure_logs

from .harness import BASE_RULES, SlowUpstream, WorkerGateway, make_gateway


@pytest.fixture(scope="session")
def slow_upstream(upstreams):
    server = SlowUpstream(f"{upstreams.block}.160")
    yield server
    server.stop()


@pytest.fixture
def worker_gateway(request, tmp_path, upstreams, pki, slow_upstream):
    """worker_gateway(workers=2, rules=BASE_RULES, args=[], expect=None, env={}, prefix=[], metrics=False)."""
    started: list[WorkerGateway] = []
    failure_logs.watch(request, started)

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
