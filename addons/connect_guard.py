"""CONNECT: decide the tunnel's destination once, resolve it, check every address, pin it.

After this hook the tunnel's upstream address is the checked IP and its upstream SNI the
canonical name; nothing the sandbox sends later can change either.
"""

from __future__ import annotations

from mitmproxy import http

from gateway.decision import Decision, verdict_fields
from gateway.hostnames import HostError, parse_authority
from gateway.revocation import Established

from .audit_fields import decision_fields, fallback_fields, flow_fields
from .failclosed import fail_closed
from .respond import refuse
from . import passthrough
from .state import GatewayState


def _deny_on_error(self: "ConnectGuard", flow: http.HTTPFlow, error: Exception) -> None:
    decision = Decision.deny("internal_error", "the gateway failed while deciding this CONNECT")
    refuse(flow, decision)
    self.state.record(event="connect", **fallback_fields(self.state, flow.client_conn), **verdict_fields(decision))


class ConnectGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(_deny_on_error)
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        conn = self.state.connection(flow.client_conn.id, flow.client_conn.peername)
        engine = self.state.require_engine()
        scope = self.state.scope(conn)
        raw = flow.request.data.authority.decode("utf-8", "surrogateescape")
        pin = None
        host = port = None
        if (gated := self.state.gate(conn, scope)) is not None:  # before any decision work
            decision = gated
        elif conn.tunnel is not None:
            decision = Decision.deny("nested_connect", "CONNECT inside a tunnel is refused")
        else:
            try:
                host, port = parse_authority(raw)
            except HostError as exc:
                decision = Decision.deny("bad_host", f"bad CONNECT authority: {exc}")
            else:
                decision, pin = await engine.admit(engine.check_destination(host, port, scope), host, port)
        fields = flow_fields(flow, conn, scope.sandbox) | decision_fields(decision, pin, host and host.value, port)
        fields["path"] = None
        self.state.record(event="connect", **fields)
        if not decision.allowed or pin is None:
            refuse(flow, decision)
            return
        flow.request.data.host = str(pin.address)
        flow.request.data.port = pin.port
        flow.server_conn.sni = pin.sni or str(pin.address)
        conn.tunnel = pin
        conn.passthrough_rule = passthrough.rule_for(engine, decision)
        kind = "passthrough" if conn.passthrough_rule is not None else "tunnel"
        self.state.establish(flow.client_conn.id, conn,
                             Established(kind, pin, decision.rule, conn.address, engine.generation))
        if conn.poisoned is not None:  # decided under a policy that a reload replaced meanwhile, and revoked
            refuse(flow, conn.poisoned)
