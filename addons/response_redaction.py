"""Credentials never flow back to the sandbox: `ResponseRedactor` replaces every form of every secret
in response status lines, headers and trailers of all requests, and in the bodies (streamed chunk by
chunk, or decoded first when the upstream compressed them: addons/body_redaction.py) and WebSocket
messages (addons/websocket_redaction.py) of requests that carried a credential (addons/credentials.py
marks them `BOUND`); log lines too (addons/log_redaction.py).
"""

from __future__ import annotations

import functools
import logging
import weakref

from mitmproxy import ctx, http
from mitmproxy.utils import human

from gateway.decision import Decision, verdict_fields
from gateway.decompress import DEFAULT_BUFFERED_LIMIT, DecodedTooLarge, OverBudget, stream_decoder
from gateway.redact import Redactor, StreamRedactor
from gateway.streaming import Plan, codings, response_plan

from .audit_fields import connection_fields
from .body_redaction import BodyRedactor, body_size_limit, decode_buffered, redact_buffered
from .credentials import BOUND
from .failclosed import QuietAuditFailures, fail_closed
from .log_redaction import LogRedaction
from .respond import flow_page, refusal_headers, replace_response
from .state import GatewayState
from .websocket_redaction import install_websocket_redaction


def _kill_on_error(self, flow, *rest, error: Exception) -> None:
    flow.kill()


