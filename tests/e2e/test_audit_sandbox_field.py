"""The `sandbox` field of connection refusals (review of issue 15): `too_many_connections` and
`connection_rate_limited` lines wrote the limiter key's tail, so a client no sandbox covers got
the string "None" and a policy without sandboxes got the client's IP. It is the scope's sandbox:
its id, or null."""

from __future__ import annotations

import socket

import pytest

from addons.audit_fields import fallback_fields
from tests.e2e.helpers import Conn
from tests.support.waiting import wait_for

RULES = """
- id: plain
  hosts: [allowed.test]
  schemes: [http]
"""
COVERED, UNCOVERED = 241, 242  # this helper's loopback octets


def _sandboxes(upstreams) -> str:
    return f"sandboxes:\n  - id: b\n    source_ips: [{upstreams.block}.{COVERED}/32]\n    rules: [plain]\n"


def _from(gateway, source: str) -> Conn:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect((gateway.host, gateway.port))
    return Conn(sock)


def _refusal(gateway, reason: str, client_ip: str, wait: float = 5.0) -> dict:
    return wait_for(lambda: [a for a in gateway.audit()
                             if a.get("reason") == reason and a["client"].startswith(client_ip + ":")],
                    wait, f"a {reason} line of {client_ip}", interval=0.02,
                    detail=lambda: repr(gateway.audit()[-5:]))[0]


LIMITS = {
    "too_many_connections": ["--set", "egress_max_connections_per_sandbox=1"],
    "connection_rate_limited": ["--set", "egress_max_new_connections_per_second_per_sandbox=0.001",
                                "--set", "egress_new_connection_burst_per_sandbox=1"],
}


@pytest.mark.parametrize("reason", sorted(LIMITS))
@pytest.mark.parametrize("octet, sandboxed, expected", [
    (UNCOVERED, True, None),  # was the string "None"
    (COVERED, True, "b"),
    (UNCOVERED, False, None),  # was the client's IP address
])
def test_connection_refusals_name_the_scope_sandbox_or_null(start_gateway, upstreams, reason, octet, sandboxed,
                                                             expected):
    gateway = start_gateway(RULES, extra=_sandboxes(upstreams) if sandboxed else "", args=LIMITS[reason])
    source = f"{upstreams.block}.{octet}"
    first = _from(gateway, source)
    try:
        second = _from(gateway, source)
        second.close()
        line = _refusal(gateway, reason, source)
    finally:
        first.close()
    assert line["event"] == "connection" and line["sandbox"] == expected, line


class _State:
    def __init__(self, connections, engine=None, scope=None):
        self.connections, self.engine, self._scope = connections, engine, scope

    def scope(self, conn):
        if self._scope is None:
            raise RuntimeError("no engine")
        return self._scope


class _ClientConn:
    id = "c1"
    peername = ("127.0.0.9", 4242)


def test_fallback_refusals_name_the_client_and_sandbox_when_known():
    from types import SimpleNamespace

    from addons.state import ClientSession

    conn = ClientSession(client="127.0.0.9:4242", mode="regular")
    fields = fallback_fields(_State({"c1": conn}, engine=object(), scope=SimpleNamespace(sandbox="ci")), _ClientConn())
    assert (fields["client"], fields["sandbox"], fields["mode"]) == ("127.0.0.9:4242", "ci", "regular")
    # Nothing known but the socket: the client still; a failing lookup never raises.
    fields = fallback_fields(_State({}), _ClientConn())
    assert (fields["client"], fields["sandbox"]) == ("127.0.0.9:4242", None)
    fields = fallback_fields(_State({"c1": conn}, engine=object(), scope=None), _ClientConn())
    assert (fields["client"], fields["sandbox"]) == ("127.0.0.9:4242", None)


def test_the_line_cap_is_an_option(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_audit_max_line_bytes=4096"])
    with _from(gateway, f"{upstreams.block}.{UNCOVERED}") as conn:
        from tests.e2e.helpers import get

        assert get(conn, "http://allowed.test/" + "p" * 2000 + "?q=" + "x" * 2000, "allowed.test",
                   extra=[("X-Pad", "y")]).status == 200
        client = conn.client
    wait_for(lambda: [a for a in gateway.audit() if a["client"] == client], 5, f"the audit lines of {client}")
    raws = [raw for raw in gateway.audit_path.read_bytes().splitlines() if client.encode() in raw]
    assert raws and all(len(raw) <= 4096 for raw in raws), [len(r) for r in raws]
    assert "path" in __import__("json").loads(raws[0])["truncated"]
