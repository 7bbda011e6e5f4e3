"""Small mitmproxy layers the gateway needs and mitmproxy does not have.

- `RefusalLayer` answers a connection the gateway will not inspect (raw TCP in a tunnel, h2c
  prior knowledge, TLS to the proxy port) with a short HTTP error and closes it, at once,
  without ever opening an upstream connection.
- `GatewayHttpLayer` is mitmproxy's HttpLayer with a gateway HTTP/1 server under it: requests
  mitmproxy's parser rejects (a malformed host in the request line, broken framing) and errors
  mitmproxy answers itself (upstream failures, validation) are answered in the gateway's format
  (text body, `X-Egress-Reason`) and recorded in the audit log; request heads are size-limited.
- `TargetFormHttpLayer` (the explicit proxy port) also makes each request remember its target
  as sent: mitmproxy rewrites absolute-form targets to origin-form before any hook sees them,
  and derives a destination from Host for origin-form requests; the gateway must tell them apart.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from mitmproxy import flow as mitm_flow
from mitmproxy.net.http import http1
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import (
    GetHttpConnection,
    GetHttpConnectionCompleted,
    HttpLayer,
    HttpStream,
    RequestHeaders,
)
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestData,
    RequestEndOfMessage,
    RequestProtocolError,
    RequestTrailers,
    ResponseData,
    ResponseHeaders,
    ResponseEndOfMessage,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._hooks import HttpErrorHook
from mitmproxy.proxy.layers.http import SendHttp
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.utils import human
from h11._receivebuffer import ReceiveBuffer
from mitmproxy.proxy.layers.http._http1 import Http1Server, make_body_reader
from mitmproxy.proxy.layers.http._http2 import CATCH_HYPER_H2_ERRORS, Http2Server, StreamState
from mitmproxy.proxy.layers.http._http3 import Http3Server
from mitmproxy.proxy.layers.http import is_h3_alpn
from mitmproxy.proxy.layers.tcp import TCPLayer

import h2.errors
import h2.events
import h2.exceptions

from gateway import h2budget
from gateway.budget import Account
from gateway.decision import Decision
from gateway.failure import failure_detail
from gateway.hostnames import HostError, parse_authority
from gateway.options import DEFAULT_BODY_IDLE_TIMEOUT, DEFAULT_HEAD_TIMEOUT, DEFAULT_MAX_HEAD_BYTES

from . import frame_limits, h2_backpressure, h2_limits, read_ahead
from .http1 import ChunkMerger, MalformedBody, ServerFraming, SmallChunkFlood, TooManyFields, max_header_fields
from .credentials import BOUND, BUFFER_ACCOUNT
from .decode_pool import DecodeSteps, EgressDecodeStepsHook
from .fair_share import EgressPaceHook
from .method_body import BODY_CHECK
from .respond import COUNTS_AS_RESET, raw_http_refusal, refusal_headers

REFUSAL_ATTR = "_egress_refusal"  # a request's refusal decision, for errors mitmproxy sends itself
PIPELINE_HEADS = 2  # bytes sent ahead of a response (HTTP/1 pipelining) are bounded by this many max heads
MAX_EMPTY_LINES = 8  # empty lines ignored before a request line (RFC 9112 2.2: at least one)
# (context, decision, request, method, *, status_sent=True, **audit fields)
OnRefusal = Callable[..., "Decision | None"]

_ERROR_REASONS = {
    ErrorCode.CONNECT_FAILED: ("upstream_failed", "the upstream connection failed"),
    ErrorCode.GENERIC_SERVER_ERROR: ("upstream_failed", "the upstream failed"),
    ErrorCode.RESPONSE_VALIDATION_FAILED: ("upstream_failed", "the upstream response was invalid"),
    ErrorCode.RESPONSE_TOO_LARGE: ("response_too_large", "the upstream response is too large"),
    ErrorCode.REQUEST_TOO_LARGE: ("request_too_large", "the request body is too large"),
    ErrorCode.DESTINATION_UNKNOWN: ("bad_host_header", "the request names no destination"),
    ErrorCode.GENERIC_CLIENT_ERROR: ("malformed_request", "the request is malformed"),
    ErrorCode.REQUEST_VALIDATION_FAILED: ("malformed_request", "the request is malformed"),
}

TARGET_FORM_ATTR = "_egress_target_form"  # "origin" | "absolute" | "authority" | "asterisk"
RAW_AUTHORITY_ATTR = "_egress_raw_authority"
END_STREAM_ATTR = "_egress_end_stream"  # whether the request's head ended it (no body follows)
HOLD_BODY = "egress_hold_body"  # flow.metadata key (addons/request_guard.py, which imports this module)
QUEUE_ALLOWANCE = 256 * 1024  # body bytes a paused stream may queue past its budget (see GatewayHttpStream.handle_event)
_NOT_SCANNED = ("error", RuntimeError("the body check's step did not run"))  # no addon answered its hook: refused


class BodyIdleCheck(events.Event):
    """Sent by the HTTP layer to its streams when a body may have gone past the idle timeout: one
    timer per connection, not per stream (a pending timer keeps its target alive until it fires)."""


@dataclass(frozen=True)
class BodyLimits:
    """What bounds a stream's bodies: `account(context)` its share of the buffer ledger
    (gateway/budget.py; None: not charged), `idle_timeout` the seconds a body may go without a
    byte before its stream ends (0: no limit)."""

    account: Callable[[object], Account | None] | None = None
    idle_timeout: float = DEFAULT_BODY_IDLE_TIMEOUT
    sandbox: Callable[[object], str | None] | None = None  # the key per-sandbox totals are summed under


def in_tunnel(context) -> bool:
    """Whether the layer runs inside a CONNECT tunnel (an HTTP stream holds it). There mitmproxy's
    HttpStream carries no half-close: any close of the client becomes a full one."""
    return any(isinstance(parent, HttpStream) for parent in context.layers)


class RefusalLayer(layer.Layer):
    """Refuses a connection at once: an HTTP error (or `farewell`, raw bytes such as a TLS alert),
    then close.

    With a farewell the close is a lingering one: FIN first, the client's bytes read and thrown away
    until it closes or LINGER seconds pass, then the full close. Closing at once while a client is
    still sending (a multi-MiB ClientHello) makes the kernel answer with a reset, which may destroy
    the alert before the client reads it, and which a stateful firewall may drop (seen with the
    transparent test topology: the client then never learned the connection was gone).

    Inside a CONNECT tunnel mitmproxy's HttpStream turns any close of the client into a full one
    (half-closes are not carried through HTTP), so there the FIN is not sent first: the farewell
    goes out, the client's bytes are read and dropped for up to LINGER seconds (or until it
    closes), then the full close. A TLS client closes on the fatal alert itself."""

    LINGER = 2.0

    def __init__(self, context, decision: Decision, speak_http: bool = True, farewell: bytes = b""):
        super().__init__(context)
        self.decision = decision
        self.speak_http = speak_http
        self.farewell = farewell
        self.refused = False
        self._linger: commands.RequestWakeup | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.refused:
            if self._linger is not None and (
                    (isinstance(event, events.Wakeup) and event.command is self._linger)
                    or (isinstance(event, events.ConnectionClosed) and event.connection == self.context.client)):
                self._linger = None
                yield commands.CloseConnection(self.context.client)
            return
        self.refused = True
        if self.speak_http:
            yield commands.SendData(self.context.client, raw_http_refusal(self.decision))
        elif self.farewell:
            yield commands.SendData(self.context.client, self.farewell)
            if not in_tunnel(self.context):
                yield commands.CloseTcpConnection(self.context.client, half_close=True)
            self._linger = commands.RequestWakeup(self.LINGER)
            yield self._linger
            return
        yield commands.CloseConnection(self.context.client)


TLS_ALERT_HANDSHAKE_FAILURE = b"\x15\x03\x03\x00\x02\x02\x28"  # fatal handshake_failure (RFC 8446 6)


class HoldLayer(layer.Layer):
    """mitmproxy's NextLayer with a deadline: holds a connection's first client bytes until the
    layer guard settles on a layer, and refuses it when that takes too long, even if the client has
    gone silent (NextLayer waits for bytes forever: only `tcp_timeout` ends it).

    `feed(hold, chunk)` is told each new chunk (never the whole buffer again: a reader fed
    incrementally stays linear) and may set `hold.layer`, and `hold.replay` to the bytes the new
    layer is given (by default those kept in `hold.held`); `expire(hold)` sets a refusal layer when
    the deadline passes. Like NextLayer, it is not on the layer stack; unlike it, it stays in the
    event path (one check per event) so that its own timers never reach the layers under it."""

    def __init__(self, context, feed: Callable[["HoldLayer", bytes], None],
                 expire: Callable[["HoldLayer"], None], timeout: float):
        super().__init__(context)
        self.context.layers.remove(self)
        self.layer: layer.Layer | None = None
        self.feed, self.expire = feed, expire
        self.held = bytearray()  # bytes the feed keeps for a decision on the whole (a first line)
        self.replay: bytes | None = None
        self.started = time.monotonic()
        self.timeout = 0.0
        self.events: list[events.Event] = []  # held non-data events (Start) to replay
        self._timers: set[commands.RequestWakeup] = set()
        self._deadline: list[commands.RequestWakeup] = []
        self.deadline(timeout)

    def deadline(self, timeout: float) -> None:
        """(Re)set the deadline, counted from the first byte."""
        self.timeout = timeout
        if timeout:
            wakeup = commands.RequestWakeup(max(0.0, timeout - (time.monotonic() - self.started)))
            self._timers.add(wakeup)
            self._deadline.append(wakeup)

    def data_client(self) -> bytes:
        return bytes(self.held)

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup) and event.command in self._timers:
            self._timers.discard(event.command)
            if self.layer is None and self.timeout:
                if time.monotonic() - self.started >= self.timeout:
                    self._call(self.expire)
                    yield from self._decided()
                else:  # woken early: wait for the rest
                    self.deadline(self.timeout)
                    while self._deadline:
                        yield self._deadline.pop(0)
            return
        if self.layer is not None:
            yield from self.layer.handle_event(event)
            return
        while self._deadline:
            yield self._deadline.pop(0)
        if isinstance(event, events.DataReceived) and event.connection == self.context.client:
            self._call(self.feed, event.data)
            yield from self._decided()
        elif isinstance(event, events.ConnectionClosed) and event.connection == self.context.client:
            yield commands.CloseConnection(self.context.client)  # as NextLayer does
        else:
            self.events.append(event)
        while self._deadline:  # a feed may have moved the deadline
            yield self._deadline.pop(0)

    def _call(self, callback, *args) -> None:
        """Fail closed: a callback that raises leaves the connection refused, never undecided."""
        try:
            callback(self, *args)
        except Exception as exc:
            logging.getLogger("egress.failclosed").error(
                "egress gateway: holding the first bytes failed closed: %s", type(exc).__name__, exc_info=exc)
            self.layer = RefusalLayer(self.context, Decision.deny(
                "internal_error", "the gateway failed while reading the first bytes"), False)

    def _decided(self) -> layer.CommandGenerator[None]:
        if self.layer is None:
            return
        replay = bytes(self.held) if self.replay is None else self.replay
        self.held = bytearray()
        held, self.events = self.events, []
        for event in held:
            yield from self.layer.handle_event(event)
        if replay:
            yield from self.layer.handle_event(events.DataReceived(self.context.client, replay))

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:  # pragma: no cover
        yield from self.handle_event(event)


def _request_method(head: list[bytes]) -> str | None:
    method = head[0].split(b" ", 1)[0] if head else b""
    return method.decode("ascii", "replace")[:20] or None


def _classify_bad_head(head: list[bytes], error: ValueError) -> Decision:
    """Why mitmproxy's parser refused a request head, as a gateway decision."""
    message = str(error)[:300]
    try:
        method, target, _version = head[0].split(b" ")
        if method == b"CONNECT":
            parse_authority(target.decode("utf-8", "surrogateescape"))
        elif b"://" in target:
            authority = target.split(b"://", 1)[1].split(b"/", 1)[0].split(b"?", 1)[0]
            parse_authority(authority.decode("utf-8", "surrogateescape"), 80)
    except HostError as exc:
        return Decision.deny("bad_host", f"bad host in the request line: {exc}")
    except (ValueError, IndexError):
        pass
    return Decision.deny("malformed_request", f"malformed request: {message}")