class ResponseRedactor:
    """Redacts every form of every secret from what comes back: response status lines, headers
    and trailers of all requests; bodies and WebSocket messages of credential-bound ones; and log
    lines (`running`)."""

    def __init__(self, state: GatewayState):
        self.state = state
        # Handed to every streamed body's redactor, made once: each read of a method makes a new
        # bound method, kept by the stream for as long as it is open (docs/performance.md).
        self._current, self._on_cut_off = self.redactor, self._cut_off
        install_websocket_redaction(self.redactor)

    def redactor(self) -> Redactor | None:
        return self.state.redactor()

    def running(self):
        # Whatever a log line quotes (mitmproxy logs WebSocket pings, protocol errors), never a secret.
        LogRedaction.install(self.redactor)
        QuietAuditFailures.install()  # a full audit disk: counted warnings, not a traceback per refusal

    def _count_body(self, flow_ref: weakref.ref, hits: list[str]) -> None:
        """A streamed body's hits (`flow_ref`: the stream's flow holds its redactor, which holds this)."""
        flow = flow_ref()
        if flow is not None:
            self._count(flow, hits, "body")

    def _count(self, flow, hits: list[str], where: str) -> None:
        for name in dict.fromkeys(hits):
            redacted = Decision(True, "redacted", f"secret {name} redacted from the response {where}")
            self.state.record(event="redaction", secret=name, **verdict_fields(redacted),
                              host=flow.request.pretty_host if flow.request else None)

    @fail_closed(_kill_on_error)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        redactor = self.redactor()
        response = flow.response
        if redactor is None or response is None:
            return
        clean_reason, found = redactor.redact_text(response.reason)
        if found:
            response.reason = clean_reason
            self._count(flow, found, "status line")
        self._redact_fields(flow, response.headers, redactor, "headers")
        if BOUND not in flow.metadata:
            return
        # A credential-bound response streams through the redactor; only a small, known-length,
        # compressed body is buffered, to be decoded whole (gateway/streaming.py says why).
        limit = human.parse_size(ctx.options.stream_large_bodies) if hasattr(ctx.options, "stream_large_bodies") else None
        plan, why = response_plan(method=flow.request.method, status=response.status_code,
                                  headers=response.headers.items(multi=True), bound=True, buffer_limit=limit)
        # The current redactor for every chunk: a value rotated while the stream is open counts.
        body_redactor = StreamRedactor(self._current, on_hit=functools.partial(self._count_body, weakref.ref(flow)))
        if plan in (Plan.NO_BODY, Plan.REDACT):
            response.stream = BodyRedactor(flow, body_redactor, on_failure=self._on_cut_off)
        elif plan is Plan.DECODE_BUFFERED:
            response.stream = False  # decoded and redacted in `response`, or a clean 502
        elif plan is Plan.DECODE_STREAM:
            decoder = stream_decoder(why, body_size_limit())  # the one coding the plan found
            del response.headers["content-encoding"]
            response.headers.pop("content-length", None)
            if not (flow.request.is_http2 or flow.request.is_http3):
                response.headers["transfer-encoding"] = "chunked"
            response.stream = BodyRedactor(flow, body_redactor, decoder, on_failure=self._on_cut_off, encoding=why)
        else:
            self._refuse_body(flow, Decision.deny(
                "undecodable_response",
                f"{why}, which the gateway cannot decode to redact the response to a credential-bound request"))

    def _redact_fields(self, flow, fields: http.Headers, redactor: Redactor, where: str) -> None:
        hits: list[str] = []
        for name in list(dict.fromkeys(fields.keys())):  # as sent: base64 is case-sensitive
            found = redactor.redact_text(name)[1]
            if found:
                # A name cannot carry a marker ('[' is not a token character): drop the field.
                hits += found
                fields.pop(name, None)
                continue
            cleaned = [redactor.redact_text(v) for v in fields.get_all(name)]
            if any(found for _, found in cleaned):
                fields.set_all(name, [v for v, _ in cleaned])
                hits += [h for _, found in cleaned for h in found]
        if hits:
            self._count(flow, hits, where)

    def _refuse_body(self, flow: http.HTTPFlow, decision: Decision) -> None:
        replace_response(flow.response, decision, flow_page(self.state, flow, decision))
        self.state.record(event="response", **self._where(flow), **verdict_fields(decision),
                          host=flow.request.pretty_host)

    @fail_closed(_kill_on_error)
    async def response(self, flow: http.HTTPFlow) -> None:
        try:
            await self._redact_response(flow)
        finally:
            if flow.websocket is None:  # a WebSocket's messages still follow: kept until websocket_end
                self.state.secret_memory.unpin(flow.id)

    async def _redact_response(self, flow: http.HTTPFlow) -> None:
        redactor = self.redactor()
        if redactor is None or flow.response is None:
            return
        if flow.response.trailers:
            # Sent after this hook, streamed or not (gRPC's status and message live here).
            self._redact_fields(flow, flow.response.trailers, redactor, "trailers")
        if BOUND not in flow.metadata or flow.response.stream:
            return
        encoding = [c for c in codings(flow.response.headers.get("content-encoding", "")) if c != "identity"]
        if encoding:
            limit = min(body_size_limit() or DEFAULT_BUFFERED_LIMIT, DEFAULT_BUFFERED_LIMIT)
            try:
                body, hits = await decode_buffered(flow, encoding[0], limit, redactor)
            except OverBudget:
                self._refuse_buffered(flow, Decision.deny(
                    "buffer_budget", "decoding the compressed response for redaction would pass the connection's "
                    "or the sandbox's buffer budget"))
                return
            except DecodedTooLarge:
                self._refuse_buffered(flow, Decision.deny(
                    "response_too_large", f"the compressed response decodes to more than {limit} bytes"))
                return
            except ValueError:
                self._refuse_buffered(flow, Decision.deny(
                    "undecodable_response", "a compressed response to a credential-bound request could not "
                    "be decoded for redaction"))
                return
            del flow.response.headers["content-encoding"]
            flow.response.raw_content = body
            flow.response.headers["content-length"] = str(len(body))
        else:
            body, hits = await redact_buffered(flow.response.raw_content or b"", redactor)
            if hits:
                flow.response.content = body
        if hits:
            self._count(flow, hits, "body")

    def request(self, flow: http.HTTPFlow) -> None:
        """Request trailers arrive after the head was checked, and some origins merge them into the
        headers (Apache's MergeTrailers): on a bound rule none is forwarded, so no credential of the
        sandbox's own rides there (HTTP/1.1 request trailers are refused outright)."""
        if BOUND in flow.metadata and flow.request.trailers:
            logging.getLogger("egress").info(
                "egress gateway: %d request trailer field(s) dropped on a credential-bound rule",
                len(flow.request.trailers.fields))
            flow.request.trailers = None

    def _refuse_buffered(self, flow: http.HTTPFlow, decision: Decision) -> None:
        page = flow_page(self.state, flow, decision)
        flow.response = http.Response.make(decision.status, page.body, refusal_headers(decision, page.content_type))
        self.state.record(event="response", **self._where(flow), **verdict_fields(decision),
                          host=flow.request.pretty_host)

    def _where(self, flow: http.HTTPFlow) -> dict:
        """The client, sandbox and mode of a response line: a refusal is counted against its
        sandbox (audit aggregation, metrics) and found by its client like every other line."""
        conn = self.state.connections.get(flow.client_conn.id) if flow.client_conn is not None else None
        sandbox = self.state.scope(conn).sandbox if conn is not None and self.state.engine is not None else None
        return connection_fields(conn, sandbox)

    def _cut_off(self, flow: http.HTTPFlow, reason: str) -> None:
        cut = Decision.deny(reason, "the streamed response to a credential-bound request was cut off")
        # Its head was already sent: no refusal status reached the client.
        self.state.record(event="response", **self._where(flow), **verdict_fields(cut, status_sent=False),
                          host=flow.request.pretty_host if flow.request else None)

    def error(self, flow: http.HTTPFlow) -> None:
        self.state.secret_memory.unpin(flow.id)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self.state.secret_memory.unpin(flow.id)

    @fail_closed(_kill_on_error)
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if BOUND not in flow.metadata or flow.websocket is None:
            return
        redactor = self.redactor()
        message = flow.websocket.messages[-1]
        if redactor is None or message.from_client:
            return
        clean, hits = redactor.redact(message.content)
        if hits:
            message.content = clean
            self._count(flow, hits, "WebSocket message")
