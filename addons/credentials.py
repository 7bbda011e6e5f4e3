"""Platform-held credentials: injected into approved requests, redacted from everything that
comes back.

`CredentialInjector.apply` runs inside the request guard, after every check passed and before the
audit line is written: it sets the rule's `inject` headers/query parameters (replacing whatever
the sandbox sent under those names, in any spelling), and swaps this sandbox's placeholders for
the real values, only for the secrets the matched rule is bound to. A secret that cannot be read
fails the request (502, naming the secret) instead of forwarding it without the credential.

`ResponseRedactor` replaces every form of every secret in response headers, bodies (streamed
chunk by chunk, or decoded first when the upstream compressed them) and WebSocket messages of
requests that carried a credential, and in response headers of all requests.
"""

from __future__ import annotations

import functools
import logging
import weakref
from urllib.parse import quote

from mitmproxy import ctx, http
from mitmproxy.utils import human

from gateway.credentials import placeholder
from gateway.decision import Decision, verdict_fields
from gateway.credential_checks import BoundCheck, credential_verdict, secret_unavailable
from gateway.engine import Engine, Pin
from gateway.policy import Rule, Scope
from gateway.decompress import (DEFAULT_BUFFERED_LIMIT, DecodedTooLarge, OverBudget, decode_pieces, stream_decoder,
                                window_size)
from gateway.steps import run_steps
from gateway.redact import Redactor, StreamRedactor
from gateway.secrets import SecretUnavailable
from gateway.streaming import Plan, codings, response_plan

from . import decode_pool, fair_share
from .audit_fields import connection_fields
from .failclosed import QuietAuditFailures, fail_closed
from .respond import flow_page, refusal_headers, replace_response
from .state import GatewayState

BOUND = "egress_bound"  # flow.metadata key: names of the secrets this request carried
BUFFER_ACCOUNT = "egress_buffer_account"  # flow.metadata key: its stream's share of the buffer ledger (http_stream.py)


class CredentialInjector:
    AUDIT = "egress_credential_audit"  # flow.metadata key: audit fields of a refusal (audit_fields)

    def __init__(self, state: GatewayState):
        self.state = state

    def apply(self, flow: http.HTTPFlow, decision: Decision, scope: Scope, pin: Pin,
              engine: Engine) -> tuple[Decision, list[str]]:
        """Inject and swap for the allowed request; returns (decision, secret names used).

        Before anything is injected, the sandbox's own request must have its placeholders only
        where the rule swaps them and carry no credential but the platform's
        (gateway/credential_checks.credential_verdict). A would_deny request (report mode) is let through
        without any credential, and never with one of the sandbox's own."""
        rule: Rule | None = engine.policy.rules_by_id.get(decision.rule or "")
        if rule is None or not rule.secrets:
            return decision, []
        request = flow.request
        headers = list(request.headers.items(multi=True))
        verdict = credential_verdict(rule, decision, request.scheme, pin.host, headers, request.path,
                                     self._placeholders(rule, scope))
        if not verdict.inject:
            if verdict.check is not None and verdict.check.refusal is not None:
                self._refused(flow, verdict.check)
            return verdict.decision, []
        check = verdict.check
        try:
            values = engine.secrets.values(rule.secrets)
        except SecretUnavailable as exc:
            # The why (a path, an env variable) goes to the operator's log; the sandbox learns the name only.
            logging.getLogger("egress").warning("egress gateway: %s", exc)
            return secret_unavailable(rule, exc.name), []
        _swap(request, check, values)
        used: list[str] = []
        for injection in rule.injections:
            rendered = injection.template.render(values)
            if injection.target == "header":
                request.headers.pop(injection.name, None)  # every spelling, every duplicate
                request.headers[injection.name] = rendered
            else:
                request.query.set_all(injection.name, [rendered])
            used.extend(n for n in injection.template.secrets if n not in used)
        used.extend(n for n in check.swaps.secrets if n not in used)
        # Ask for an uncompressed answer: the response is redacted on its way back, and identity
        # bodies stream through the redactor without decoding.
        request.headers["Accept-Encoding"] = "identity"
        if request.headers.get("content-type", "").lower().startswith("application/grpc"):
            # gRPC compresses message by message only when the client accepts it (grpc-encoding on a
            # bound response is refused: gateway/streaming.py).
            request.headers["grpc-accept-encoding"] = "identity"
        flow.metadata[BOUND] = used
        # Whatever happens to the store from now on (a rotation, a reload), the response to this
        # request is redacted for exactly these values.
        self.state.secret_memory.pin(flow.id, {name: values[name] for name in rule.secrets})
        return decision, used

    def _placeholders(self, rule: Rule, scope: Scope) -> dict[str, str]:
        """This sandbox's placeholders for the rule's secrets: placeholder -> secret name."""
        key = self.state.placeholder_key
        if key is None:
            return {}
        return {placeholder(key, name, scope.sandbox): name for name in rule.secrets}

    def _refused(self, flow: http.HTTPFlow, check: BoundCheck) -> None:
        audit = {"location": check.location}
        if check.audit_target is not None:
            audit["path"] = check.audit_target  # the sandbox's own credential is not logged either
        flow.metadata[self.AUDIT] = audit

    def audit_fields(self, flow: http.HTTPFlow) -> dict:
        """Extra audit fields of a placeholder_misuse or foreign_credential refusal: `location`
        (where, never a value) and the path with foreign credential values blanked."""
        return flow.metadata.pop(self.AUDIT, {})


