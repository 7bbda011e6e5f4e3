"""TLS ClientHello: in a CONNECT tunnel the SNI may only repeat the pinned name; on a
transparently redirected connection the SNI *names* the destination, which is decided, resolved
and pinned here (the IP the sandbox dialled is recorded, never dialled). Either way the upstream
SNI is always the pinned name (mitmproxy would otherwise copy the client's: TLS-level fronting).

A refused ClientHello does not get a silent reset: the connection is marked, its upstream is made
impossible, and every request on it is answered with the reason (421 or 403), so the user sees why.
"""

from __future__ import annotations

import ipaddress

from mitmproxy import tls

from gateway.decision import Decision, verdict_fields
from gateway.engine import Pin
from gateway.hostnames import HostError, canonical_host, ip_host
from gateway.revocation import Established

from . import passthrough
from .audit_fields import connection_fields
from .failclosed import fail_closed
from .state import ConnectionState, GatewayState

ECH_EXTENSION = 0xFE0D


def _poison_on_error(self: "TlsGuard", data: tls.ClientHelloData, error: Exception) -> None:
    data.context.server.error = "egress gateway: refused (internal error in TLS check)"
    conn = self.state.connections.get(data.context.client.id)
    if conn is not None:
        conn.poisoned = Decision.deny("internal_error", "the gateway failed while checking the TLS ClientHello")
    data.ignore_connection = True


class TlsGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(_poison_on_error)
    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        conn = self.state.connections.get(data.context.client.id)
        if conn is not None and conn.mode == "transparent" and conn.tunnel is None and conn.poisoned is None:
            await self._pin_from_sni(data, conn)
            return
        pin = conn.tunnel if conn else None
        if pin is None:
            # TLS where no destination was pinned: nothing to check it against.
            data.context.server.error = "egress gateway: TLS without a pinned destination"
            data.ignore_connection = True
            return
        hello = data.client_hello
        data.context.server.sni = pin.sni or str(pin.address)
        sni = hello.sni
        has_ech = any(ext_type == ECH_EXTENSION for ext_type, _ in hello.extensions)
        decision = None
        if sni:
            try:
                same = canonical_host(sni).value == pin.host.value
            except HostError:
                same = False
            if not same:
                decision = Decision.deny(
                    "sni_mismatch", f"TLS SNI {sni[:100]!r} is not the pinned destination {pin.host.authority(pin.port)}"
                )
        if decision is None:
            if conn.passthrough_rule is not None:
                self._passthrough(data, conn, pin)
            return
        conn.poisoned = decision
        data.context.server.error = "egress gateway: TLS SNI does not match the pinned destination"
        self.state.record(
            event="tls",
            **connection_fields(conn, self.state.scope(conn).sandbox),
            **verdict_fields(decision),
            host=pin.host.value,
            port=pin.port,
            address=str(pin.address),
            sni=sni,
            ech=has_ech,
        )

    async def _pin_from_sni(self, data: tls.ClientHelloData, conn: ConnectionState) -> None:
        """Transparent mode: the SNI names the destination (the original IP when there is none)."""
        engine = self.state.require_engine()
        scope = self.state.scope(conn)
        original_host, port = conn.original_destination or (str(data.context.server.address[0]),
                                                            int(data.context.server.address[1]))
        original = ipaddress.ip_address(original_host)
        hello = data.client_hello
        sni = hello.sni
        pin: Pin | None = None
        host = None
        try:
            host = canonical_host(sni) if sni else ip_host(original)
        except HostError as exc:
            decision = Decision.deny("bad_host", f"bad TLS SNI: {exc}")
        else:
            decision, pin = await engine.admit(engine.check_destination(host, port, scope), host, port)
            if pin is not None and sni and (
                    mismatch := engine.original_destination_refusal(original, host, pin.addresses, decision.rule)):
                decision, pin = mismatch, None
        relay = passthrough.rule_for(engine, decision) if pin is not None else None
        if relay is None:  # a passthrough connection gets one line, from _passthrough
            has_ech = any(ext_type == ECH_EXTENSION for ext_type, _ in hello.extensions)
            # allow, deny, or (report mode) would_deny: from the decision, never by hand.
            self.state.record(
                event="tls", **connection_fields(conn, scope.sandbox), **verdict_fields(decision),
                host=host.value if host else None, port=port, address=pin.address.compressed if pin else None,
                sni=sni, ech=has_ech,
            )
        if pin is None:
            conn.poisoned = decision
            conn.named = (host.value, port) if host is not None else None  # for the requests' audit lines
            data.context.server.error = "egress gateway: destination refused"
            return
        conn.tunnel = pin
        data.context.server.address = (pin.address.compressed, pin.port)
        data.context.server.sni = pin.sni or pin.address.compressed
        conn.passthrough_rule = relay
        self.state.establish(data.context.client.id, conn, Established(
            "passthrough" if relay is not None else "tunnel", pin, decision.rule, conn.address, engine.generation,
            original if sni else None))
        if conn.poisoned is not None:  # decided under a policy that a reload replaced meanwhile, and revoked
            data.context.server.error = "egress gateway: revoked"
            return
        if relay is not None:
            self._passthrough(data, conn, pin)

    def _passthrough(self, data: tls.ClientHelloData, conn: ConnectionState, pin: Pin) -> None:
        """An inspect: false rule allowed the pinned destination: relay the TLS unread, to the pinned
        address only, if this ClientHello can only mean that destination (addons/passthrough.py)."""
        hello = data.client_hello
        extensions = list(hello.extensions)
        refusal = passthrough.decide(pin, hello.sni, extensions)
        passthrough.record(self.state, conn, pin, hello.sni, extensions, refusal)
        if refusal is not None:
            conn.poisoned = refusal
            conn.passthrough_rule = None
            data.context.server.error = "egress gateway: ClientHello refused for passthrough"
            return
        # mitmproxy relays the buffered ClientHello and everything after it; no HTTP hook fires.
        passthrough.admit(conn, pin, data.context.server)
        data.ignore_connection = True
