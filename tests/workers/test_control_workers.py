"""The control API with `run --workers N` (issue 17 item 3): the supervisor owns the API, every
worker holds a copy of the registrations, a change is in force in every worker when the call
returns, and a worker restarted by the supervisor gets the registrations of that moment.

Which worker decided is read from /proc (tests/workers/procs.py): each check makes connections
until every worker has served one, and every one of them must be decided by the new state.
"""

from __future__ import annotations

import os
import signal

import pytest

from gateway.commands.sandbox import ControlClient
from tests.conftest import policy_text
from tests.e2e.helpers import extra_static_hosts

from . import procs
from .harness import BASE_RULES, make_gateway, probe_http, probe_until_every_worker

pytestmark = pytest.mark.e2e

SANDBOXES = """
sandboxes:
  - id: default
    rules: []
  - id: agent
    rules: [web]
    grantable:
      rules: [slow]
"""


@pytest.fixture
def controlled(tmp_path, upstreams, pki, slow_upstream):
    started = []

    def start(workers: int = 2):
        socket_path = tmp_path / "control.sock"
        gateway = make_gateway(tmp_path / f"gw{len(started)}", upstreams, pki, workers, BASE_RULES,
                               ["--control", f"unix:{socket_path}"])
        gateway.policy.write_text(policy_text(upstreams, BASE_RULES,
                                              extra_static_hosts({"slow.test": f"{upstreams.block}.160"}) + SANDBOXES))
        started.append(gateway)
        gateway.start()
        upstreams.reset()
        return gateway, ControlClient(f"unix:{socket_path}")

    yield start
    for gateway in started:
        gateway.stop()


def every_worker(gateway, host: str = "allowed.test"):
    """One plain-HTTP request per fresh connection until every worker answered: {(status, reason)}."""
    results = probe_until_every_worker(gateway, lambda: probe_http(gateway, host))
    return {(r.status, r.reason) for r in results}, results


def explained(api, url: str) -> tuple:
    """The supervisor's `sandbox explain` for task-1: (verdict, reason, rule)."""
    status, body = api.explain("task-1", url)
    assert status == 200, body
    return body["verdict"], body["decision"]["reason"], body["decision"]["rule"]


def test_every_worker_sees_each_change_before_the_call_returns(controlled):
    gateway, api = controlled()
    assert every_worker(gateway)[0] == {(403, "no_rule")}
    status, body = api.register("task-1", ["127.0.0.1"], "agent")
    assert status == 201 and body["workers"] == 2, body
    decided, results = every_worker(gateway)
    assert decided == {(200, None)}, results
    clients = {r.client for r in results}
    lines = [e for e in gateway.audit_entries() if e.get("client") in clients and e.get("event") == "request"]
    assert {e["sandbox"] for e in lines} == {"task-1"}
    # a grant reaches every worker too; the supervisor explains what the workers then decide
    assert every_worker(gateway, "slow.test")[0] == {(403, "no_rule")}
    assert explained(api, "http://slow.test/") == ("deny", "no_rule", None)
    status, grant = api.grant("task-1", {"rule": "slow"})
    assert status == 201 and grant["workers"] == 2
    assert every_worker(gateway, "slow.test")[0] == {(200, None)}
    assert explained(api, "http://slow.test/") == ("allow", "allowed", "slow")
    status, body = api.revoke("task-1", grant["id"])
    assert body["workers"] == 2
    assert every_worker(gateway, "slow.test")[0] == {(403, "no_rule")}
    assert explained(api, "http://slow.test/") == ("deny", "no_rule", None)
    status, body = api.deregister("task-1")
    assert status == 200 and body["workers"] == 2
    assert every_worker(gateway)[0] == {(403, "no_rule")}
    # the supervisor wrote the control lines into the one audit log
    actions = [e["action"] for e in gateway.audit_entries() if e.get("event") == "control"]
    assert actions == ["register", "grant", "revoke", "deregister"]
    api.close()


def test_a_restarted_worker_gets_the_current_registrations(controlled):
    gateway, api = controlled()
    assert api.register("task-1", ["127.0.0.1"], "agent")[1]["workers"] == 2
    pids = gateway.worker_pids()
    victim = pids[0]
    victim_id = procs.identity(victim)
    os.kill(victim, signal.SIGKILL)
    procs.wait_for(lambda: procs.gone(victim_id), 5, what=f"worker {victim} to die")
    now = gateway.wait_serving(2, 40)
    assert victim not in now
    replacement = [p for p in now if p not in pids]
    assert replacement, now
    decided, results = every_worker(gateway)
    assert decided == {(200, None)}, results  # the replacement judged task-1 by its registration
    assert any(r.worker == replacement[0] for r in results)
    # and it takes the changes after its start
    assert api.deregister("task-1")[1]["workers"] == 2
    assert every_worker(gateway)[0] == {(403, "no_rule")}
    api.close()
