"""Self-protection: the gateway never dials its own listeners (proxy port, metrics port,
transparent and DNS listeners) whatever names them (IP spellings, a name resolving to it, the
unspecified address 0.0.0.0/:: that reaches the local host), even when a rule and
allow_ip_ranges cover them; and never its own addresses. A proxy loop would show up as a second
audit decision (the gateway receiving its own connection); the metrics text must never come back.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import Conn, connect_proxy, get, start_tls, tunnel
from tests.support.waiting import value_when

from .common import attack, nothing_reached
from .world import DNS, GATEWAY_SIDE, METRICS, REGULAR, TPROXY

pytestmark = attack("self")

SELF_REASONS = ("self_address", "denied_address")


def _audit_count(gateway) -> int:
    return len(gateway.audit())


def _one_decision(gateway, mark: int, conn: Conn) -> None:
    """Exactly one decision by a client connection that is new since `mark`: a proxy loop would
    add a second one (the gateway's own connection arriving as a client), decided before the first
    could be answered: so once the line of `conn` is there, a second one would be too."""
    # Every line since `mark` (not "clients not seen before": in a long run an ephemeral port
    # comes round again, and a line of this test's own connection would then be skipped).
    new = value_when(lambda: gateway.audit()[mark:], lambda lines: any(e.get("client") == conn.client for e in lines))
    assert len(new) == 1, f"expected exactly one decision (no loop), got {new}"


@pytest.mark.parametrize("host,which", [
    ("127.0.0.1", "proxy"), ("self.test", "proxy"), ("0.0.0.0", "proxy"), ("0", "proxy"), ("[::]", "proxy"),
    ("[::ffff:0.0.0.0]", "proxy"), ("127.0.0.1", "metrics"), ("0.0.0.0", "metrics"), ("self.test", "metrics"),
])
def test_absolute_form_proxy_loop(rt, host, which):
    port = rt.gateway.port if which == "proxy" else rt.metrics_port
    mark = _audit_count(rt.gateway)
    with connect_proxy(rt.gateway) as conn:
        response = conn.request("GET", f"http://{host}:{port}/metrics", [("Host", f"{host}:{port}")])
    assert response.status == 403, response.text
    assert response.egress_reason in SELF_REASONS, response.text
    assert b"# HELP" not in response.body and b"# TYPE" not in response.body
    _one_decision(rt.gateway, mark, conn)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "0", "[::ffff:127.0.0.1]"])
def test_connect_to_unspecified_and_mapped_forms_of_the_proxy_port(rt, host):
    mark = _audit_count(rt.gateway)
    conn, answer = tunnel(rt.gateway, f"{host}:{rt.gateway.port}")
    conn.close()
    assert answer.status == 403 and answer.egress_reason in SELF_REASONS, answer.body
    _one_decision(rt.gateway, mark, conn)
    nothing_reached(rt.everything())


def test_plain_tunnel_request_cannot_reach_the_gateway(rt):
    """A tunnel to an allowed host whose request names the gateway (absolute-form)."""
    conn, answer = tunnel(rt.gateway, "allowed.test:80")
    with conn:
        assert answer.status == 200
        response = get(conn, f"http://127.0.0.1:{rt.gateway.port}/", f"127.0.0.1:{rt.gateway.port}")
    assert response.status in (400, 421), response.text
    nothing_reached(rt.everything())


# --- inside the namespace topology: every listener of a gateway with four of them ----------------


@pytest.mark.parametrize("authority", [
    f"127.0.0.1:{REGULAR}", f"127.0.0.1:{METRICS}", f"0.0.0.0:{TPROXY}", f"127.0.0.1:{TPROXY}",
    f"{GATEWAY_SIDE}:{TPROXY}", f"{GATEWAY_SIDE}:{DNS}", f"[::ffff:127.0.0.1]:{METRICS}",
])
def test_explicit_connect_to_every_listener(world, authority):
    mark = _audit_count(world.gateway)
    with world.gateway_ns():
        conn, answer = tunnel(world.gateway, authority)
    conn.close()
    assert answer.status == 403 and answer.egress_reason in SELF_REASONS, answer.body
    _one_decision(world.gateway, mark, conn)
    assert world.touched() == []


def test_explicit_absolute_form_to_metrics(world):
    with world.gateway_ns():
        conn = connect_proxy(world.gateway)
    with conn:
        response = conn.request("GET", f"http://127.0.0.1:{METRICS}/metrics", [("Host", f"127.0.0.1:{METRICS}")])
    assert response.status == 403 and response.egress_reason in SELF_REASONS, response.text
    assert b"# HELP" not in response.body


@pytest.mark.parametrize("host", [GATEWAY_SIDE, "gwself.test"])
def test_transparent_host_naming_the_gateway(world, host):
    """Plain HTTP from the sandbox whose Host is the gateway's own address (or a name for it)."""
    mark = _audit_count(world.gateway)
    with Conn(world.connect(GATEWAY_SIDE, 80)) as conn:
        response = get(conn, "/", host)
    assert response.status == 403 and response.egress_reason in SELF_REASONS, response.text
    _one_decision(world.gateway, mark, conn)
    assert world.touched() == []


@pytest.mark.parametrize("sni", [None, "gwself.test"])
def test_transparent_tls_to_the_gateway_itself(world, sni):
    """TLS dialled at the gateway's own address: without SNI the destination is that address."""
    with start_tls(Conn(world.connect(GATEWAY_SIDE, 443)), world.gateway, sni) as tls:
        response = get(tls, "/", sni or GATEWAY_SIDE)
    assert response.status == 403 and response.egress_reason in SELF_REASONS, response.text
    assert world.touched() == []


def test_transparent_host_naming_a_loopback_listener(world):
    """Host 127.0.0.1 on port 80: the connection's port is the destination's port, and no rule
    allows loopback on 80; the transparent listener's own port cannot be named at all (421)."""
    with Conn(world.connect(GATEWAY_SIDE, 80)) as conn:
        first = get(conn, "/", "127.0.0.1")
    with Conn(world.connect(GATEWAY_SIDE, 80)) as conn:
        second = get(conn, "/", f"127.0.0.1:{TPROXY}")
    assert first.status == 403, first.text
    assert second.status in (403, 421), second.text
    assert world.touched() == []


def test_sandbox_dialling_the_transparent_listener_directly(world):
    """Not redirected: the original destination is the gateway's own listener. With an SNI the
    port is still the listener's (no rule allows it); without one the destination is the gateway."""
    for sni in ("allowed.test", None):
        with start_tls(Conn(world.connect(GATEWAY_SIDE, TPROXY)), world.gateway, sni) as tls:
            response = get(tls, "/", sni or f"{GATEWAY_SIDE}:{TPROXY}")
        assert response.status == 403, (sni, response.text)
        assert response.egress_reason in SELF_REASONS + ("port_not_allowed", "no_rule"), response.text
    assert world.touched() == []


def test_sandbox_cannot_reach_the_metrics_port(world):
    with pytest.raises(OSError):
        world.connect(GATEWAY_SIDE, METRICS, timeout=1.0).close()
    assert world.touched() == []
