"""The gateway's HTTP layers, made for a connection the layer guard (addons/layer_guard.py) has
judged to carry HTTP: each with the limits of its heads and bodies, the policy's wording of a
refusal, and the audit line of a request its own servers refuse (parse errors, upstream failures).
"""

from __future__ import annotations

import dataclasses

from mitmproxy import ctx
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers.http import HTTPMode

from gateway.decision import Decision, verdict_fields
from gateway.options import DEFAULT_BODY_IDLE_TIMEOUT

from .audit_fields import connection_fields
from .http_stream import BodyLimits
from .layers import GatewayHttpLayer, TargetFormHttpLayer
from .respond import page_for
from .state import GatewayState


class HttpLayerMaker:
    def __init__(self, state: GatewayState):
        self.state = state
        # What every layer is handed, made once: each read of a method makes a new bound method (64
        # bytes), and a layer keeps what it was handed for its connection's life (8 per open stream).
        self._on_refusal, self._page = self.on_refusal, self.page
        self._body_limits = BodyLimits(state.buffer_account, DEFAULT_BODY_IDLE_TIMEOUT, self._sandbox_key)

    def inspected(self, nextlayer: layer.NextLayer) -> None:
        """HTTP inside a tunnel, TLS or a redirected connection: its destination is already pinned."""
        nextlayer.layer = GatewayHttpLayer(nextlayer.context, HTTPMode.transparent, self._on_refusal,
                                           *self._limits(), page_for=self._page)

    def proxy_port(self, nextlayer: layer.NextLayer) -> None:
        """HTTP/1 requests to the proxy port itself (CONNECT, absolute form)."""
        nextlayer.layer = TargetFormHttpLayer(nextlayer.context, HTTPMode.regular, self._on_refusal,
                                              *self._limits(), page_for=self._page)

    def _limits(self) -> tuple[int, float, BodyLimits]:
        """The limits of an HTTP layer: head size and time (its HTTP/1 server), and the bodies'
        buffer budget and idle timeout (its streams; one frozen BodyLimits while the option holds)."""
        idle = float(getattr(ctx.options, "egress_body_idle_timeout", DEFAULT_BODY_IDLE_TIMEOUT))
        if self._body_limits.idle_timeout != idle:
            self._body_limits = dataclasses.replace(self._body_limits, idle_timeout=idle)
        return (ctx.options.egress_max_head_bytes, float(ctx.options.egress_head_timeout), self._body_limits)

    def _sandbox_key(self, context) -> str:
        return self.state.sandbox_key(self.state.connections.get(context.client.id))

    def page(self, context, decision: Decision, accept: str | None = None):
        """How the current policy words a refusal on this client connection (addons/respond.py
        `page_for`): what the gateway's HTTP servers and refusal layers send."""
        return page_for(self.state, context.client.id, decision, accept)

    def on_refusal(self, context, decision: Decision, request, method: str | None = None,
                   status_sent: bool = True, **fields) -> Decision:
        """A request mitmproxy's HTTP server refused or failed itself (parse errors, upstream
        failures): one audit line, in the same shape as the guards' lines. Returns the decision to
        send, its message redacted: a page the gateway writes never carries a secret, whatever
        text it was built from. `fields` add to (or replace) the line's keys, e.g. the HTTP/2
        server's `event` and `repeated` count; `status_sent=False`: no HTTP status went out."""
        conn = self.state.connections.get(context.client.id)
        pin = conn.tunnel if conn else None
        upstream = decision.reason in ("upstream_failed", "response_too_large", "response_body_timeout")
        method = method or getattr(request, "method", None)
        line = dict(
            event="error" if upstream else "connect" if method == "CONNECT" else "request",
            **connection_fields(conn, self.state.scope(conn).sandbox if self.state.engine else None),
            **verdict_fields(decision, status_sent),
            host=pin.host.value if pin else None, port=pin.port if pin else None,
            address=pin.address.compressed if pin else None, sni=context.client.sni,
            method=method, path=getattr(request, "path", None),
            host_header=request.headers.get("host") if request is not None else None,
        )
        line.update(fields)
        self.state.record(**line)
        redactor = self.state.redactor()
        if redactor is not None:
            message, hits = redactor.redact_text(decision.message)
            if hits:
                return dataclasses.replace(decision, message=message)
        return decision
