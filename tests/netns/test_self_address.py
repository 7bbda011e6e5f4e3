"""The gateway never dials itself: its listening sockets are refused even when a rule and
allow_ip_ranges cover them, whatever spelling names them; its other addresses are refused when
no exemption covers them."""

from __future__ import annotations

import pytest

from .conftest import GATEWAY_OWN
from .lab import assert_refused, audit_since

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def self_gateway(gateways):
    """Listens on 93.184.216.1:P and 127.0.0.1:L; rules and allow_ip_ranges cover both."""
    return gateways("self")


def _listener_authorities(gw) -> list[str]:
    p, lp = gw.port, gw.loopback_port
    return [
        f"{GATEWAY_OWN}:{p}",
        f"gw.test:{p}",
        f"1572395009:{p}",  # 93.184.216.1 as one number
        f"[::ffff:{GATEWAY_OWN}]:{p}",
        f"127.0.0.1:{lp}",
        f"[::ffff:127.0.0.1]:{lp}",
    ]


def test_connect_to_own_listener(lab, self_gateway, client_for):
    for authority in _listener_authorities(self_gateway):
        mark = len(self_gateway.audit())
        reply = client_for(self_gateway).connect_only(authority)
        assert_refused(lab, reply, "self_address")
        # One decision, for our own request: the gateway did not receive a second (looped) connection.
        assert [e["reason"] for e in audit_since(self_gateway, mark)] == ["self_address"], authority


def test_absolute_form_to_own_listener(lab, self_gateway, client_for):
    for host in (f"{GATEWAY_OWN}:{self_gateway.port}", f"127.0.0.1:{self_gateway.loopback_port}"):
        mark = len(self_gateway.audit())
        reply = client_for(self_gateway).absolute_get(f"http://{host}/", host)
        assert_refused(lab, reply, "self_address")
        assert [e["reason"] for e in audit_since(self_gateway, mark)] == ["self_address"], host


@pytest.mark.parametrize("form, spelling", [("connect", "0.0.0.0"), ("connect", "0"), ("absolute", "0.0.0.0")])
def test_unspecified_address_reaching_own_listener(lab, self_gateway, client_for, form, spelling):
    """connect() to 0.0.0.0 reaches the local host (127.0.0.1) on Linux, so with 0.0.0.0/8 exempted
    and a rule allowing it, 0.0.0.0:<loopback listener port> is the gateway itself and must be
    refused like 127.0.0.1:<port> is; otherwise the gateway dials its own listener (a proxy loop)."""
    authority = f"{spelling}:{self_gateway.loopback_port}"
    mark = len(self_gateway.audit())
    client = client_for(self_gateway)
    reply = client.connect_only(authority) if form == "connect" else client.absolute_get(f"http://{authority}/", authority)
    assert reply.status == 403, f"{form} {authority} -> {reply.status} {reply.headers}\n{reply.text()}"
    assert reply.egress_reason in ("self_address", "denied_address"), reply.text()
    assert lab.touched_any() == []
    # Exactly one decision: the gateway did not receive a connection from itself.
    assert len(audit_since(self_gateway, mark)) == 1, audit_since(self_gateway, mark)


def test_own_non_listening_address_without_exemption(lab, gateways, client_for):
    """The default-policy gateway (no allow_ip_ranges): a name resolving to 93.184.216.1, an address
    of the gateway's namespace in no deny range, is refused as self_address; the recorders on
    93.184.216.1:443/80 see nothing."""
    gateway = gateways("default")
    assert_refused(lab, client_for(gateway).connect_only("gwself.test:443"), "self_address")
    assert_refused(lab, client_for(gateway).absolute_get("http://gwself.test/", "gwself.test"), "self_address")


def test_wildcard_listener(lab, gateways, client_for):
    """A gateway listening on 0.0.0.0:P: every local address on port P is the gateway itself."""
    gateway = gateways("wildcard")
    p = gateway.port
    for authority in (f"{GATEWAY_OWN}:{p}", f"gw.test:{p}", f"127.0.0.1:{p}", f"127.0.0.2:{p}", f"10.200.0.1:{p}"):
        assert_refused(lab, client_for(gateway).connect_only(authority), "self_address")
