"""Memory a WebSocket may make the gateway hold.

mitmproxy's WebsocketLayer reassembles each message whole (`frame_buf`) before its hook runs, with
no bound: an endless fragmented message (FIN=0 frames) grew a worker by 500 MiB in 5 s. And it
keeps every message it relayed in `flow.websocket.messages` for the life of the connection: a
stream of ordinary 1 MiB messages grew it without end. Neither was refused or audited.

Here the layer (wrapped once, like addons/credentials.py's redaction) keeps after each event only
the last message (every addon's `websocket_message` hook has seen it by then: the redactor, rate
limits, metrics read `messages[-1]`), and a message being reassembled past
`egress_max_websocket_message_bytes` closes both sides with 1009 (message too big) and one audit
line, `websocket_message_too_large`. wsproto hands frame payloads over as they arrive, so what is
held stays within the budget plus one read.
"""

from __future__ import annotations

import logging
import time

from mitmproxy import ctx, http

from gateway.decision import Decision

from .audit_fields import connection_fields, decision_fields
from .state import GatewayState

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MESSAGE_TOO_BIG = 1009  # RFC 6455 close code


class WebsocketLimits:
    def __init__(self, state: GatewayState):
        self.state = state
        install(self._refused)

    def load(self, loader):
        loader.add_option(
            "egress_max_websocket_message_bytes", int, DEFAULT_MAX_MESSAGE_BYTES,
            "Bytes of one WebSocket message the gateway reassembles; past them both sides are closed "
            "with 1009 (websocket_message_too_large). 0: no limit.",
        )

    def _refused(self, flow: http.HTTPFlow, from_client: bool, size: int, limit: int) -> None:
        decision = Decision.deny("websocket_message_too_large",
                                 f"a WebSocket message from the {'client' if from_client else 'upstream'} "
                                 f"passed {limit} bytes; closed with {MESSAGE_TOO_BIG}")
        allowed_by = flow.metadata.get("egress_decision")
        if allowed_by is not None and getattr(allowed_by, "rule", None):
            decision = Decision.deny(decision.reason, decision.message, allowed_by.rule)
        try:
            conn = self.state.connections.get(flow.client_conn.id)
            scope = self.state.scope(conn) if self.state.engine else None
            self.state.record(event="websocket", **connection_fields(conn, scope.sandbox if scope else None),
                              **(decision_fields(decision, conn.tunnel if conn else None,
                                                 flow.request.pretty_host, flow.request.port)
                                 | {"status": None}),
                              method=flow.request.method, path=flow.request.path, size=size)
        except Exception:  # the close goes ahead whatever the audit did
            logging.getLogger("egress").exception("egress gateway: could not record a WebSocket refusal")


def _limit() -> int:
    try:
        return max(int(ctx.options.egress_max_websocket_message_bytes), 0)
    except (AttributeError, KeyError, ValueError):
        return DEFAULT_MAX_MESSAGE_BYTES


def install(on_refused) -> None:
    """Wrap mitmproxy's WebsocketLayer (the class the HTTP stream makes, whatever wrapped it before)."""
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers import websocket as ws_module
    import wsproto.connection
    import wsproto.events

    if getattr(ws_module.WebsocketLayer, "_egress_bounded", False):
        ws_module.WebsocketLayer._egress_on_refused = staticmethod(on_refused)
        return

    class BoundedWebsocketLayer(ws_module.WebsocketLayer):
        _egress_bounded = True
        _egress_on_refused = staticmethod(on_refused)

        def relay_messages(self, event):
            yield from super().relay_messages(event)
            messages = self.flow.websocket.messages if self.flow.websocket is not None else None
            if messages and len(messages) > 1:
                del messages[:-1]  # every hook has seen them; only the last is kept
            if self._handle_event != self.relay_messages:
                return  # closed meanwhile
            limit = _limit()
            for ws, from_client in ((self.client_ws, True), (self.server_ws, False)):
                size = sum(len(piece) for piece in ws.frame_buf)
                if limit and size > limit:
                    yield from self._too_large(from_client, size, limit)
                    return

        def _too_large(self, from_client: bool, size: int, limit: int):
            self.client_ws.frame_buf = [b""]
            self.server_ws.frame_buf = [b""]
            try:
                self._egress_on_refused(self.flow, from_client, size, limit)
            except Exception:
                logging.getLogger("egress").exception("egress gateway: WebSocket refusal hook failed")
            websocket = self.flow.websocket
            websocket.timestamp_end = time.time()
            websocket.closed_by_client = from_client
            websocket.close_code = MESSAGE_TOO_BIG
            websocket.close_reason = "message too big"
            close = wsproto.events.CloseConnection(code=MESSAGE_TOO_BIG, reason="message too big")
            for ws in (self.server_ws, self.client_ws):
                if ws.state is wsproto.connection.ConnectionState.OPEN:
                    yield ws.send2(close)
                yield commands.CloseConnection(ws.conn)
            yield ws_module.WebsocketEndHook(self.flow)
            self.flow.live = False
            self._handle_event = self.done

    ws_module.WebsocketLayer = BoundedWebsocketLayer
