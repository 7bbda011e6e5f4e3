"""The gateway's client-facing HTTP/1 server, `GatewayHttp1Server` (the HTTP layer of addons/layers.py
puts it under each HTTP/1 client connection): mitmproxy's Http1Server, except that request heads
are bounded (size, fields, time, empty lines before them), bytes sent ahead of a response
(pipelining) are bounded, and what mitmproxy's parser rejects or answers itself is answered in the
gateway's format and audited. Its body framing is addons/http1.py `ServerFraming`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

from mitmproxy.net.http import http1
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import RequestHeaders
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from h11._receivebuffer import ReceiveBuffer
from mitmproxy.proxy.layers.http._http1 import Http1Server, make_body_reader

from gateway.budget import Account
from gateway.decision import Decision
from gateway.hostnames import HostError, parse_authority
from gateway.options import DEFAULT_HEAD_TIMEOUT, DEFAULT_MAX_HEAD_BYTES

from . import frame_limits
from .http1 import ChunkMerger, MalformedBody, ServerFraming, SmallChunkFlood, TooManyFields, max_header_fields
from .respond import PageFor, accept_of, default_page, raw_http_refusal
from .refusal_layers import RefusalLayer, in_tunnel
from .refusals import REFUSAL_ATTR, _ERROR_REASONS, OnRefusal, _report, _too_many_fields, protocol_error_decision

PIPELINE_HEADS = 2  # bytes sent ahead of a response (HTTP/1 pipelining) are bounded by this many max heads
MAX_EMPTY_LINES = 8  # empty lines ignored before a request line (RFC 9112 2.2: at least one)


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


class GatewayHttp1Server(ServerFraming, Http1Server):
    def __init__(self, context, on_refusal: OnRefusal, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 head_timeout: float = DEFAULT_HEAD_TIMEOUT, sandbox: str | None = None, streams: dict | None = None,
                 account: Account | None = None, page_for: PageFor | None = None):
        super().__init__(context)
        self.page_for = page_for  # how the policy words a refusal (None: the default text body)
        self._unparsed_account = account  # the bytes read and not parsed yet (buffer budget)
        self.on_refusal = on_refusal
        self._take_small = functools.partial(frame_limits.take, sandbox or "unknown")
        self._streams = streams if streams is not None else {}  # the HTTP layer's streams, by id
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        self.max_header_fields = max_header_fields(context)
        self._head_started: float | None = None  # when the first byte of the current head came
        self._empty_lines = 0  # empty lines skipped since the last head (MAX_EMPTY_LINES)
        self._head_wakeup: commands.RequestWakeup | None = None  # the timer for that head
        self._linger_wakeup: commands.RequestWakeup | None = None  # the end of a lingering close (`_linger`)

    def _refuse(self, decision: Decision, request=None, method: str | None = None) -> layer.CommandGenerator[None]:
        decision = _report(self.on_refusal, self.context, decision, request, method)
        yield commands.SendData(self.conn, self._refusal(decision, request))
        yield commands.CloseConnection(self.conn)
        self.state = self.done

    def _refusal(self, decision: Decision, request) -> bytes:
        """The refusal's bytes, worded as the policy says for this request (its Accept header, when
        its head was parsed)."""
        accept = accept_of(request)
        page = self.page_for(self.context, decision, accept) if self.page_for is not None else default_page(decision)
        return raw_http_refusal(decision, page)

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup):
            if event.command is self._head_wakeup:
                self._head_wakeup = None
                yield from self._head_deadline()
            elif event.command is self._linger_wakeup:
                self._linger_wakeup = None
                yield commands.CloseConnection(self.conn)
            return
        if self._linger_wakeup is not None and isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            self._linger_wakeup = None  # the client read its refusal and left
            if self.conn.state is not ConnectionState.CLOSED:
                yield commands.CloseConnection(self.conn)
            return
        if isinstance(event, events.DataReceived):
            if self.state == self.done:
                return  # refused or finished: nothing reads these bytes, so they are not kept
            if self.state == self.wait and len(self.buf) + len(event.data) > self.max_pipelined_bytes:
                yield from self._refuse_pipeline()
                return
        yield from super()._handle_event(event)
        if isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            if self._unparsed_account is not None:
                self._unparsed_account.close()
        elif not self._charge_unparsed() and self.state != self.done:
            yield from self._cut(Decision.deny(
                "buffer_budget", f"the {len(self.buf)} bytes this connection sent and the gateway has not parsed yet (a "
                                 f"head being read, requests pipelined behind one in flight) would pass the "
                                 f"connection's or the sandbox's buffer budget"), "over the buffer budget")

    def _linger(self) -> layer.CommandGenerator[None]:
        """Close after a refusal sent while the client may still be sending its body: closing at
        once with its bytes unread makes the kernel answer with a reset, which can destroy the
        refusal before the client reads it. FIN first where the connection is the client's own
        TCP (inside a CONNECT tunnel mitmproxy makes any close a full one), then what it sends is
        read and dropped until it closes or LINGER seconds pass (RefusalLayer does the same)."""
        self.state = self.done  # (its bytes are dropped unparsed: `_handle_event`)
        if not in_tunnel(self.context):
            yield commands.CloseTcpConnection(self.conn, half_close=True)
        self._linger_wakeup = commands.RequestWakeup(RefusalLayer.LINGER)
        yield self._linger_wakeup

    def _charge_unparsed(self) -> bool:
        """What the connection holds unparsed (a head still arriving, up to the head limit; requests
        sent ahead of an answer, up to twice that) is charged to the connection's and the sandbox's
        buffer budget like a body (review 17: 500 connections each 120 KB ahead of a slow answer
        held +120 MiB past an 8 MiB budget, and unfinished heads the same). False: over budget."""
        account = self._unparsed_account
        if account is None:
            return True
        held = len(self.buf) if self.state != self.done else 0
        if held < account.held:
            account.release(account.held - held)
        elif held > account.held:
            return account.reserve(held - account.held)
        return True

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
            yield commands.SendData(self.conn, self._refusal(decision, self.request))
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
            self._head_started = now  # (its timer only once a read leaves the head unfinished: below)
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
            elif self.head_timeout and self._head_wakeup is None:
                # The head is unfinished after a read: its deadline is timed even if the client goes
                # silent. Not armed for a head that came whole in one read (nearly all): a timer is a
                # task, a future and a timer handle that lived on for head_timeout after the head was
                # read, ~1.5 KiB on every idle kept-alive connection (issue 18).
                self._head_wakeup = commands.RequestWakeup(self.head_timeout - (now - self._head_started))
                yield self._head_wakeup
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
                    yield commands.SendData(self.conn, self._refusal(decision, self.request))
                    if self.state == self.read_body:
                        yield from self._linger()
                    else:
                        yield commands.CloseConnection(self.conn)
                return
        yield from super().send(event)
