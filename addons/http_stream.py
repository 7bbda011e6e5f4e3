"""The gateway's HTTP stream, `GatewayHttpStream` (one per request, made by the HTTP layer of
addons/layers.py): bodies bounded by size, by the buffer ledger and by an idle timeout, the request
body fed to its method override check, large bodies sent in paced pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from mitmproxy import flow as mitm_flow
from mitmproxy import http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import DropStream, GetHttpConnection, HttpStream, RequestHeaders
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
    ResponseTrailers,
)
from mitmproxy.proxy.layers.http._hooks import HttpErrorHook
from mitmproxy.proxy.layers.http import SendHttp
from mitmproxy.utils import human

from gateway.budget import Account, head_cost
from gateway.decision import Decision
from gateway.options import DEFAULT_BODY_IDLE_TIMEOUT

from .body_redaction import BUFFER_ACCOUNT
from .credentials import BOUND
from .decode_pool import DecodeSteps, EgressDecodeStepsHook
from .fair_share import EgressPaceHook
from .method_body import BODY_CHECK, CheckInFront
from .refusals import REFUSAL_ATTR, OnRefusal, _report, protocol_error_decision

END_STREAM_ATTR = "_egress_end_stream"  # whether the request's head ended it (no body follows)
HOLD_BODY = "egress_hold_body"  # flow.metadata key: the body is buffered, never streamed (set by addons/body_checks.py)
# Room for the response head, reserved with the request head (while refusing the request is still
# possible): the request goes upstream, where it may act, only if its ordinary answer (~15 fields)
# can then be held. A heavier head must find room of its own when it comes. Held past the budget
# instead, many streams' heads took a sandbox 6x over it (review 22: 100,000 streams x 8 KiB).
RESPONSE_HEAD_ROOM = 8 * 1024
QUEUE_ALLOWANCE = 256 * 1024  # body bytes a paused stream may queue past its budget (see GatewayHttpStream.handle_event)
_TRAILERS_OVER_BUDGET = Decision.deny("buffer_budget", "holding this request's trailers for as long as its stream "
                                                      "lasts would pass the connection's or the sandbox's buffer "
                                                      "budget; it was refused")
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


def _upgraded(flow) -> bool:
    """A flow that lives on after its stream (a WebSocket, another 101 upgrade)."""
    return flow is not None and flow.error is None and (flow.websocket is not None or (
        flow.response is not None and flow.response.status_code == 101))


def _drop_bodies(flow) -> None:
    """The flow is done and its stream dropped: its large bodies go now, by reference counting.
    A closed flow sits in reference cycles (its layers, contexts, connections) that only a full
    collection frees, and until then its bodies stayed too: 18 MB bound responses piled up between
    two, and the full collections that freed them held the loop 25-45 ms each (issue 15's
    noisy-neighbour benchmark, bound_lines). A WebSocket or other upgrade keeps its flow."""
    if flow is None or _upgraded(flow):
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
    - the request head charged to the buffer ledger for as long as the stream lasts (a CONNECT's:
      as long as its tunnel): the sandbox decides how long it is held, by a body it never sends
      (review 14: 1,798 HTTP/2 streams, each a 55 KB head, took +291 MiB past an 8 MiB sandbox
      budget), an upstream it knows is slow, a tunnel it keeps open (review 16: 600 tunnels of
      58 KB CONNECT heads, +84 MiB; 1,600 complete GETs to a 40 s upstream, +277 MiB). Over the
      budget it is refused before any hook decides it, 503 `buffer_budget`;
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
    _head_account: Account | None = None  # the request head, for as long as the stream lasts
    _response_room: int = 0  # of it: bytes reserved for the response head (RESPONSE_HEAD_ROOM)
    _request_moved: float | None = None  # when the request body last moved (None: not under way)
    _response_moved: float | None = None

    # -- the buffer ledger -------------------------------------------------------------------------

    def _new_account(self) -> Account | None:
        """A new share of the buffer ledger for one of this stream's buffers (None: no budgets)."""
        make = self.body_limits.account
        return make(self.context) if make is not None else None

    def _charge(self, n: int) -> bool:
        """Reserve `n` more buffered bytes for this stream; False if over budget (nothing charged)."""
        if self._account is None:
            account = self._new_account()
            if account is None:
                return True
            self._account = account
            if self.flow is not None:
                self.flow.metadata[BUFFER_ACCOUNT] = account  # a decode buffer is charged to it too
        return self._account.reserve(n)

    def _charge_head(self, request: http.Request) -> bool:
        """Charge the request head, held until the stream is over, and the room its answer's head
        will take (not for a CONNECT: the gateway answers it); False if over budget (nothing charged)."""
        size = len(request.data.method) + len(request.data.authority) + len(request.data.path)
        room = 0 if request.data.method.upper() == b"CONNECT" else RESPONSE_HEAD_ROOM
        if not self._charge_fields(request.data.headers.fields, size, room):
            return False
        self._response_room = room if self._head_account is not None else 0
        return True

    def _charge_fields(self, fields, size: int = 0, extra: int = 0) -> bool:
        """Charge a head's or a trailer section's fields (and `size` more bytes of its own, and
        `extra` bytes of room) to the stream's head account, for as long as the stream lasts;
        False if over budget (nothing charged)."""
        if self._head_account is None:
            account = self._new_account()
            if account is None:
                return True
            self._head_account = account
        size += sum(len(name) + len(value) for name, value in fields)
        return self._head_account.reserve(head_cost(size, len(fields)) + extra)

    def _charge_response_head(self, response: http.Response) -> bool:
        """The response head, held until the stream is over: in the room its request reserved,
        else (a heavier head, or no room) it must fit the budget now; False if it does not."""
        size = len(response.data.http_version) + len(response.data.reason)
        size += sum(len(name) + len(value) for name, value in response.data.headers.fields)
        cost = head_cost(size, len(response.data.headers.fields))
        room, self._response_room = self._response_room, 0
        if self._head_account is None:
            return self._charge_fields((), 0, cost)
        self._head_account.release(room, freed=False)  # (room handed to the head: nothing was freed)
        if cost <= room:
            self._head_account.hold(cost)  # (within what was just given back: never past the budget)
            return True
        return self._head_account.reserve(cost)

    def _charge_trailers(self, event: RequestTrailers) -> bool:
        """The request's trailers, kept on the flow like its head; charged once."""
        if self._trailers_charged:
            return True
        self._trailers_charged = True
        return self._charge_fields(event.trailers.fields)

    def _refuse_response_part(self, what: str, status_sent: bool) -> layer.CommandGenerator[None]:
        """An upstream's response head or trailers that cannot be held while the stream lasts (the
        sandbox may pick, or be, the upstream that sends them): not forwarded, the upstream stream
        aborted; the client gets 503 if nothing of the answer went out yet, else is cut off."""
        decision = Decision.deny("buffer_budget", f"holding the upstream's response {what} for as long as its stream "
                                                  "lasts would pass the connection's or the sandbox's buffer budget; "
                                                  "it was not forwarded")
        yield from self._abort(decision, upstream=True, status_sent=status_sent)

    def _release_head(self) -> None:
        if self._head_account is not None:
            self._head_account.close()
            self._head_account = None
        self._response_room = 0

    def _release(self, done: bool = True) -> None:
        """Give back what this stream's buffers held; `done`: the stream is over (its account
        closed, so the ledger forgets it), else a buffer was handed on and more may come. An
        upgraded flow lives on with its head: that charge stays until the connection goes."""
        if done and not _upgraded(self.flow):
            self._release_head()
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

    def _body_checked(self) -> None:
        """The request body passed its check to its end: the check goes now (its scanner, closures
        and findings), not with the flow, which a response streamed for minutes keeps alive."""
        check = self.flow.metadata.pop(BODY_CHECK, None)
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
    _trailers_charged = False  # the request's trailers were charged as they were queued

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        """While the stream waits (for an upstream connection, a hook), mitmproxy queues what
        arrives: body bytes queued are charged too. Past the budget a stream may queue
        QUEUE_ALLOWANCE more (what comes with its head, before it could switch to streaming); past
        that the piece is dropped and the stream ends as soon as it resumes, 503 `buffer_budget`."""
        if self._paused is not None and isinstance(event, RequestTrailers):
            if self._overflowed or not self._charge_fields(event.trailers.fields):  # (charged once, here)
                self._overflowed = True  # not queued: the stream ends at its end-of-message
                return
            self._trailers_charged = True
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
        # An upgraded flow (a WebSocket) lives on with its head for as long as the connection: its
        # head stays charged until then (review 17: 300 WebSockets of 60 KB upgrade heads, +113 MiB
        # past an 8 MiB budget); the connection's accounts all go when it closes.
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
        # The stream is done: the HTTP layer lets it go, as after any finished flow. Without this an
        # HTTP/2 connection kept every stream refused so for its whole life, uncharged (review 35b:
        # 6,000 refused heads with `expect`, +135 MiB; every later event scanned them all).
        yield DropStream(self.stream_id)

    # -- request bodies ----------------------------------------------------------------------------

    def state_wait_for_request_headers(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestHeaders):
            setattr(event.request, END_STREAM_ATTR, event.end_stream)  # what a body check needs to know
            if not self._charge_head(event.request):
                self._release_head()
                return (yield from self._refuse_head_over_budget(event))
        return (yield from self._refused_without_continue(super().state_wait_for_request_headers(event)))

    def _refused_without_continue(self, commands_: layer.CommandGenerator) -> layer.CommandGenerator[None]:
        """`commands_` (mitmproxy's handling of a request head), except that a request refused at
        its head is not sent the `100 Continue` its `Expect` asked for: mitmproxy sends it after the
        requestheaders hook whatever the hook decided, and the client then uploaded its whole body
        (an SDK's object, a git push) to be read and thrown away before its refusal. RFC 9110
        10.1.1: a server that will not take the content answers with the final status instead.
        The refusal goes out at once. Over HTTP/1 the connection then ends (whether the client
        still sends the body is unknown, so is the framing of what follows; addons/http1_server.py
        lingers). Over HTTP/2 the stream is answered and not reset: a reset after the answer
        (RFC 9113 8.1 allows NO_ERROR) made curl 7.88 drop the answer and fail the transfer."""
        reply, skipped, result = None, False, None
        while True:
            try:
                command = commands_.send(reply)
            except StopIteration as stop:
                result = stop.value
                break
            reply = None
            event = command.event if isinstance(command, SendHttp) else None
            if (isinstance(event, ResponseHeaders) and event.response.status_code == 100 and self._refused_at_head()):
                skipped = True  # the 100 Continue of a refused request
                continue
            reply = yield command
        if skipped and self.client_state == self.state_consume_request_body:
            yield from self._abort(getattr(self.flow.request, REFUSAL_ATTR), upstream=False, audited=True)
        return result

    def _refused_at_head(self) -> bool:
        return self.flow is not None and getattr(self.flow.request, REFUSAL_ATTR, None) is not None

    def _refuse_head_over_budget(self, event: RequestHeaders) -> layer.CommandGenerator[None]:
        """The head cannot be held: refused before any hook decides it (so no upstream connection,
        no rule lookup), its body never read."""
        self.flow = http.HTTPFlow(self.context.client, self.context.server)
        self.flow.request = event.request
        self.flow.live = True
        decision = Decision.deny("buffer_budget", "holding this request's head for as long as its stream lasts would "
                                                  "pass the connection's or the sandbox's buffer budget; it was refused")
        yield from self._abort(decision, upstream=False)

    def state_consume_request_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestData) and self.flow is not None and self.flow.response is not None:
            # Refused at its head: the body is read to keep the connection's framing and thrown
            # away, not buffered (mitmproxy would switch a large one to streaming, which cannot
            # coexist with the gateway's answer, and crash the stream).
            return
        if isinstance(event, RequestData) and not self._charge(len(event.data)):
            yield from self._request_over_budget(event)
            return
        if isinstance(event, RequestTrailers) and not self._charge_trailers(event):
            # Kept on the flow for as long as the stream lasts, like the head (review 17: 1,600
            # streams of 55 KB trailers to a slow upstream, +136 MiB past an 8 MiB budget).
            yield from self._abort(_TRAILERS_OVER_BUDGET, upstream=False)
            return
        check = self.flow.metadata.get(BODY_CHECK) if self.flow is not None else None
        if check is not None and isinstance(event, (RequestData, RequestTrailers, RequestEndOfMessage)):
            if isinstance(event, RequestData):
                refusal = yield from self._checked(check, event.data)
            elif isinstance(event, RequestTrailers):
                refusal = check.trailers()  # trailers alone make an HTTP/1 body (chunked)
            else:
                refusal = yield from self._checked(check, None)
                if refusal is None:
                    self._body_checked()
            if refusal is not None:
                yield from self._refuse_body(refusal, upstream=False)
                return
        yield from super().state_consume_request_body(event)

    def _checked(self, check, data: bytes | None) -> layer.CommandGenerator[Decision | None]:
        """One step of the body's check, `data` or the body's end (None). A body decoded to be
        scanned has its decoder calls run off the event loop (addons/decode_pool.py: one call may
        cost tens of ms, a brotli window 50): the stream starts a blocking hook, and mitmproxy holds
        its later events (charged, see handle_event) until it completes. The checks in front of the
        scan (an upload budget, an empty body's refusal) decide the piece first, on the loop."""
        while isinstance(check, CheckInFront):
            if (refusal := check.front(data)) is not None:
                return refusal
            if check.stopped:
                return None
            check = check.then
        if check is None:
            return None
        if not getattr(check, "decodes", False):
            return check.feed(data) if data is not None else check.finish()
        if self._windows is None and data:
            # Its decoders keep a window the sandbox chose (up to 16 MiB of brotli) for as long as
            # the body lasts: charged from its first bytes, on an account of its own (the body's
            # buffer is released as it is handed on; the windows only when the stream is over).
            self._windows = self._new_account() or False
            windows = self._windows
            if windows and not windows.reserve(check.windows(data, lambda more: windows.reserve(more))):
                return check.refuse(Decision.deny(
                    "buffer_budget", "the decoders of this compressed request body would keep more than the "
                                     "connection's or the sandbox's buffer budget allows; its end was not sent",
                    check.rule))
        step = DecodeSteps(check.scan(data))
        yield EgressDecodeStepsHook(step)
        return check.settle(step.result or _NOT_SCANNED, last=data is None)

    def _stream_from_here(self, buf: bytearray, message) -> bytes:
        """A body over the buffer budget goes on as a stream: what it buffered so far (no longer
        charged), for the stream's first piece."""
        buffered = bytes(buf)
        buf.clear()
        self._release(done=False)
        message.stream = True
        return buffered

    def _request_over_budget(self, event: RequestData) -> layer.CommandGenerator[None]:
        """A buffered request body over the budget: streamed on from here (its check goes on chunk
        by chunk), or, when it must stay buffered, refused before anything went upstream."""
        decision = self.flow.metadata.get("egress_decision")
        if HOLD_BODY in self.flow.metadata or decision is None or not decision.allowed:
            yield from self._abort(self._over_budget(), upstream=False)
            return
        buffered = self._stream_from_here(self.request_body_buf, self.flow.request)
        yield from self.start_request_stream()
        if self.client_state != self.state_stream_request_body:
            return  # the upstream connection failed: already answered
        self._checked_ahead = len(buffered)  # its check saw the buffered part already
        yield from self.state_stream_request_body(RequestData(event.stream_id, buffered + event.data))

    def state_stream_request_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestTrailers) and not self._charge_trailers(event):
            yield from self._abort(_TRAILERS_OVER_BUDGET, upstream=True)
            return
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
            self._body_checked()
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
        # The stream is over (the layer drops it, its states left as they were): its charges go
        # now, the head's too (review 17: every stream a client reset kept its head charged until
        # the connection closed; a browser-like client cancelling 18 a second was refused after
        # 4,892 requests under the default budgets).
        self._release()
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

    # -- responses ---------------------------------------------------------------------------------

    def state_wait_for_response_headers(self, event) -> layer.CommandGenerator[None]:
        """The response head stays on the flow until the stream is over: charged like the request's."""
        if isinstance(event, ResponseHeaders):
            if not self._charge_response_head(event.response):
                return (yield from self._refuse_response_part("head", status_sent=True))
        return (yield from super().state_wait_for_response_headers(event))

    def state_consume_response_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, ResponseTrailers) and not self._charge_fields(event.trailers.fields):
            return (yield from self._refuse_response_part("trailers", status_sent=True))
        if isinstance(event, ResponseData) and not self._charge(len(event.data)):
            if BOUND in self.flow.metadata:
                # Buffered to be decoded and redacted whole: it cannot stream as it is.
                yield from self._abort(self._over_budget(), upstream=True)
                return
            buffered = self._stream_from_here(self.response_body_buf, self.flow.response)
            yield from self.start_response_stream()
            yield from self.state_stream_response_body(ResponseData(event.stream_id, buffered + event.data))
            return
        yield from super().state_consume_response_body(event)

    def state_stream_response_body(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, ResponseTrailers) and not self._charge_fields(event.trailers.fields):
            return (yield from self._refuse_response_part("trailers", status_sent=False))
        if isinstance(event, ResponseData):
            self._streamed_response += len(event.data)
            if (yield from self._over_limit(self._streamed_response, request=False)):
                return
        stream = self.flow.response.stream if self.flow is not None and self.flow.response is not None else None
        if getattr(stream, "decodes", False) and isinstance(event, (ResponseData, ResponseEndOfMessage)):
            # A bound response decoded on the fly (addons/body_redaction.py): its decoder calls run
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