def protocol_error_decision(event) -> Decision:
    """The gateway's words for an error mitmproxy raised on a stream: the reason by error code, and
    its text with every byte it quotes withheld (gateway/failure.py)."""
    reason, what = _ERROR_REASONS[event.code]
    return Decision.deny(reason, f"{what}: {failure_detail(event.message)}")


def _report(on_refusal: OnRefusal, context, decision: Decision, request=None, method: str | None = None,
            status_sent: bool = True) -> Decision:
    """Audit a refusal; returns the decision to send (its message redacted by the listener).
    `status_sent`: False for a message cut off after its head went out (no refusal status)."""
    try:
        method = method or getattr(request, "method", None)
        if not status_sent:
            return on_refusal(context, decision, request, method, status_sent=False) or decision
        return on_refusal(context, decision, request, method) or decision
    except Exception:  # e.g. the audit disk is full: the refusal still goes out
        logging.getLogger("egress").exception("egress gateway: could not record a refusal")
        return decision


class GatewayHttp1Server(ServerFraming, Http1Server):
    def __init__(self, context, on_refusal: OnRefusal, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 head_timeout: float = DEFAULT_HEAD_TIMEOUT, sandbox: str | None = None, streams: dict | None = None):
        super().__init__(context)
        self.on_refusal = on_refusal
        self._take_small = functools.partial(frame_limits.take, sandbox or "unknown")
        self._streams = streams if streams is not None else {}  # the HTTP layer's streams, by id
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        self.max_header_fields = max_header_fields(context)
        self._head_started: float | None = None  # when the first byte of the current head came
        self._empty_lines = 0  # empty lines skipped since the last head (MAX_EMPTY_LINES)
        self._head_wakeup: commands.RequestWakeup | None = None  # the timer for that head

    def _refuse(self, decision: Decision, request=None, method: str | None = None) -> layer.CommandGenerator[None]:
        decision = _report(self.on_refusal, self.context, decision, request, method)
        yield commands.SendData(self.conn, raw_http_refusal(decision))
        yield commands.CloseConnection(self.conn)
        self.state = self.done

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup):
            if event.command is self._head_wakeup:
                self._head_wakeup = None
                yield from self._head_deadline()
            return
        if isinstance(event, events.DataReceived):
            if self.state == self.done:
                return  # refused or finished: nothing reads these bytes, so they are not kept
            if self.state == self.wait and len(self.buf) + len(event.data) > self.max_pipelined_bytes:
                yield from self._refuse_pipeline()
                return
        yield from super()._handle_event(event)

    @property
    def max_pipelined_bytes(self) -> int:
        """Bytes a client may send ahead while its request is in flight: mitmproxy keeps them
        unparsed (`wait` state) until the response is done, without limit."""
        return PIPELINE_HEADS * self.max_head_bytes

    def _refuse_pipeline(self) -> layer.CommandGenerator[None]:
        """Too much sent ahead of the answer: the request in flight gets the refusal if its response
        has not started (else the connection is cut), its stream ends, the connection closes."""
        yield from self._cut(Decision.deny("pipeline_too_large",
                                           f"more than {self.max_pipelined_bytes} bytes were sent ahead of a response"),
                             "the client sent too much ahead of a response")

    def _cut(self, decision: Decision, why: str) -> layer.CommandGenerator[None]:
        """The request in flight gets the refusal if its response has not started (else the
        connection is cut), its stream ends (an upstream request is reset), the connection closes."""
        flow = getattr(self._streams.get(self.stream_id), "flow", None)
        allowed_by = flow.metadata.get("egress_decision") if flow is not None else None
        if decision.rule is None and getattr(allowed_by, "rule", None):
            decision = replace(decision, rule=allowed_by.rule)  # the audit line names the rule it ran under
        decision = _report(self.on_refusal, self.context, decision, self.request,
                           status_sent=self.response is None)
        if self.response is None and self.conn.state & ConnectionState.CAN_WRITE:
            yield commands.SendData(self.conn, raw_http_refusal(decision))
        yield commands.CloseConnection(self.conn)
        self.state = self.done
        self.buf = ReceiveBuffer()
        if self.stream_id is not None:
            yield ReceiveHttp(RequestProtocolError(self.stream_id, why, code=ErrorCode.CLIENT_DISCONNECTED))

    def _head_deadline(self) -> layer.CommandGenerator[None]:
        """A head started but did not complete in time, even if the client went silent."""
        started = self._head_started
        if self.state == self.read_headers and started is not None:
            if time.monotonic() - started >= self.head_timeout:
                yield from self._refuse(Decision.deny(
                    "request_head_timeout", f"the request head took more than {self.head_timeout:g}s"))
            else:
                self._head_wakeup = commands.RequestWakeup(self.head_timeout - (time.monotonic() - started))
                yield self._head_wakeup

    def read_headers(self, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
        if not isinstance(event, events.DataReceived):
            return (yield from super().read_headers(event))
        now = time.monotonic()
        if self._head_started is None:
            self._head_started = now
            if self.head_timeout and self._head_wakeup is None:
                self._head_wakeup = commands.RequestWakeup(self.head_timeout)
                yield self._head_wakeup
        request_head = self.buf.maybe_extract_lines()
        skipped = 0
        while request_head == [] and self._empty_lines < MAX_EMPTY_LINES:
            # An empty line before the request line (h11 extracts it as an empty head): ignored, as
            # RFC 9112 2.2 asks (clients send a CRLF after a POST body); the head behind it is read now.
            # Counted across reads until a head comes (review 10: 7 a read, 200 times, passed).
            skipped += 1
            self._empty_lines += 1
            request_head = self.buf.maybe_extract_lines()
        if request_head == []:
            yield from self._refuse(Decision.deny(
                "malformed_request", f"more than {MAX_EMPTY_LINES} empty lines before a request line"))
            return
        if skipped and request_head is None and not self.buf:
            self._head_started = None  # only empty lines came: no head has begun (review 9: an idle
            return  # keep-alive connection after a POST's CRLF got an unsolicited 408 at 30 s)
        if not request_head:
            if len(self.buf) > self.max_head_bytes:
                yield from self._refuse(Decision.deny("request_head_too_large", "the request head is too large"))
            elif self.head_timeout and now - self._head_started > self.head_timeout:
                # A client trickling a head byte by byte (slowloris) never trips the idle timeout.
                yield from self._refuse(Decision.deny(
                    "request_head_timeout", f"the request head took more than {self.head_timeout:g}s"))
            return
        self._head_started = None
        self._empty_lines = 0
        if sum(len(line) for line in request_head) > self.max_head_bytes:
            yield from self._refuse(Decision.deny("request_head_too_large", "the request head is too large"))
            return
        if len(request_head) - 1 > self.max_header_fields > 0:  # (each line: a field or an obs-fold)
            # Checked before parsing: each field costs every later lookup (12,000 of them in 60 KB
            # cost ~100 ms of the loop per request in mitmproxy's and the gateway's header checks).
            yield from self._refuse(_too_many_fields(len(request_head) - 1, self.max_header_fields), None,
                                    _request_method(request_head))
            return
        head = [bytes(x) for x in request_head]
        try:
            self.request = http1.read_request_head(head)
            expected_body_size = http1.expected_http_body_size(self.request)
        except ValueError as exc:
            yield from self._refuse(_classify_bad_head(head, exc), self.request, _request_method(head))
            return
        yield ReceiveHttp(RequestHeaders(self.stream_id, self.request, expected_body_size == 0))
        self.body_reader = make_body_reader(expected_body_size)
        self.state = self.read_body
        yield from self.state(event)

    def read_body(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not isinstance(self.body_reader, ChunkMerger):
            self.body_reader = ChunkMerger(self.body_reader, self._take_small, self.max_header_fields)
        try:
            yield from super().read_body(event)
        except TooManyFields as too_many:
            # Checked before h11 parses the section (12,000 trailer fields cost ~80 ms of the loop).
            yield from self._cut(Decision.deny("too_many_header_fields", f"the request's {too_many} "
                                               f"(egress_max_header_fields)"),
                                 "the client sent a trailer section of too many fields")
            return
        except SmallChunkFlood as flood:
            yield from self._cut(Decision.deny("small_frame_flood", f"{flood}; the connection was closed"),
                                 "the client sent too many small chunks")
            return
        except MalformedBody as bad:
            # mitmproxy closed such a connection without a word or an audit line.
            yield from self._cut(Decision.deny("malformed_request", f"the request body's framing is malformed ({bad})"),
                                 "the client sent a malformed body")
            return
        except NotImplementedError:
            # mitmproxy cannot relay request trailers and would leave the connection hanging.
            yield from self._refuse(Decision.deny("malformed_request", "request trailers are not supported"),
                                    self.request, getattr(self.request, "method", None))
            return
        if self.state == self.read_body and len(self.buf) > self.max_head_bytes:
            # What h11 left unread is an unfinished chunk-size line (its extensions) or trailer
            # section: h11 bounds neither (300 MiB of one grew a worker by 300 MiB).
            yield from self._cut(Decision.deny("chunk_line_too_large", f"a chunk-size line or the trailer section "
                                               f"passed {self.max_head_bytes} bytes"),
                                 "the client sent a chunk-size line or trailer section too large")

    def send(self, event) -> layer.CommandGenerator[None]:
        if (yield from self.send_framed(event)):
            return
        if isinstance(event, ResponseProtocolError) and not self.response:
            decision = getattr(event, REFUSAL_ATTR, None) or getattr(self.request, REFUSAL_ATTR, None)
            if decision is None and event.code in _ERROR_REASONS:
                decision = _report(self.on_refusal, self.context, protocol_error_decision(event), self.request)
            if decision is not None and event.code.http_status_code() is not None:
                if self.conn.state & ConnectionState.CAN_WRITE:
                    yield commands.SendData(self.conn, raw_http_refusal(decision))
                    yield commands.CloseConnection(self.conn)
                return
        yield from super().send(event)


def _regular_fields(headers) -> int:
    """The header fields of an HTTP/2 header list, its pseudo-header fields not counted."""
    return sum(1 for name, _ in headers if not name.startswith(b":"))


def _too_many_fields(count: int, limit: int, section: str = "header") -> Decision:
    return Decision.deny("too_many_header_fields", f"the request's {section} section has {count} fields, "
                                                   f"more than egress_max_header_fields ({limit})")


class GatewayHttp2Server(Http2Server):
    """mitmproxy's HTTP/2 server, except that
    - an error it would answer with its own HTML page (quoting what failed) is answered in the
      gateway's format: text body, X-Egress-Reason (no body at all to a HEAD request);
    - what waits for the client's flow-control window is reported to addons/h2_backpressure.py
      after every event, which holds the upstream readers while it is too much;
    - the per-connection budgets of gateway/h2budget.py apply (options: addons/h2_limits.py):
      concurrent streams (over: RST_STREAM REFUSED_STREAM, `too_many_streams`), resets in a sliding
      window (over: GOAWAY ENHANCE_YOUR_CALM and close, `reset_flood`), and request-body bytes held
      in memory (a stream whose next DATA frame would pass the budget gets 503 `buffer_budget`);
      a stream the client reset before its HEADERS were handled never becomes a request. Refused
      streams are audited at most once per second and reason, with a `repeated` count;
    - one read's HTTP/2 events are handled through a backlog, at most STREAMS_PER_STEP new requests
      per step of the event loop, and no more once STEP_SECONDS were spent in it: each request is
      decided when it is handled (~0.3-1 ms), and a read of 100 HEADERS frames held every other
      connection of the worker for ~120 ms; 8 of them, 2-15 ms (rapid reset)."""

    STREAMS_PER_STEP = 8
    STEP_SECONDS = 0.001

    def __init__(self, context, on_refusal: OnRefusal, streams: dict | None = None, sandbox: str | None = None,
                 account: Account | None = None):
        super().__init__(context)
        self._sandbox = sandbox  # what waits for this client's window is summed per sandbox too
        self._frames_account = account  # the incomplete frame and header block held (buffer budget)
        self.on_refusal = on_refusal
        self._head_requests: set[int] = set()  # streams whose request is a HEAD: answers carry no body
        self._counted_refusals: set[int] = set()  # streams answered 429 by the gateway: count as resets
        self.limits = h2_limits.Limits.from_options(context.options)
        self.resets = h2budget.ResetTracker(self.limits.max_resets, self.limits.reset_window)
        self.h2_conn = h2_limits.LimitedH2Connection(self.h2_conf, self.limits.max_concurrent_streams,
                                                     self.limits.max_control_frames,
                                                     functools.partial(frame_limits.take, sandbox or "unknown"),
                                                     self.resets, self.limits.max_head_bytes)
        self.aggregate = h2budget.RefusalAggregator()
        self.ledger = h2budget.BufferLedger(self.limits.max_buffered_bytes)
        self._streams = streams if streams is not None else {}  # the HTTP layer's streams, by id
        self._flush_wakeup: commands.RequestWakeup | None = None
        self._backlog: deque = deque()  # h2 events parsed and not handled yet, in order
        self._backlog_bytes = 0  # the DATA those events carry (charged with the pending frames)
        self._backlog_wakeup: commands.RequestWakeup | None = None
        self._block_wakeup: commands.RequestWakeup | None = None  # the deadline of an unfinished header block
        self._block_due = 0.0  # when that wakeup fires (monotonic)
        self.h2_conn.incoming_buffer.clock = h2_backpressure.reading_clock(context.client)

    def _unread(self) -> int:
        unread = 0
        for stream_id, buffer in list(self.h2_conn.stream_buffers.items()):
            if self.is_closed(stream_id):  # reset by the client: that data will never be sent
                self.h2_conn.stream_buffers.pop(stream_id, None)
                continue
            unread += sum(len(item.data) for item in buffer)
        return unread

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup):
            if event.command is self._flush_wakeup:
                self._flush_wakeup = None
                yield from self._write_held_back(self.aggregate.due(time.monotonic()))
                if self.aggregate.held_back:  # woken a little early: the rest on the next timer
                    self._flush_wakeup = commands.RequestWakeup(self.aggregate.interval)
                    yield self._flush_wakeup
            elif event.command is self._backlog_wakeup:
                self._backlog_wakeup = None
                yield from self._tracked(self._run_backlog())
                h2_backpressure.update(self.context.client, self._unread(), self._sandbox)
                self._charge_pending_frames()  # (only less is held now: what the step handled is released)
            elif event.command is self._block_wakeup:
                self._block_wakeup = None
                yield from self._block_deadline()
            return
        if isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            self._drop_backlog()  # what the client sent before it closed: its streams fail with it
        yield from self._handle(event)
        if isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            h2_backpressure.release(self.context.client)
            if self._frames_account is not None:
                self._frames_account.close()
            return
        h2_backpressure.update(self.context.client, self._unread(), self._sandbox)
        if isinstance(event, events.DataReceived) and event.connection is self.conn and not self._closing:
            if not self._charge_pending_frames():
                yield from self._over_budget()
                return
        if (wait := self._pending_wait()) is not None:
            yield from self._arm_deadline(wait)

    def _arm_deadline(self, wait: float) -> layer.CommandGenerator[None]:
        """A wakeup for what is pending, unless one already armed fires first. A new one when the
        deadline came nearer (review 12: a partial DATA frame's 30 s timer, armed first, held the
        3 s deadline of the header block that followed it for the full 30 s)."""
        due = time.monotonic() + wait
        if self._block_wakeup is not None and self._block_due <= due + 0.05:
            return
        self._block_due = due
        self._block_wakeup = commands.RequestWakeup(wait)
        yield self._block_wakeup

    def _pending_bytes(self) -> int:
        return self.h2_conn.incoming_buffer.pending_bytes + self._backlog_bytes

    def _charge_pending_frames(self) -> bool:
        """The bytes of an incomplete frame and of an unfinished header block are buffered here
        until they are whole (up to the frame size, 128 KiB, per connection), and the DATA of
        frames parsed but still in the backlog until their turn (the gateway's windows do not
        bound it: it advertises 2 GiB, as mitmproxy does; a read of 100 HEADERS and the reads of
        DATA behind them held ~800 KiB uncharged): charged to the connection's and the sandbox's
        buffer budget like a body (review 12: 300 connections each holding a partial frame took
        75 MiB past an 8 MiB sandbox budget). False: over budget."""
        account = self._frames_account
        if account is None:
            return True
        pending = self._pending_bytes()
        if pending < account.held:
            account.release(account.held - pending)
        elif pending > account.held:
            return account.reserve(pending - account.held)
        return True

    def _over_budget(self) -> layer.CommandGenerator[None]:
        pending = self._pending_bytes()
        self._drop_backlog()  # (not acted on: the GOAWAY's last stream id says so)
        self.h2_conn.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        yield from self._goaway(Decision.deny(
            "buffer_budget", f"HTTP/2 frames received and not handled yet ({pending} bytes: an incomplete frame or "
                             f"header block, DATA waiting its turn) would pass the connection's or the sandbox's "
                             f"buffer budget; the connection was closed (GOAWAY)"),
            bytes=pending)

    def _pending_wait(self) -> float | None:
        """Seconds until what is pending of a frame or header block must have arrived (None: nothing
        is): its deadline counts the time the gateway reads this client, capped on the wall clock at
        tcp_timeout, which the deadline's own wakeups would otherwise keep from ever firing."""
        buffer = self.h2_conn.incoming_buffer
        deadline = buffer.deadline(self.limits.head_timeout, self.limits.data_frame_timeout)
        if deadline is None:
            return None
        wait = deadline - buffer.clock()
        cap = float(getattr(self.context.options, "tcp_timeout", 0) or 0)
        if cap and buffer.pending_wall is not None:
            wait = min(wait, buffer.pending_wall + cap - time.monotonic())
        return max(wait, 0.0)

    def _block_deadline(self) -> layer.CommandGenerator[None]:
        """A header block started and did not end in time (HEADERS without END_HEADERS, then silence
        or a trickle of CONTINUATION frames), or a frame other than DATA did not arrive whole in time
        (a 128 KiB HEADERS frame trickled): the HTTP/1 head timeout's counterpart. No stream can be
        answered (its block is not decoded): GOAWAY and close, as a flood."""
        wait = self._pending_wait()
        if wait is None or self._closing:
            return  # the block or frame ended, or the connection is already closing
        if wait > 0:  # woken early, or the gateway stopped reading the client meanwhile
            # (at most once a second: a clock stopped with a few ms left polled ~300 times a second)
            yield from self._arm_deadline(max(wait, 1.0))
            return
        buffer = self.h2_conn.incoming_buffer
        self.h2_conn.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        if buffer.partial_data and buffer.block_started is None:  # a DATA frame: a body that stopped moving
            decision = Decision.deny("request_body_timeout", f"an HTTP/2 DATA frame (or a frame header cut "
                                                             f"before its type) took more than "
                                                             f"{self.limits.data_frame_timeout:g}s to arrive; the "
                                                             f"connection was closed (GOAWAY)")
        else:
            decision = Decision.deny("request_head_timeout", f"an HTTP/2 header block (or frame) took more than "
                                                             f"{self.limits.head_timeout:g}s to arrive; the "
                                                             f"connection was closed (GOAWAY)")
        yield from self._goaway(decision, bytes=self.h2_conn.incoming_buffer.pending_bytes)

    # --- budgets ------------------------------------------------------------------------------

    def handle_h2_event(self, event) -> layer.CommandGenerator[bool]:
        now = time.monotonic()
        if isinstance(event, h2.exceptions.DenialOfServiceError):  # HPACK decoded past the header-list limit
            event = h2_limits.HeaderBlockTooLarge(
                f"an HTTP/2 header block decoded to more than {self.limits.max_head_bytes} bytes", 0)
        if isinstance(event, h2_limits.ControlFlood):
            return (yield from self._control_flood(event))
        if isinstance(event, h2.exceptions.ProtocolError):  # (PUSH_PROMISE from a client, a stray CONTINUATION...)
            self._record(Decision.deny("malformed_request", f"HTTP/2 protocol error: {str(event)[:200]}; the "
                                                            f"connection was closed (GOAWAY)"),
                         None, event="connection", status_sent=False)
        if isinstance(event, h2_limits.StreamRefused):
            yield from self._audit(Decision.deny(
                "too_many_streams", f"more than {self.limits.max_concurrent_streams} concurrent HTTP/2 streams; "
                "this one was refused (RST_STREAM REFUSED_STREAM)"))
            return (yield from self._count_reset(now))
        if isinstance(event, h2.events.RequestReceived) and self.is_closed(event.stream_id):
            return False  # reset by the client before it was handled: no request at all (its reset is counted)
        if isinstance(event, h2.events.RequestReceived):
            self.h2_conn.acted_on = max(self.h2_conn.acted_on, event.stream_id)  # its GOAWAY's last stream
            if (fields := _regular_fields(event.headers)) > self.limits.max_header_fields > 0:
                yield from self._refuse_head(event, _too_many_fields(fields, self.limits.max_header_fields))
                return (yield from self._count_reset(now))
        if (isinstance(event, h2.events.TrailersReceived) and event.stream_id in self.streams
                and (fields := _regular_fields(event.headers)) > self.limits.max_header_fields > 0):
            stream = self._streams.get(event.stream_id)
            flow = getattr(stream, "flow", None)
            yield from self._refuse_stream(event.stream_id, _too_many_fields(fields, self.limits.max_header_fields, "trailer"),
                                           flow.request if flow is not None else None)
            return (yield from self._count_reset(now))
        if isinstance(event, h2.events.StreamReset):  # counted as its frame was parsed (ResetFlood)
            self.ledger.release(event.stream_id)
            return (yield from super().handle_h2_event(event))
        if (isinstance(event, h2.events.DataReceived) and event.data
                and self.streams.get(event.stream_id) is StreamState.HEADERS_RECEIVED):
            if not (yield from self._hold(event)):
                return False
        return (yield from super().handle_h2_event(event))

    def _refuse_head(self, event: h2.events.RequestReceived, decision: Decision) -> layer.CommandGenerator[None]:
        """A request refused on its head alone, before any hook saw it: its answer, and a reset if
        its body is still to come."""
        decision = yield from self._audit(decision)
        head = (b":method", b"HEAD") in event.headers
        if head:
            self._head_requests.add(event.stream_id)
        self._send_refusal(event.stream_id, decision)
        self._head_requests.discard(event.stream_id)
        if not self.is_closed(event.stream_id):
            self.h2_conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)  # RFC 9113 8.1
        yield commands.SendData(self.conn, self.h2_conn.data_to_send())

    def _count_reset(self, now: float) -> layer.CommandGenerator[bool]:
        """One stream reset early (by the client, or refused here). Over the limit: GOAWAY and close."""
        if not self.resets.note(now):
            return False
        decision = Decision.deny("reset_flood", f"more than {self.limits.max_resets} HTTP/2 streams reset in "
                                                f"{self.limits.reset_window:g}s; the connection was closed (GOAWAY)")
        self._record(decision, None, event="connection", status_sent=False, resets=self.resets.total)
        self._linger_close = True
        yield from self.protocol_error(f"egress gateway: {decision.message}", h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        return True

    def _control_flood(self, event) -> layer.CommandGenerator[bool]:
        """A flood h2 stopped parsing at (too many control frames, small frames or resets): it has
        queued GOAWAY ENHANCE_YOUR_CALM and read no further. One audit line, then the lingering
        close."""
        decision = Decision.deny(event.reason, f"{event}; the connection was closed (GOAWAY)")
        if isinstance(event, h2_limits.ResetFlood):
            counted = {"resets": self.resets.total}
        elif isinstance(event, h2_limits.SmallFrameFlood):
            decision, counted = Decision.deny(event.reason, str(event)), {"frames": self.h2_conn.small_frames}
        elif isinstance(event, h2_limits.HeaderBlockTooLarge):
            counted = {"bytes": event.size} if event.size else {}
        elif isinstance(event, h2_limits.FrameTooLarge):
            counted = {}
        else:
            counted = {"frames": self.h2_conn.control.total}
        return (yield from self._goaway(decision, **counted))

    def _goaway(self, decision: Decision, **counted) -> layer.CommandGenerator[bool]:
        """The connection ends on the gateway's GOAWAY (already queued): one audit line, then the
        lingering close."""
        self._record(decision, None, event="connection", status_sent=False, **counted)
        self._linger_close = True
        yield commands.Log(f"{human.format_address(self.conn.peername)}: egress gateway: {decision.message}")
        yield commands.SendData(self.conn, self.h2_conn.data_to_send())
        yield from self.close_connection(f"egress gateway: {decision.message}")
        return True

    def _holding(self, stream) -> bool:
        """Whether the stream keeps what it is given in memory: its head still being decided (events
        queue while a hook runs) or its body buffered until it ends (below stream_large_bodies)."""
        if stream is None:
            return False
        if stream._paused is not None:
            return stream.client_state not in (stream.state_done, stream.state_errored)
        return stream.client_state in (stream.state_wait_for_request_headers, stream.state_consume_request_body)

    def _hold(self, event) -> layer.CommandGenerator[bool]:
        """Before a DATA frame goes up: True to pass it on, False when its stream was refused."""
        for stream_id in list(self.ledger.held):
            if not self._holding(self._streams.get(stream_id)):
                self.ledger.release(stream_id)
        stream = self._streams.get(event.stream_id)
        if not self._holding(stream) or self.ledger.admit(event.stream_id, len(event.data)):
            return True
        self.h2_conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        flow = getattr(stream, "flow", None)
        decision = Decision.deny("buffer_budget", f"the request bodies this HTTP/2 connection has buffered would pass "
                                                  f"{self.limits.max_buffered_bytes} bytes; this stream was refused")
        yield from self._refuse_stream(event.stream_id, decision, flow.request if flow is not None else None)
        yield from self._count_reset(time.monotonic())
        return False

    def _refuse_stream(self, stream_id: int, decision: Decision, request) -> layer.CommandGenerator[None]:
        """Answer the stream with the refusal, reset what is left of it, and end its HTTP stream
        (which drops what it buffered and aborts an upstream stream already under way)."""
        self.ledger.release(stream_id)
        decision = yield from self._audit(decision, request)
        stream = self.h2_conn.streams.get(stream_id)
        if self.is_open_for_us(stream_id) and stream is not None and not stream.state_machine.headers_sent:
            self._send_refusal(stream_id, decision)
        if not self.is_closed(stream_id):
            self.h2_conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)  # stop sending the body
        yield commands.SendData(self.conn, self.h2_conn.data_to_send())
        if self.streams.pop(stream_id, None) is not None:
            error = RequestProtocolError(stream_id, f"egress gateway: {decision.message}",
                                         ErrorCode.GENERIC_CLIENT_ERROR)
            setattr(error, REFUSAL_ATTR, decision)
            yield ReceiveHttp(error)

    def _audit(self, decision: Decision, request=None) -> layer.CommandGenerator[Decision]:
        """One audit line per reason and second; the rest are counted into the next one."""
        count = self.aggregate.note(decision.reason, time.monotonic())
        if count is None:
            if self._flush_wakeup is None:
                self._flush_wakeup = commands.RequestWakeup(self.aggregate.interval)
                yield self._flush_wakeup
            return decision
        return self._record(decision, request, repeated=count)

    def _write_held_back(self, counts: dict[str, int]) -> layer.CommandGenerator[None]:
        for reason, count in counts.items():
            self._record(Decision.deny(reason, f"{count} more HTTP/2 streams refused ({reason}) in the last second"),
                         None, repeated=count)
        yield from ()

    def _record(self, decision: Decision, request, **fields) -> Decision:
        fields.setdefault("status_sent", decision.reason in ("buffer_budget", "too_many_header_fields"))
        try:
            return self.on_refusal(self.context, decision, request, getattr(request, "method", None), **fields) \
                or decision
        except Exception:  # e.g. the audit disk is full: the refusal still goes out
            logging.getLogger("egress").exception("egress gateway: could not record a refusal")
            return decision

    GOAWAY_LINGER = 2.0  # seconds a closed flood's GOAWAY may take to be read (RefusalLayer.LINGER)
    _linger_close = False  # set when the gateway itself ends the connection with GOAWAY
    _linger: commands.RequestWakeup | None = None

    _closing = False

    def close_connection(self, msg: str) -> layer.CommandGenerator[None]:
        self._closing = True
        for reason, count in self.aggregate.flush().items():
            self._record(Decision.deny(reason, f"{count} more HTTP/2 streams refused ({reason})"), None,
                         repeated=count)
        if not self._linger_close:
            yield from super().close_connection(msg)
            return
        # The gateway's own GOAWAY (reset_flood): a full close while the flooder is still writing
        # makes the kernel answer with a reset, which destroys the GOAWAY before the client reads it
        # (the client then cannot tell a refusal from a crash). FIN first; the full close when the
        # client closes or after GOAWAY_LINGER seconds, whatever it sends meanwhile thrown away.
        # Inside a CONNECT tunnel there is no FIN first (as RefusalLayer): mitmproxy's HttpStream
        # turns the half-close into a full close, which reset the connection a few ms after the
        # GOAWAY while the flood was still arriving (the client then saw an EOF and no GOAWAY, in
        # 5 of 8 runs on a busy machine: tests/e2e/test_h2_limits.py).
        if not in_tunnel(self.context):
            yield commands.CloseTcpConnection(self.conn, half_close=True)
        self._linger = commands.RequestWakeup(self.GOAWAY_LINGER)
        yield self._linger
        for stream_id in self.streams:
            yield ReceiveHttp(self.ReceiveProtocolError(stream_id, msg, self.ReceiveProtocolError.code))
        self.streams.clear()
        self._handle_event = self._lingering

    def _lingering(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self._linger is not None and (
                (isinstance(event, events.Wakeup) and event.command is self._linger)
                or (isinstance(event, events.ConnectionClosed) and event.connection is self.conn)):
            self._linger = None
            h2_backpressure.release(self.context.client)
            if self._frames_account is not None:  # (the budget addon also drops it when the client is gone)
                self._frames_account.close()
            yield commands.CloseConnection(self.conn)

    # --- answers in the gateway's format --------------------------------------------------------

    def _send_refusal(self, stream_id: int, decision: Decision) -> None:
        body = decision.body().encode()
        headers = [(b":status", b"%d" % decision.status)]
        headers += [(k.lower().encode(), v.encode()) for k, v in refusal_headers(decision).items()]
        headers.append((b"content-length", b"%d" % len(body)))
        if stream_id in self._head_requests:
            self.h2_conn.send_headers(stream_id, headers, end_stream=True)
        else:
            self.h2_conn.send_headers(stream_id, headers)
            self.h2_conn.send_data(stream_id, body, end_stream=True)

    def _handle(self, event: events.Event) -> layer.CommandGenerator[None]:
        if (isinstance(event, ResponseProtocolError) and event.code in _ERROR_REASONS
                and event.code.http_status_code() is not None and self.is_open_for_us(event.stream_id)
                and not self.h2_conn.streams[event.stream_id].state_machine.headers_sent):
            decision = getattr(event, REFUSAL_ATTR, None)  # a refusal the gateway decided and audited itself
            if decision is None:
                decision = _report(self.on_refusal, self.context, protocol_error_decision(event))
            self._send_refusal(event.stream_id, decision)
            yield commands.SendData(self.conn, self.h2_conn.data_to_send())
            return
        if isinstance(event, ResponseHeaders) and getattr(event.response, COUNTS_AS_RESET, False):
            self._counted_refusals.add(event.stream_id)  # a gateway 429 (addons/respond.py refuse)
        if isinstance(event, events.DataReceived) and event.connection is self.conn:
            yield from self._tracked(self._received(event.data))
        else:
            yield from self._tracked(super()._handle_event(event))
        if isinstance(event, (ResponseEndOfMessage, ResponseProtocolError)):
            self._head_requests.discard(event.stream_id)
            if event.stream_id in self._counted_refusals:
                self._counted_refusals.discard(event.stream_id)
                # Once its answer is out: a flood of rate refusals ends like a flood of resets (GOAWAY).
                yield from self._count_reset(time.monotonic())


    def _tracked(self, commands_) -> layer.CommandGenerator[None]:
        """The commands, noting the streams whose request is a HEAD (their answers carry no body)."""
        for command in commands_:
            if isinstance(command, ReceiveHttp) and isinstance(command.event, RequestHeaders):
                if command.event.request.method.upper() == "HEAD":
                    self._head_requests.add(command.event.stream_id)
            yield command

    def _received(self, data: bytes) -> layer.CommandGenerator[None]:
        """mitmproxy's handling of the client's bytes, with the events put in the backlog."""
        try:
            try:
                parsed = self.h2_conn.receive_data(data)
            except CATCH_HYPER_H2_ERRORS as e:  # (as mitmproxy: defence in depth for hyper-h2 bugs)
                raise h2.exceptions.ProtocolError(f"uncaught hyper-h2 error: {e}") from e
        except h2.exceptions.ProtocolError as e:
            # The connection ends here (a flood h2_limits stopped parsing at, or a protocol error):
            # handled at once, ahead of what the backlog holds. Queued behind it, its GOAWAY went
            # out with the backlog's next step, the client closed, and the close dropped the
            # backlog with the flood in it: no reset_flood line (tests/load, a busy machine).
            self._drop_backlog()
            parsed = [e]
        self._backlog.extend(parsed)
        self._backlog_bytes += sum(len(e.data) for e in parsed if isinstance(e, h2.events.DataReceived))
        yield from self._run_backlog()

    def _drop_backlog(self) -> None:
        self._backlog.clear()
        self._backlog_bytes = 0

    def _run_backlog(self) -> layer.CommandGenerator[None]:
        """Handle the backlog's events in order until STREAMS_PER_STEP requests were opened, or one
        or more in STEP_SECONDS; the rest on a wakeup, a later step of the loop (a new read meanwhile only adds to the backlog's
        end). The client's flow-control windows are acknowledged as events are handled, so what
        the backlog can hold is bounded by them, as by the stream limit and the flood budgets."""
        opened = 0
        began = time.perf_counter()
        while self._backlog:
            h2_event = self._backlog.popleft()
            if isinstance(h2_event, h2.events.DataReceived):
                self._backlog_bytes -= len(h2_event.data)
            if (yield from self.handle_h2_event(h2_event)):
                self._drop_backlog()
                return
            if isinstance(h2_event, h2.events.RequestReceived):
                opened += 1
                if self._backlog and (opened >= self.STREAMS_PER_STEP
                                      or time.perf_counter() - began >= self.STEP_SECONDS):
                    if self._backlog_wakeup is None:
                        self._backlog_wakeup = commands.RequestWakeup(0)
                        yield self._backlog_wakeup
                    break
        data = self.h2_conn.data_to_send()
        if data:
            yield commands.SendData(self.conn, data)


# A body sent in one piece larger than this is sent in pieces of it (`paced_sends`).
SEND_PIECE = 256 * 1024


def paced_sends(commands_: layer.CommandGenerator, stream: HttpStream):
    """`commands_` with each large body it sends (a buffered response to the client, a buffered
    request upstream) sent SEND_PIECE at a time, the sandbox's turn between two pieces (a blocking
    EgressPaceHook: mitmproxy holds the stream's later events meanwhile). mitmproxy sends a
    buffered body as one event, and TLS encrypted an 18 MB response in one step of the loop, up to
    50 ms of every other sandbox's waiting (bench/noisy.py bound_lines). The bytes sent, and their
    order, are the same."""
    reply = None
    while True:
        try:
            command = commands_.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = None
        event = command.event if isinstance(command, SendHttp) else None
        if isinstance(event, (RequestData, ResponseData)) and len(event.data) > SEND_PIECE:
            data, connection, kind, stream_id = event.data, command.connection, type(event), event.stream_id
            command = event = None  # (the whole body is held only by `data` from here)
            for at in range(0, len(data), SEND_PIECE):
                if at:
                    yield EgressPaceHook(stream.flow)
                yield SendHttp(kind(stream_id, data[at:at + SEND_PIECE]), connection)
            data = None
            continue
        reply = yield command


# A body at least this large is let go once its flow is done (`_drop_bodies`).
DROP_BODY_AT = 64 * 1024


def _drop_bodies(flow) -> None:
    """The flow is done and its stream dropped: its large bodies go now, by reference counting.
    A closed flow sits in reference cycles (its layers, contexts, connections) that only a full
    collection frees, and until then its bodies stayed too: 18 MB bound responses piled up between
    two, and the full collections that freed them held the loop 25-45 ms each (issue 15's
    noisy-neighbour benchmark, bound_lines). A WebSocket or other upgrade keeps its flow."""
    if flow is None or flow.websocket is not None or (flow.response is not None and flow.response.status_code == 101):
        return
    for message in (flow.request, flow.response):
        data = getattr(message, "data", None)
        if data is not None and data.content is not None and len(data.content) >= DROP_BODY_AT:
            data.content = b""


class GatewayHttpStream(HttpStream):
    """mitmproxy's HttpStream, with
    - `body_size_limit` enforced on streamed bodies too (mitmproxy checks it only against a declared
      length or a buffered body, so a chunked body that streams would be unbounded). Over the limit,
      the stream is aborted both ways: a request that has no answer yet gets 413
      `request_too_large`, a response already under way is cut off;
    - the request body fed to its method override check (addons/method_body.py) before any of it
      goes on: a buffered body is checked whole before the upstream connection is opened; a streamed
      one chunk by chunk, holding back the last byte while the body ends inside an override field
      (only its end can settle that one), so that a refusal aborts the upstream stream before the
      origin has a complete request;
    - every buffered body charged to the buffer ledger (gateway/budget.py) before it grows: over
      the connection's or the sandbox's budget, a body that may stream switches to streaming (what
      mitmproxy does above `stream_large_bodies`), one that must stay buffered (a credential-bound
      response, a body held for its check) is refused, 503 `buffer_budget`;
    - a body that stops moving ends its stream after `idle_timeout` seconds without a byte: a
      request body 408 `request_body_timeout` (its upstream stream aborted), a response body 504
      `response_body_timeout` while nothing was sent, cut off after."""

    _streamed_request = 0
    _streamed_response = 0
    _held = b""  # the last byte of a streamed request body that ends inside an override field so far
    _checked_ahead = 0  # bytes at the start of the next streamed chunk its body check has already seen
    on_refusal: OnRefusal | None = None  # set by the HTTP layer that makes the stream
    body_limits: BodyLimits = BodyLimits()
    _account: Account | None = None
    _request_moved: float | None = None  # when the request body last moved (None: not under way)
    _response_moved: float | None = None

    # -- the buffer ledger -------------------------------------------------------------------------

    def _charge(self, n: int) -> bool:
        """Reserve `n` more buffered bytes for this stream; False if over budget (nothing charged)."""
        if self._account is None:
            make = self.body_limits.account
            account = make(self.context) if make is not None else None
            if account is None:
                return True
            self._account = account
            if self.flow is not None:
                self.flow.metadata[BUFFER_ACCOUNT] = account  # a decode buffer is charged to it too
        return self._account.reserve(n)

    def _release(self, done: bool = True) -> None:
        """Give back what this stream's buffers held; `done`: the stream is over (its account
        closed, so the ledger forgets it), else a buffer was handed on and more may come."""
        if done:
            self._drop_decoders()
        if done and self._windows:
            self._windows.close()
            self._windows = None
        if self._account is not None:
            if done:
                self._account.close()
                self._account = None
            else:
                self._account.release()

    def _drop_decoders(self) -> None:
        """The stream is over, however it ended (a client gone mid-body too): the decoders of its
        bodies go now, with the charge for their windows, not when the flow is collected."""
        flow = self.flow
        if flow is None:
            return
        stream = flow.response.stream if flow.response is not None else None
        if hasattr(stream, "drop_decoder"):
            stream.drop_decoder()
        check = flow.metadata.get(BODY_CHECK)
        if hasattr(check, "close"):
            check.close()

    def _over_budget(self) -> Decision:
        room = self._account.room() if self._account is not None else None
        return Decision.deny("buffer_budget", "buffering this body would pass the connection's or the sandbox's "
                             f"buffer budget ({room or 0} bytes left); nothing more was buffered")

    # -- events ------------------------------------------------------------------------------------

    _windows = None  # the account a request body's decoder windows are charged to (False: no budgets)
    _queued: dict[int, int] | None = None  # id -> bytes of body events queued while paused, charged
    _uncharged = 0  # bytes queued over the budget, within QUEUE_ALLOWANCE
    _overflowed = False  # a queued body piece was over budget: dropped, and the stream ends on resume

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        """While the stream waits (for an upstream connection, a hook), mitmproxy queues what
        arrives: body bytes queued are charged too. Past the budget a stream may queue
        QUEUE_ALLOWANCE more (what comes with its head, before it could switch to streaming); past
        that the piece is dropped and the stream ends as soon as it resumes, 503 `buffer_budget`."""
        if self._paused is not None and isinstance(event, (RequestData, ResponseData)):
            n = len(event.data)
            if self._overflowed:
                return
            if self._charge(n):
                if self._queued is None:
                    self._queued = {}
                self._queued[id(event)] = n
            elif self._uncharged + n <= QUEUE_ALLOWANCE:
                self._uncharged += n
            else:
                self._overflowed = True
                return
        yield from super().handle_event(event)

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self._queued and isinstance(event, (RequestData, ResponseData)):
            taken = self._queued.pop(id(event), None)
            if taken is not None and self._account is not None:
                self._account.release(taken)  # charged again below if it is buffered
        if self._overflowed:
            self._overflowed = False
            if self.client_state != self.state_errored and self.flow is not None:
                answered = self.server_state in (self.state_stream_response_body, self.state_done)
                yield from self._abort(self._over_budget(), upstream=self.client_state == self.state_stream_request_body
                                       or self.server_state != self.state_wait_for_response_headers,
                                       status_sent=not answered)
            return
        if isinstance(event, BodyIdleCheck):
            yield from self._idle_deadline()
            return
        now = time.monotonic()
        if isinstance(event, (RequestHeaders, ResponseHeaders)):
            if not event.end_stream:
                if isinstance(event, RequestHeaders):
                    self._request_moved = now
                else:
                    self._response_moved = now
        elif isinstance(event, RequestData):
            if self._request_moved is not None:
                self._request_moved = now
        elif isinstance(event, ResponseData):
            if self._response_moved is not None:
                self._response_moved = now
        elif isinstance(event, (RequestEndOfMessage, RequestProtocolError)):
            self._request_moved = None
        elif isinstance(event, (ResponseEndOfMessage, ResponseProtocolError)):
            self._response_moved = None
        yield from paced_sends(super()._handle_event(event), self)
        if self.client_state in (self.state_done, self.state_errored) and self.server_state in (
                self.state_done, self.state_errored):
            self._release()

    def passthrough(self, event: events.Event) -> layer.CommandGenerator[None]:
        """After an upgrade (WebSocket) the child layer owns the connection; a body check is this
        stream's, not the child's."""
        if isinstance(event, BodyIdleCheck):
            return
        yield from super().passthrough(event)

    def flow_done(self) -> layer.CommandGenerator[None]:
        self._request_moved = self._response_moved = None
        self._release()
        yield from super().flow_done()
        _drop_bodies(self.flow)

    # -- a body that stops moving ------------------------------------------------------------------

    def _idle_since(self) -> float | None:
        """When the oldest body of this stream still under way last moved (None: none is)."""
        moved = []
        if self._request_moved is not None and self.client_state in (
                self.state_consume_request_body, self.state_stream_request_body):
            moved.append(self._request_moved)
        if self._response_moved is not None and self.server_state in (
                self.state_consume_response_body, self.state_stream_response_body):
            moved.append(self._response_moved)
        return min(moved) if moved else None

    def _idle_deadline(self) -> layer.CommandGenerator[None]:
        timeout = self.body_limits.idle_timeout
        if not timeout or self.flow is None:
            return
        now = time.monotonic()
        request_on = self._request_moved is not None and self.client_state in (
            self.state_consume_request_body, self.state_stream_request_body)
        response_on = self._response_moved is not None and self.server_state in (
            self.state_consume_response_body, self.state_stream_response_body)
        answered = self.server_state in (self.state_stream_response_body, self.state_done)
        if request_on and now - self._request_moved >= timeout:
            decision = Decision.deny("request_body_timeout",
                                     f"the request body moved nothing for {timeout:g}s (the client sent nothing, or the "
                                     f"upstream read nothing while the gateway held the client back); the request was "
                                     f"abandoned")
            yield from self._abort(decision, upstream=self.client_state == self.state_stream_request_body
                                   or self.server_state != self.state_wait_for_response_headers,
                                   status_sent=not answered)
        elif response_on and now - self._response_moved >= timeout:
            decision = Decision.deny("response_body_timeout",
                                     f"the upstream response body sent nothing for {timeout:g}s")
            yield from self._abort(decision, upstream=True,
                                   status_sent=self.server_state == self.state_consume_response_body)

    def _abort(self, decision: Decision, upstream: bool, status_sent: bool = True,
               audited: bool = False) -> layer.CommandGenerator[None]:
        """End the stream both ways with `decision`: the client gets the refusal if nothing of the
        answer went out yet (else its response is cut off), an upstream stream under way is aborted
        unfinished. Audited here unless `audited`."""
        self._held = b""
        self._request_moved = self._response_moved = None
        allowed_by = self.flow.metadata.get("egress_decision")
        if decision.rule is None and allowed_by is not None and getattr(allowed_by, "rule", None):
            decision = replace(decision, rule=allowed_by.rule)  # the audit line names the rule it ran under
        if not audited and self.on_refusal is not None:
            decision = _report(self.on_refusal, self.context, decision, self.flow.request, status_sent=status_sent)
        self.flow.error = mitm_flow.Error(f"egress gateway: {decision.message}")
        setattr(self.flow.request, REFUSAL_ATTR, decision)
        yield HttpErrorHook(self.flow)
        refusal = ResponseProtocolError(self.stream_id, decision.message, ErrorCode.GENERIC_CLIENT_ERROR)
        setattr(refusal, REFUSAL_ATTR, decision)
        yield SendHttp(refusal, self.context.client)
        if upstream:
            yield SendHttp(RequestProtocolError(self.stream_id, decision.message, ErrorCode.GENERIC_CLIENT_ERROR),
                           self.context.server)
        self.client_state = self.server_state = self.state_errored
        self.flow.live = False
        self._release()

    # -- request bodies ----------------------------------------------------------------------------

    def state_wait_for_request_headers(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestHeaders):
            setattr(event.request, END_STREAM_ATTR, event.end_stream)  # what a body check needs to know
        return (yield from super().state_wait_for_request_headers(event))

    def state_consume_request_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestData) and self.flow is not None and self.flow.response is not None:
            # Refused at its head: the body is read to keep the connection's framing and thrown
            # away, not buffered (mitmproxy would switch a large one to streaming, which cannot
            # coexist with the gateway's answer, and crash the stream).
            return
        if isinstance(event, RequestData) and not self._charge(len(event.data)):
            yield from self._request_over_budget(event)
            return
        check = self.flow.metadata.get(BODY_CHECK) if self.flow is not None else None
        if check is not None and isinstance(event, (RequestData, RequestTrailers, RequestEndOfMessage)):
            if isinstance(event, RequestData):
                refusal = yield from self._checked(check, event.data)
            elif isinstance(event, RequestTrailers):
                refusal = check.trailers()  # trailers alone make an HTTP/1 body (chunked)
            else:
                refusal = yield from self._checked(check, None)
            if refusal is not None:
                yield from self._refuse_body(refusal, upstream=False)
                return
        yield from super().state_consume_request_body(event)

    def _checked(self, check, data: bytes | None) -> layer.CommandGenerator[Decision | None]:
        """One step of the body's check, `data` or the body's end (None). A body decoded to be
        scanned has its decoder calls run off the event loop (addons/decode_pool.py: one call may
        cost tens of ms, a brotli window 50): the stream starts a blocking hook, and mitmproxy holds
        its later events (charged, see handle_event) until it completes."""
        if not getattr(check, "decodes", False):
            return check.feed(data) if data is not None else check.finish()
        if self._windows is None and data:
            # Its decoders keep a window the sandbox chose (up to 16 MiB of brotli) for as long as
            # the body lasts: charged from its first bytes, on an account of its own (the body's
            # buffer is released as it is handed on; the windows only when the stream is over).
            make = self.body_limits.account
            self._windows = (make(self.context) if make is not None else None) or False
            windows = self._windows
            if windows and not windows.reserve(check.windows(data, lambda more: windows.reserve(more))):
                return check.refuse(Decision.deny(
                    "buffer_budget", "the decoders of this compressed request body would keep more than the "
                                     "connection's or the sandbox's buffer budget allows; its end was not sent",
                    check.rule))
        step = DecodeSteps(check.scan(data))
        yield EgressDecodeStepsHook(step)
        return check.settle(step.result or _NOT_SCANNED, last=data is None)

    def _request_over_budget(self, event: RequestData) -> layer.CommandGenerator[None]:
        """A buffered request body over the budget: streamed on from here (its check goes on chunk
        by chunk), or, when it must stay buffered, refused before anything went upstream."""
        decision = self.flow.metadata.get("egress_decision")
        if HOLD_BODY in self.flow.metadata or decision is None or not decision.allowed:
            yield from self._abort(self._over_budget(), upstream=False)
            return
        buffered = bytes(self.request_body_buf)
        self.request_body_buf.clear()
        self._release(done=False)
        self.flow.request.stream = True
        yield from self.start_request_stream()
        if self.client_state != self.state_stream_request_body:
            return  # the upstream connection failed: already answered
        self._checked_ahead = len(buffered)  # its check saw the buffered part already
        yield from self.state_stream_request_body(RequestData(event.stream_id, buffered + event.data))

    def state_stream_request_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestData):
            self._streamed_request += len(event.data)
            if (yield from self._over_limit(self._streamed_request, request=True)):
                return
        check = self.flow.metadata.get(BODY_CHECK) if self.flow is not None else None
        if check is not None and isinstance(event, RequestData):
            fresh, self._checked_ahead = event.data[self._checked_ahead:], 0
            if fresh and (refusal := (yield from self._checked(check, fresh))) is not None:
                yield from self._refuse_body(refusal, upstream=True)
                return
            data, self._held = self._held + event.data, b""
            if check.pending:  # the end of the body could still reveal an override: keep its last byte
                self._held, data = data[-1:], data[:-1]
            if not data:
                return
            event = RequestData(event.stream_id, data)
        elif check is not None and isinstance(event, RequestEndOfMessage):
            if (refusal := (yield from self._checked(check, None))) is not None:
                yield from self._refuse_body(refusal, upstream=True)
                return
            if self._held:
                held, self._held = self._held, b""
                yield from super().state_stream_request_body(RequestData(event.stream_id, held))
        yield from super().state_stream_request_body(event)

    def handle_protocol_error(self, event) -> layer.CommandGenerator[None]:
        """mitmproxy's, and then the stream lets go of its buffered bodies: a dropped stream sits in
        reference cycles (its contexts' layer lists, its bound state methods) until a full garbage
        collection, and bytes do not trigger one (91 HTTP/2 streams refused over the buffer budget
        kept 26 MiB that way). A response cut off by a budget (response_too_large) once its head
        went out, so that no refusal can be sent, is audited here, with the rule it ran under."""
        started = self.server_state == self.state_stream_response_body
        yield from super().handle_protocol_error(event)
        self.request_body_buf.clear()
        self.response_body_buf.clear()
        if (started and isinstance(event, ResponseProtocolError) and event.code == ErrorCode.RESPONSE_TOO_LARGE
                and self.on_refusal is not None and self.flow is not None):
            decision = protocol_error_decision(event)
            allowed_by = self.flow.metadata.get("egress_decision")
            if getattr(allowed_by, "rule", None):
                decision = replace(decision, rule=allowed_by.rule)
            _report(self.on_refusal, self.context, decision, self.flow.request, status_sent=False)

    def client_reset(self) -> str | None:
        """Why the client ended this stream while it waited (a reset, a disconnect), if it did: the
        event is queued behind the command the stream waits for (a hook, an upstream connection)."""
        for queued in self._paused_event_queue:
            if isinstance(queued, RequestProtocolError):
                return queued.message
        return None

    def make_server_connection(self) -> layer.CommandGenerator[bool]:
        """mitmproxy's, except that a stream the client reset while its upstream connection was
        being made stops here: mitmproxy would send the whole request upstream and only then
        the reset (a rapid-reset flood forwarded ~1,000 cancelled GETs that way)."""
        connection, err = yield GetHttpConnection(
            (self.flow.request.host, self.flow.request.port),
            self.flow.request.scheme == "https",
            self.flow.server_conn.via,
            self.flow.server_conn.transport_protocol,
        )
        reset = self.client_reset()
        if reset is not None:
            self.flow.error = mitm_flow.Error(reset)
            yield HttpErrorHook(self.flow)
            self.client_state = self.server_state = self.state_errored
            self.flow.live = False
            return False
        if err:
            yield from self.handle_protocol_error(ResponseProtocolError(self.stream_id, err, ErrorCode.CONNECT_FAILED))
            return False
        self.context.server = self.flow.server_conn = connection
        return True

    def _refuse_body(self, decision: Decision, upstream: bool) -> layer.CommandGenerator[None]:
        """The body named a method the rule does not allow (already audited by the check): the
        client gets the refusal, and an upstream stream already under way is aborted unfinished."""
        yield from self._abort(decision, upstream, audited=True)

    # -- response bodies ---------------------------------------------------------------------------

    def state_consume_response_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, ResponseData) and not self._charge(len(event.data)):
            if BOUND in self.flow.metadata:
                # Buffered to be decoded and redacted whole: it cannot stream as it is.
                yield from self._abort(self._over_budget(), upstream=True)
                return
            buffered = bytes(self.response_body_buf)
            self.response_body_buf.clear()
            self._release(done=False)
            self.flow.response.stream = True
            yield from self.start_response_stream()
            yield from self.state_stream_response_body(ResponseData(event.stream_id, buffered + event.data))
            return
        yield from super().state_consume_response_body(event)

    def state_stream_response_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, ResponseData):
            self._streamed_response += len(event.data)
            if (yield from self._over_limit(self._streamed_response, request=False)):
                return
        stream = self.flow.response.stream if self.flow is not None and self.flow.response is not None else None
        if getattr(stream, "decodes", False) and isinstance(event, (ResponseData, ResponseEndOfMessage)):
            # A bound response decoded on the fly (addons/credentials.py): its decoder calls run
            # off the loop, like a request body's check (see _checked), and the stream callable
            # then hands on what they made.
            self._charge(0)  # the stream's buffer account, which the decoder's window is charged to
            step = DecodeSteps(stream.steps(event.data if isinstance(event, ResponseData) else b""))
            yield EgressDecodeStepsHook(step)
            stream.ready(step.result)
        yield from super().state_stream_response_body(event)

    def _over_limit(self, size: int, request: bool) -> layer.CommandGenerator[bool]:
        limit = human.parse_size(self.context.options.body_size_limit)
        if limit is None or size <= limit:
            return False
        what = "Request" if request else "Response"
        message = f"{what} body exceeds mitmproxy's body_size_limit."
        code = ErrorCode.REQUEST_TOO_LARGE if request else ErrorCode.RESPONSE_TOO_LARGE
        self.flow.error = mitm_flow.Error(message)
        if not request and self.on_refusal is not None:  # a request's refusal is audited where it is sent
            _report(self.on_refusal, self.context, Decision.deny(
                "response_too_large", f"the streamed response exceeded body_size_limit ({limit} bytes); cut off"),
                self.flow.request)
        yield HttpErrorHook(self.flow)
        yield SendHttp(ResponseProtocolError(self.stream_id, message, code), self.context.client)
        yield SendHttp(RequestProtocolError(self.stream_id, message, code), self.context.server)
        self.client_state = self.server_state = self.state_errored
        self.flow.live = False
        self._release()
        return True


