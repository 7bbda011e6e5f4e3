"""An upstream that answers 101 Switching Protocols to anything but the WebSocket upgrade the
sandbox asked for: the connection is killed and refused, 502 `unsolicited_upgrade`. Whatever it
switched to (h2c, a raw TCP stream) would carry bytes the gateway cannot inspect (pinning rule 7).
"""

from __future__ import annotations

from mitmproxy import http

from gateway.decision import Decision

from .audit_fields import decision_fields, flow_fields
from .failclosed import fail_closed
from .state import GatewayState


class UpgradeGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(lambda self, flow, error: flow.kill())
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or response.status_code != 101:
            return
        asked = flow.request.headers.get("upgrade", "").strip().lower()
        answered = response.headers.get("upgrade", "").strip().lower()
        if asked == "websocket" and answered == "websocket":
            return
        conn = self.state.connections.get(flow.client_conn.id)
        decision = Decision.deny("unsolicited_upgrade", f"upstream answered 101 with Upgrade {answered[:40]!r}")
        pin = flow.metadata.get("egress_pin") or (conn.tunnel if conn else None)
        fields = flow_fields(flow, conn, self.state.scope(conn).sandbox) | decision_fields(decision, pin)
        self.state.record(event="response", **fields)
        flow.kill()
