"""CONNECT: decide the tunnel's destination once, resolve it, check every address, pin it
(gateway/session.py ClientSession.connect decides; this applies it).

After this hook the tunnel's upstream address is the checked IP and its upstream SNI the
canonical name; nothing the sandbox sends later can change either.
"""

from __future__ import annotations

from mitmproxy import http

from gateway.decision import Decision, verdict_fields
from gateway.session import Step

from .audit_fields import decision_fields, fallback_fields, flow_fields
from .failclosed import fail_closed
from .respond import flow_page, refuse
from .session_driver import drive
from . import passthrough, proxy_auth
from .state import GatewayState


def _deny_on_error(self: "ConnectGuard", flow: http.HTTPFlow, error: Exception) -> None:
    decision = Decision.deny("internal_error", "the gateway failed while deciding this CONNECT")
    refuse(flow, decision, flow_page(self.state, flow, decision))
    self.state.record(event="connect", **fallback_fields(self.state, flow.client_conn), **verdict_fields(decision))


class ConnectGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(_deny_on_error)
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        session = self.state.connection(flow.client_conn.id, flow.client_conn.peername)
        engine = self.state.require_engine()
        # Who is asking first (the proxy token sets the connection's identity), then its gates.
        refused, auth_fields = proxy_auth.check(flow, session, engine, self.state)
        registry_seq = self.state.registry.seq  # the registry the scope is taken from (judged again if it moves)
        scope = self.state.scope(session)
        if refused is not None:
            step = Step(refused)
        elif (gated := self.state.gate(session, scope)) is not None:  # before any decision work
            step = Step(gated)
        else:
            authority = flow.request.data.authority.decode("utf-8", "surrogateescape")
            events = session.connect(authority, engine, scope, lambda decision: passthrough.rule_for(engine, decision))
            step = await drive(events, engine, self.state, flow.client_conn.id, session)
        fields = flow_fields(flow, session, scope.sandbox) | decision_fields(step.decision, step.pin, step.host, step.port)
        fields["path"] = None
        self.state.record(event="connect", **fields, **auth_fields)
        if not step.admitted:
            refuse(flow, step.decision, flow_page(self.state, flow, step.decision, step.host))
            return
        flow.request.data.host = str(step.pin.address)
        flow.request.data.port = step.pin.port
        flow.server_conn.sni = step.pin.sni or str(step.pin.address)
        session.commit(step)
        if step.establish is not None:
            self.state.establish(flow.client_conn.id, session, step.establish, registry_seq)
        if session.poisoned is not None:  # decided under a policy that a reload replaced meanwhile, and revoked
            refuse(flow, session.poisoned, flow_page(self.state, flow, session.poisoned))