def _swap(request: http.Request, check: BoundCheck, values: dict[str, str]) -> None:
    """Make the swaps gateway/placeholders.py planned on the sandbox's request as sent: header
    values by position (raw), then the request target (secrets percent-encoded). Runs before the
    rule's injections, which replace their own headers and parameters whole."""
    swaps = check.swaps
    if swaps.headers:
        fields = list(request.headers.fields)
        for index in swaps.headers:
            fields[index] = (fields[index][0], swaps.header_value(index, values).encode("utf-8", "surrogateescape"))
        request.headers.fields = tuple(fields)
    if swaps.target is not None:
        request.path = swaps.new_target(values)


def _body_size_limit() -> int | None:
    return human.parse_size(ctx.options.body_size_limit) if hasattr(ctx.options, "body_size_limit") else None


REDACT_SLICE = 256 * 1024  # bytes of a buffered body redacted per turn of the event loop


async def _decode_buffered(flow: http.HTTPFlow, encoding: str, limit: int, redactor: Redactor) -> tuple[bytes, list[str]]:
    """A buffered compressed body decoded in pieces (gateway/decompress.py), each charged to the
    stream's buffer budget before it is kept, each decoded on a pool thread (addons/decode_pool.py),
    and redacted as it comes (StreamRedactor: a secret across two pieces is still caught whole), the
    sandbox's turn between two: a body that decodes to tens of MiB, a brotli window that takes 50 ms
    to fill, or 28 MiB of short lines that took 0.6 s to redact in one call (a fresh-eyes review),
    does not stall every other client of the worker while it does. The redacted body, and the
    names of the secrets it held."""
    account = flow.metadata.get(BUFFER_ACCOUNT)
    data = flow.response.raw_content or b""
    window = [window_size(encoding, data)]  # what the decoder keeps meanwhile: charged too
    if account is not None and not account.reserve(window[0]):
        raise OverBudget(f"the decoder's window ({window[0]} bytes) is over the buffer budget")

    def grow(more: int) -> bool:  # a later zstd frame's bigger window (runs on a pool thread: the ledger is plain counters)
        if account is not None and not account.reserve(more):
            return False
        window[0] += more
        return True

    try:
        out, hits = bytearray(), []
        stream = StreamRedactor(redactor, on_hit=hits.extend)
        async for piece in decode_pool.pieces(decode_pieces(encoding, data, limit, (window[0], grow))):
            if account is not None and not account.reserve(len(piece)):
                raise OverBudget(f"decoded body over the buffer budget after {len(out)} bytes")
            out += stream(piece)
        out += stream(b"")
        return bytes(out), hits
    finally:
        if account is not None:
            account.release(window[0])


async def _redact_buffered(data: bytes, redactor: Redactor) -> tuple[bytes, list[str]]:
    """A buffered body redacted REDACT_SLICE bytes at a time, the sandbox's turn between two."""
    if len(data) <= REDACT_SLICE:
        return redactor.redact(data)
    out, hits = bytearray(), []
    stream = StreamRedactor(redactor, on_hit=hits.extend)
    for start in range(0, len(data), REDACT_SLICE):
        out += stream(data[start:start + REDACT_SLICE])
        await fair_share.current_turn()
    out += stream(b"")
    return bytes(out), hits


def _kill_on_error(self, flow, *rest, error: Exception) -> None:
    flow.kill()


