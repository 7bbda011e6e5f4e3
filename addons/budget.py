"""Memory budgets of the bodies a client makes the gateway hold, and how long a body may stall.

Every buffered body (a request below `stream_large_bodies`, a small response, a bound response
decoded whole for redaction) is charged to the buffer ledger (gateway/budget.py) before it grows,
per connection and per sandbox (per client address without a `sandboxes` section). Over budget, a
body that may stream does; one that must stay whole is refused, 503 `buffer_budget` (the stream,
addons/http_stream.py `GatewayHttpStream`, applies both). A body with no byte for
`egress_body_idle_timeout` seconds ends its stream (`request_body_timeout`, `response_body_timeout`).

WebSocket compression (permessage-deflate) is not negotiated: mitmproxy inflates it with no bound
(wsproto's decompressor takes no max_length), so a few KiB of deflate in one message would become
gigabytes in the worker. The offer is taken out of the upgrade request, and an upstream that answers
with the extension anyway has it taken out of the answer: its compressed frames then fail the
WebSocket (closed), never inflate.
"""

from __future__ import annotations

from mitmproxy import ctx, http

from gateway.decision import Decision

from . import h2_backpressure, write_backlog
from .options import declare
from .state import GatewayState


class BufferBudget:
    def __init__(self, state: GatewayState):
        self.state = state
        write_backlog.install(state)
        h2_backpressure.ledger_account = state.buffer_account_of
        state.request_limiters.append(self.sandbox_full)

    def sandbox_full(self, flow: http.HTTPFlow, decision: Decision, *args) -> Decision | None:
        """A sandbox whose buffers hold its whole budget (charges that cannot be refused: what its
        clients do not read, what gated upstream readers hold) gets no new request until they
        drain; other sandboxes are not affected."""
        ledger = self.state.buffers
        if ledger.per_sandbox is None:
            return None
        key = self.state.sandbox_key(self.state.connections.get(flow.client_conn.id))
        if ledger.held(sandbox=key) < ledger.per_sandbox:
            return None
        return Decision.deny("buffer_budget", f"this sandbox's buffers hold its whole budget "
                                              f"({ledger.per_sandbox} bytes); no new request until they drain",
                             decision.rule)

    def load(self, loader):
        declare(
            loader,
            "egress_max_buffered_bytes_per_connection",
            "egress_max_buffered_bytes_per_sandbox",
            "egress_body_idle_timeout",
            "egress_max_decoded_request_bytes",
        )

    def configure(self, updated: set[str]):
        if updated & {"egress_max_buffered_bytes_per_connection", "egress_max_buffered_bytes_per_sandbox"}:
            self.state.buffers.per_connection = max(ctx.options.egress_max_buffered_bytes_per_connection, 0) or None
            self.state.buffers.per_sandbox = max(ctx.options.egress_max_buffered_bytes_per_sandbox, 0) or None

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        _drop_deflate(flow.request.headers)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and flow.response.status_code == 101:
            _drop_deflate(flow.response.headers)

    def client_disconnected(self, client):
        self.state.buffers.drop_connection(client.id)


def _drop_deflate(headers: http.Headers) -> None:
    """Sec-WebSocket-Extensions without permessage-deflate (any spelling, any parameters)."""
    values = headers.get_all("sec-websocket-extensions")
    if not values:
        return
    kept = [ext.strip() for value in values for ext in value.split(",")
            if ext.strip() and ext.split(";", 1)[0].strip().lower() != "permessage-deflate"]
    if kept:
        headers.set_all("sec-websocket-extensions", [", ".join(kept)])
    else:
        headers.pop("sec-websocket-extensions", None)