class GatewayHttpLayer(HttpLayer):
    """HttpLayer whose HTTP/1 client side is a `GatewayHttp1Server`."""

    def __init__(self, context, mode, on_refusal: OnRefusal, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 head_timeout: float = DEFAULT_HEAD_TIMEOUT, body_limits: BodyLimits | None = None):
        super().__init__(context, mode)
        self.on_refusal = on_refusal
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        self.body_limits = body_limits or BodyLimits()

    _idle_wakeup: commands.RequestWakeup | None = None

    def _handle_event(self, event: events.Event):
        if isinstance(event, events.Wakeup) and event.command is self._idle_wakeup:
            self._idle_wakeup = None
            yield from self._check_idle_bodies()
            return
        yield from self._handle(event)
        if self._idle_wakeup is None and self.body_limits.idle_timeout > 0 and self._bodies_under_way():
            self._idle_wakeup = commands.RequestWakeup(self.body_limits.idle_timeout)
            yield self._idle_wakeup

    def _bodies_under_way(self) -> list[float]:
        """When each body under way on this connection last moved."""
        found = []
        for stream in self.streams.values():
            if isinstance(stream, GatewayHttpStream) and (since := stream._idle_since()) is not None:
                found.append(since)
        return found

    def _sandbox_key(self) -> str | None:
        try:
            return self.body_limits.sandbox(self.context) if self.body_limits.sandbox is not None else None
        except Exception:  # fail closed: summed under one key for every client without one
            return "unknown"

    def _check_idle_bodies(self) -> layer.CommandGenerator[None]:
        """Each stream whose body went without a byte for the idle timeout ends (it decides how);
        then the timer is set for the next one due, while any stream is left."""
        timeout = self.body_limits.idle_timeout
        now = time.monotonic()
        for stream in list(self.streams.values()):
            since = stream._idle_since() if isinstance(stream, GatewayHttpStream) else None
            if since is not None and now - since >= timeout:
                yield from self.event_to_child(stream, BodyIdleCheck())
        due = self._bodies_under_way()
        if due and timeout > 0:
            self._idle_wakeup = commands.RequestWakeup(max(timeout - (now - min(due)), 0.05))
            yield self._idle_wakeup

    def _handle(self, event: events.Event):
        if isinstance(event, events.Start):
            if is_h3_alpn(self.context.client.alpn):
                server = Http3Server(self.context.fork())
            elif self.context.client.alpn == b"h2":
                make = self.body_limits.account
                server = GatewayHttp2Server(self.context.fork(), self.on_refusal, self.streams,
                                            self._sandbox_key(), make(self.context) if make is not None else None)
            else:
                server = GatewayHttp1Server(self.context.fork(), self.on_refusal, self.max_head_bytes,
                                            self.head_timeout, self._sandbox_key(), self.streams)
            self.connections.setdefault(self.context.client, server)
            yield from self.event_to_child(self.connections[self.context.client], event)
            return
        yield from super()._handle_event(event)

    def get_connection(self, event: GetHttpConnection, *, reuse: bool = True) -> layer.CommandGenerator[None]:
        """No upstream connection for a stream the client already reset: mitmproxy opens one per
        waiting stream when an HTTP/2 client's requests go to an HTTP/1 upstream."""
        stream = self.command_sources.get(event)
        reset = stream.client_reset() if isinstance(stream, GatewayHttpStream) else None
        if reset is not None:
            self.command_sources.pop(event)
            yield from self.event_to_child(stream, GetHttpConnectionCompleted(event, (None, reset)))
            return
        yield from super().get_connection(event, reuse=reuse)

    def make_stream(self, stream_id: int) -> layer.CommandGenerator[None]:
        stream = self.streams[stream_id] = self.stream_class(self.context.fork(), stream_id)
        stream.on_refusal = self.on_refusal
        stream.body_limits = self.body_limits
        yield from self.event_to_child(self.streams[stream_id], events.Start())

    stream_class: type[HttpStream] = GatewayHttpStream


