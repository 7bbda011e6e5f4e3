"""Passthrough (inspect: false): the one place that decides, records and admits a relayed tunnel.

Two hooks can see a passthrough ClientHello. For a CONNECT tunnel, the layer guard sees it first
(next_layer, from the raw bytes) and, when every check passes, puts a plain TCP relay under the
tunnel: no TLS layers at all, as fast as mitmproxy's own ignore_hosts. Anything else (a refusal,
a transparent connection whose destination the SNI still has to name) goes through the TLS layers,
where the TLS guard decides in tls_clienthello. Both use `decide` and `record`, so a passthrough
connection gets the same single audit line whichever hook took it.
"""

from __future__ import annotations

import dataclasses

from gateway.clienthello import ECH, check_passthrough_hello
from gateway.decision import Decision, verdict_fields
from gateway.engine import Engine, Pin
from gateway.hostnames import HostError, canonical_host
from gateway.policy import Rule

from .audit_fields import connection_fields
from .state import ClientSession, GatewayState


def rule_for(engine: Engine, decision: Decision) -> Rule | None:
    """The passthrough rule behind an allowed destination (`Engine.passthrough_rule`: revocation asks
    the same question of an open tunnel)."""
    return engine.passthrough_rule(decision)


def decide(pin: Pin, sni: str | None, extensions: list[tuple[int, bytes]]) -> Decision | None:
    """None when this ClientHello may be relayed unread to the pinned destination; else why not."""
    if sni:
        try:
            same = canonical_host(sni).value == pin.host.value
        except HostError:
            same = False
        if not same:
            return Decision.deny(
                "sni_mismatch", f"TLS SNI {sni[:100]!r} is not the pinned destination {pin.host.authority(pin.port)}"
            )
    return check_passthrough_hello(sni, extensions)


def record(state: GatewayState, conn: ClientSession, pin: Pin, sni: str | None,
           extensions: list[tuple[int, bytes]], refusal: Decision | None) -> None:
    rule = conn.passthrough_rule
    rule_id = rule.id if rule else None
    allowed = refusal is None
    decision = (Decision.allow(rule_id, f"rule {rule_id} relays TLS to {pin.host.authority(pin.port)} unread "
                                        "(inspect: false)")
                if allowed else dataclasses.replace(refusal, rule=rule_id))
    state.record(
        event="tls", **connection_fields(conn, state.scope(conn).sandbox), **verdict_fields(decision),
        host=pin.host.value, port=pin.port, address=pin.address.compressed if allowed else None,
        sni=sni, ech=any(t == ECH for t, _ in extensions), passthrough=True,
    )


def admit(conn: ClientSession, pin: Pin, server) -> None:
    """The upstream is the pinned address, whatever the sandbox dialled, and only that one."""
    server.address = (pin.address.compressed, pin.port)
    conn.admitted[(pin.address.compressed, pin.port)] = None