class _BodyRedactor:
    """Stream callable of a bound response body: decode it on the fly when it is compressed (within
    its budget, gateway/decompress.py), then redact it. Any failure (a body that does not decode,
    one over its decoded budget, an error in the redactor) cuts the body off and kills the flow:
    its headers are out, so no 502 is possible any more, and the client sees a broken response,
    never undecoded or unredacted bytes. The failure is audited with its reason."""

    def __init__(self, flow: http.HTTPFlow, redactor: StreamRedactor, decoder=None, on_failure=None,
                 encoding: str = ""):
        # The flow holds this as its stream callable: a strong reference back was a cycle that kept
        # a cut-off stream's decoder (a 16 MiB brotli window) until a full collection.
        self._flow = weakref.ref(flow)
        self.decoder = decoder
        self.encoding = encoding
        self._window: int | None = None  # the decoder's window, charged to the stream's buffer account
        self.redactor = redactor
        self.on_failure = on_failure
        self.failed = False
        self._ready: list[bytes] | None = None

    @property
    def decodes(self) -> bool:
        """Whether its chunks are decoded: the stream (addons/http_stream.py) then has `steps` driven
        off the loop (addons/decode_pool.py) and hands their output on through `ready`."""
        return self.decoder is not None and not self.failed

    def ready(self, pieces: list[bytes] | None) -> None:
        """What `steps` made for the next call (None: nobody drove it, so the body is cut off)."""
        self._ready = pieces if pieces is not None else [self._fail(RuntimeError("decode step not run"))]

    def __call__(self, chunk: bytes):
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        if self.failed:
            return b""
        if self.decoder is None:
            try:
                return self.redactor(chunk)
            except Exception as exc:
                return self._fail(exc)
        return run_steps(self.steps(chunk))

    def steps(self, chunk: bytes):
        """The redacted output of one compressed chunk (b"": the body's end), sans I/O: each decoder
        call yielded for the caller to run (a pool thread: one brotli call may fill a 16 MiB
        window), the redaction of what it made done here. What a chunk decodes to is never held
        whole (up to RATIO_GRACE for a bomb) beyond the output of this one chunk."""
        out: list[bytes] = []
        if self.failed:
            return out
        try:
            if self._window is None:
                self._charge_window(chunk)
            if chunk:
                pieces = self.decoder.pieces(chunk)
                while (piece := (yield functools.partial(next, pieces, None))) is not None:
                    if piece:
                        out.append(self.redactor(piece))
            else:
                tail = yield self.decoder.flush
                out.append(self.redactor(tail) + self.redactor(b"") if tail else self.redactor(b""))
                self.drop_decoder()  # the body is over: its window goes now
        except Exception as exc:
            out.append(self._fail(exc))
        return out

    def _charge_window(self, first: bytes) -> None:
        """The decoder keeps a window the sender chose (up to 16 MiB of brotli) for the whole
        stream: charged to the stream's buffer account from its first bytes, before it decodes."""
        self._window = window_size(self.encoding, first)
        flow = self._flow()
        account = flow.metadata.get(BUFFER_ACCOUNT) if flow is not None else None
        if account is not None and not account.reserve(self._window):
            self._window = 0
            raise OverBudget(f"the decoder's window ({window_size(self.encoding, first)} bytes) is over the buffer budget")
        self.decoder.guard_window(self._window, self._grow_window)

    def _grow_window(self, more: int) -> bool:
        """A later zstd frame's bigger window, charged before its decoder is made."""
        flow = self._flow()
        account = flow.metadata.get(BUFFER_ACCOUNT) if flow is not None else None
        if account is not None and not account.reserve(more):
            return False
        self._window += more
        return True

    def drop_decoder(self) -> None:
        """The body is over, cut off or refused (also called by the stream when it ends,
        addons/http_stream.py): the decoder and its window go, and its charge with them."""
        if self.decoder is not None:
            self.decoder.close()  # (its window goes even if a step still holds the decoder)
        self.decoder = None
        flow = self._flow()
        account = flow.metadata.get(BUFFER_ACCOUNT) if flow is not None else None
        if account is not None and self._window:
            account.release(self._window)
        self._window = 0

    def _fail(self, exc: Exception) -> bytes:
        self.failed = True
        self.drop_decoder()
        too_large = isinstance(exc, DecodedTooLarge)
        reason = ("buffer_budget" if isinstance(exc, OverBudget) else
                  "response_too_large" if too_large else "undecodable_response")
        logging.getLogger("egress").warning(
            "egress gateway: the response to a credential-bound request was cut off (%s)",
            {"buffer_budget": "the decoder's window is over the buffer budget",
             "response_too_large": "decoded body over its budget"}.get(reason, type(exc).__name__))
        flow = self._flow()
        if flow is not None:
            if self.on_failure is not None:
                self.on_failure(flow, reason)
            flow.kill()
        return b""