def target_form(request) -> str | None:
    return getattr(request, TARGET_FORM_ATTR, None)


def raw_authority(request) -> str | None:
    return getattr(request, RAW_AUTHORITY_ATTR, None)


def end_stream(request) -> bool | None:
    """Whether the request's head ended it; None when no gateway HTTP layer saw it."""
    return getattr(request, END_STREAM_ATTR, None)


class GatewayTcpLayer(TCPLayer):
    """mitmproxy's TCP layer for a `protocol: tcp` rule's connections, bounded: it kept every read
    in `flow.messages` for the life of the connection (a long stream grew the worker without end),
    and read on while each read's `tcp_message` hook ran (addons/read_ahead.py)."""

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().handle_event(event)
        read_ahead.settle(self)

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().relay_messages(event)
        if self.flow is not None and len(self.flow.messages) > 1:
            del self.flow.messages[:-1]  # every hook has seen them; only the last is kept


class _TargetFormStream(GatewayHttpStream):
    def state_wait_for_request_headers(self, event: RequestHeaders) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestHeaders):
            request = event.request
            authority = request.data.authority.decode("utf-8", "surrogateescape")
            if request.method == "CONNECT":
                form = "authority"
            elif request.data.path == b"*":
                form = "asterisk"
            elif authority and not (request.is_http2 or request.is_http3):
                form = "absolute"
            elif request.is_http2 or request.is_http3:
                form = "absolute" if authority else "origin"
            else:
                form = "origin"
            setattr(request, TARGET_FORM_ATTR, form)
            setattr(request, RAW_AUTHORITY_ATTR, authority)
        return (yield from super().state_wait_for_request_headers(event))


class TargetFormHttpLayer(GatewayHttpLayer):
    stream_class = _TargetFormStream
