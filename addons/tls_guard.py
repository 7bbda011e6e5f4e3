"""TLS ClientHello: in a CONNECT tunnel the SNI may only repeat the pinned name; on a
transparently redirected connection the SNI *names* the destination, which is decided, resolved
and pinned here (the IP the sandbox dialled is recorded, never dialled): gateway/session.py
ClientSession.client_hello decides, this applies it. Either way the upstream
SNI is always the pinned name (mitmproxy would otherwise copy the client's: TLS-level fronting).

A refused ClientHello does not get a silent reset: the connection is marked, its upstream is made
impossible, and every request on it is answered with the reason (421 or 403), so the user sees why.
"""

from __future__ import annotations

from mitmproxy import tls

from gateway.decision import Decision, verdict_fields
from gateway.session import PASSTHROUGH

from . import passthrough
from .audit_fields import connection_fields
from .failclosed import fail_closed
from .session_driver import drive
from .state import ClientSession, GatewayState

ECH_EXTENSION = 0xFE0D


def _poison_on_error(self: "TlsGuard", data: tls.ClientHelloData, error: Exception) -> None:
    data.context.server.error = "egress gateway: refused (internal error in TLS check)"
    conn = self.state.connections.get(data.context.client.id)
    if conn is not None:
        conn.poison(Decision.deny("internal_error", "the gateway failed while checking the TLS ClientHello"))
    data.ignore_connection = True


class TlsGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(_poison_on_error)
    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        session = self.state.connections.get(data.context.client.id)
        if session is None or (session.tunnel is None and not session.pins_by_sni()):
            # TLS where no destination was pinned: nothing to check it against.
            data.context.server.error = "egress gateway: TLS without a pinned destination"
            data.ignore_connection = True
            return
        engine = self.state.require_engine()
        registry_seq = self.state.registry.seq  # the registry the scope is taken from (judged again if it moves)
        scope = self.state.scope(session)
        hello = data.client_hello
        pinning = session.pins_by_sni()
        dialled = (str(data.context.server.address[0]), int(data.context.server.address[1])) if pinning else ("", 0)
        events = session.client_hello(hello.sni, dialled, engine, scope,
                                      lambda decision: passthrough.rule_for(engine, decision))
        step = await drive(events, engine, self.state, data.context.client.id, session)
        if step.pin is not None:
            data.context.server.sni = step.pin.sni or step.pin.address.compressed
        if (pinning and step.passthrough is None) or not step.decision.allowed:
            # allow, deny, or (report mode) would_deny: from the decision, never by hand. A passthrough
            # connection gets its one line from _passthrough; a pinned one's allowed SNI none.
            self.state.record(
                event="tls", **connection_fields(session, scope.sandbox), **verdict_fields(step.decision),
                host=step.pin.host.value if step.pin else step.host, port=step.pin.port if step.pin else step.port,
                address=step.pin.address.compressed if step.pin else None, sni=hello.sni,
                ech=any(ext_type == ECH_EXTENSION for ext_type, _ in hello.extensions),
            )
        if not step.decision.allowed:
            data.context.server.error = ("egress gateway: destination refused" if pinning else
                                         "egress gateway: TLS SNI does not match the pinned destination")
            return
        if step.upstream is not None:
            data.context.server.address = step.upstream
        if pinning:
            session.commit(step)
        if step.establish is not None:
            self.state.establish(data.context.client.id, session, step.establish, registry_seq)
        if session.poisoned is not None:  # decided under a policy that a reload replaced meanwhile, and revoked
            data.context.server.error = "egress gateway: revoked"
            return
        if session.phase == PASSTHROUGH:
            self._passthrough(data, session)

    def _passthrough(self, data: tls.ClientHelloData, conn: ClientSession) -> None:
        """An inspect: false rule allowed the pinned destination: relay the TLS unread, to the pinned
        address only, if this ClientHello can only mean that destination (the session decides)."""
        hello = data.client_hello
        extensions = list(hello.extensions)
        step = conn.passthrough_hello(hello.sni, extensions)
        passthrough.record(self.state, conn, step, hello.sni, extensions)
        if not step.admitted:
            conn.poison(step.decision)
            data.context.server.error = "egress gateway: ClientHello refused for passthrough"
            return
        # mitmproxy relays the buffered ClientHello and everything after it; no HTTP hook fires.
        data.context.server.address = step.upstream
        conn.relay(step)
        data.ignore_connection = True