class ResponseRedactor:
    def __init__(self, state: GatewayState):
        self.state = state
        _install_websocket_redaction(self.redactor)

    def redactor(self) -> Redactor | None:
        return self.state.redactor()

    def running(self):
        # Whatever a log line quotes (mitmproxy logs WebSocket pings, protocol errors), never a secret.
        _LogRedaction.install(self.redactor)
        QuietAuditFailures.install()  # a full audit disk: counted warnings, not a traceback per refusal

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
        body_redactor = StreamRedactor(self.redactor, on_hit=lambda found: self._count(flow, found, "body"))
        if plan in (Plan.NO_BODY, Plan.REDACT):
            response.stream = _BodyRedactor(flow, body_redactor, on_failure=self._cut_off)
        elif plan is Plan.DECODE_BUFFERED:
            response.stream = False  # decoded and redacted in `response`, or a clean 502
        elif plan is Plan.DECODE_STREAM:
            decoder = stream_decoder(why, _body_size_limit())  # the one coding the plan found
            del response.headers["content-encoding"]
            response.headers.pop("content-length", None)
            if not (flow.request.is_http2 or flow.request.is_http3):
                response.headers["transfer-encoding"] = "chunked"
            response.stream = _BodyRedactor(flow, body_redactor, decoder, on_failure=self._cut_off, encoding=why)
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
            limit = min(_body_size_limit() or DEFAULT_BUFFERED_LIMIT, DEFAULT_BUFFERED_LIMIT)
            try:
                body, hits = await _decode_buffered(flow, encoding[0], limit, redactor)
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
            body, hits = await _redact_buffered(flow.response.raw_content or b"", redactor)
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


def _install_websocket_redaction(get_redactor) -> None:
    """WebSocket control frames (ping/pong payloads, close reasons) pass no hook in mitmproxy.
    Server-to-client frames are unmasked, so redacting the bytes sent to the client (length-
    preserving) covers them; messages are also redacted decoded, in `websocket_message`."""
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers import websocket as ws_module

    if getattr(ws_module.WebsocketLayer, "_egress_redacting", False):
        ws_module.WebsocketLayer._egress_get_redactor = staticmethod(get_redactor)
        return

    class RedactingWebsocketLayer(ws_module.WebsocketLayer):
        _egress_redacting = True
        _egress_get_redactor = staticmethod(get_redactor)

        def handle_event(self, event):
            redactor = self._egress_get_redactor()
            for command in super().handle_event(event):
                if redactor is not None:
                    if (isinstance(command, commands.SendData) and command.connection == self.context.client
                            and BOUND in self.flow.metadata):
                        command.data, _ = redactor.redact(command.data)
                    elif isinstance(command, commands.Log):
                        command.message, _ = redactor.redact_text(command.message)
                yield command

    ws_module.WebsocketLayer = RedactingWebsocketLayer


class _LogRedaction(logging.Filter):
    """A logging filter on every root handler: secret values never reach a log line."""

    _installed: "_LogRedaction | None" = None

    def __init__(self, get_redactor):
        super().__init__()
        self.get_redactor = get_redactor

    @classmethod
    def install(cls, get_redactor) -> None:
        if cls._installed is None:
            cls._installed = cls(get_redactor)
        cls._installed.get_redactor = get_redactor
        for handler in logging.getLogger().handlers:
            if cls._installed not in handler.filters:
                handler.addFilter(cls._installed)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            redactor = self.get_redactor()
            if redactor is not None:
                message = record.getMessage()
                clean, hits = redactor.redact_text(message)
                if hits:
                    record.msg, record.args = clean, ()
                if record.exc_info and record.exc_info[1] is not None:
                    text, hits = redactor.redact_text(str(record.exc_info[1]))
                    if hits:
                        record.exc_info = None
                        record.exc_text = None
                        record.msg = f"{record.msg} [exception text withheld: it contained a secret]"
        except Exception:
            pass
        return True
