"""Passthrough (inspect: false): the one place that records a relayed tunnel's ClientHello.

Two hooks can see a passthrough ClientHello. For a CONNECT tunnel, the layer guard sees it first
(next_layer, from the raw bytes) and, when every check passes, puts a plain TCP relay under the
tunnel: no TLS layers at all, as fast as mitmproxy's own ignore_hosts. Anything else (a refusal,
a transparent connection whose destination the SNI still has to name) goes through the TLS layers,
where the TLS guard decides in tls_clienthello. Both ask the session
(gateway/session.py ClientSession.passthrough_hello) and write the line with `record`, so a
passthrough connection gets the same single audit line whichever hook took it.
"""

from __future__ import annotations

import dataclasses

from gateway.clienthello import ECH
from gateway.decision import Decision, verdict_fields
from gateway.engine import Engine
from gateway.policy import Rule
from gateway.session import Step

from .audit_fields import connection_fields
from .state import ClientSession, GatewayState


def rule_for(engine: Engine, decision: Decision) -> Rule | None:
    """The passthrough rule behind an allowed destination (`Engine.passthrough_rule`: revocation asks
    the same question of an open tunnel)."""
    return engine.passthrough_rule(decision)


def record(state: GatewayState, conn: ClientSession, step: Step, sni: str | None,
           extensions: list[tuple[int, bytes]]) -> None:
    """The one `tls` line of a passthrough ClientHello: a refusal names the rule it was refused on."""
    pin, rule = step.pin, step.passthrough
    decision = dataclasses.replace(step.decision, rule=rule.id if rule else None)
    state.record(
        event="tls", **connection_fields(conn, state.scope(conn).sandbox), **verdict_fields(decision),
        host=pin.host.value, port=pin.port, address=pin.address.compressed if step.decision.allowed else None,
        sni=sni, ech=any(t == ECH for t, _ in extensions), passthrough=True,
    )
