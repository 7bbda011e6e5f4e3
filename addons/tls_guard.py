"""TLS ClientHello in a tunnel: the SNI may only repeat the pinned name, and the upstream SNI is
always the pinned name (mitmproxy would otherwise copy the client's, TLS-level domain fronting).

A mismatching SNI does not get a silent reset: the connection is marked, its upstream is made
impossible, and every request on it is answered 421 with the reason, so the user sees why.
"""

from __future__ import annotations

from mitmproxy import tls

from gateway.decision import Decision
from gateway.hostnames import HostError, canonical_host

from .failclosed import fail_closed
from .state import GatewayState

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
    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        conn = self.state.connections.get(data.context.client.id)
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
            return
        conn.poisoned = decision
        data.context.server.error = "egress gateway: TLS SNI does not match the pinned destination"
        self.state.audit.record(
            event="tls",
            client=conn.client,
            mode=conn.mode,
            decision="deny",
            reason=decision.reason,
            status=decision.status,
            host=pin.host.value,
            port=pin.port,
            address=str(pin.address),
            sni=sni,
            message=decision.message,
            ech=has_ech,
        )
