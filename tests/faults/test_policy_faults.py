"""The policy file breaks while the gateway runs: rewritten with a syntax error, cut short mid-write,
made invalid, replaced by binary junk, emptied, deleted, replaced by a directory. Each time the old
policy stays in force (allowed.test allowed, other.test denied), the failed reload is logged and
audited (`policy_reload`, `result: error`), and a valid file afterwards is picked up again.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from tests.conftest import policy_text
from tests.e2e.helpers import connect_proxy, get
from tests.support.waiting import wait_for

from .harness import make_gateway

ALLOW_ALLOWED = """
- id: allowed
  hosts: [allowed.test]
  schemes: [http]
"""
ALLOW_OTHER = """
- id: other
  hosts: [other.test]
  schemes: [http]
"""


def status(gateway, host: str) -> int:
    with connect_proxy(gateway) as conn:
        return get(conn, f"http://{host}/", host).status


def reload_errors(gateway) -> list[dict]:
    return [a for a in gateway.audit() if a["event"] == "policy_reload" and a.get("result") == "error"]


@pytest.fixture(scope="module")
def reloading(tmp_path_factory, upstreams, pki):
    gateway = make_gateway(tmp_path_factory.mktemp("reload"), upstreams, pki, ALLOW_ALLOWED,
                           args=["--set", "egress_policy_poll=1"])
    yield gateway
    gateway.stop()


def _replace(path, text: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text if isinstance(text, bytes) else text.encode())
    os.replace(tmp, path)


def _break_syntax(path):
    _replace(path, path.read_text() + "  - id: [unclosed\n")


def _cut_short(path):
    text = path.read_text()
    _replace(path, text[: text.index("hosts:") + 9])  # a writer stopped mid-line


def _invalid(path):
    _replace(path, path.read_text().replace("hosts: [allowed.test]", "hosts: ['*']"))


def _binary(path):
    _replace(path, b"\x00\xff\xfe junk \x80\x81" * 50)


def _empty(path):
    _replace(path, "")


def _deleted(path):
    path.unlink()


def _directory(path):
    path.unlink()
    path.mkdir()


BREAKAGES = {"syntax": _break_syntax, "cut-short": _cut_short, "invalid": _invalid, "binary": _binary,
             "empty": _empty, "deleted": _deleted, "directory": _directory}


@pytest.mark.parametrize("how", list(BREAKAGES))
def test_broken_policy_keeps_the_old_one(reloading, upstreams, how):
    gateway = reloading
    path = gateway.policy
    good = policy_text(upstreams, ALLOW_ALLOWED)
    before = len(reload_errors(gateway))
    assert (status(gateway, "allowed.test"), status(gateway, "other.test")) == (200, 403)
    try:
        BREAKAGES[how](path)
        gateway.process.send_signal(signal.SIGHUP)  # polling would find it too; this is quicker
        wait_for(lambda: len(reload_errors(gateway)) > before, 6.0, "a reload error", detail=lambda: gateway.log()[-2000:])
        error = reload_errors(gateway)[-1]
        assert error["decision"] == "deny" and error["reason"] == "policy_invalid"
        assert gateway.process.poll() is None
        upstreams.reset()
        # the old policy is in force, unchanged
        assert (status(gateway, "allowed.test"), status(gateway, "other.test")) == (200, 403)
        assert upstreams.untouched("other.test")
        assert "the current policy stays" in gateway.log()
    finally:
        if path.is_dir():
            shutil.rmtree(path)
        _replace(path, good)


def test_a_valid_policy_after_a_broken_one_is_installed(reloading, upstreams):
    gateway = reloading
    before = len(reload_errors(gateway))
    _deleted(gateway.policy)
    gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: len(reload_errors(gateway)) > before, 6.0, "the deleted policy's reload error",
             detail=lambda: gateway.log()[-2000:])
    _replace(gateway.policy, policy_text(upstreams, ALLOW_OTHER))
    gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: status(gateway, "other.test") == 200, 6.0, "other.test to be allowed")
    assert status(gateway, "allowed.test") == 403
    ok = [a for a in gateway.audit() if a["event"] == "policy_reload" and a.get("result") == "ok"]
    assert ok, gateway.audit()[-5:]
