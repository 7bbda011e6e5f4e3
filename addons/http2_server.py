"""The gateway's client-facing HTTP/2 server, `GatewayHttp2Server` (the HTTP layer of addons/layers.py
puts it under each HTTP/2 client connection); its budgets are gateway/h2budget.py, their options
and h2 connection addons/h2_limits.py.
"""

from __future__ import annotations

import functools
import logging
import time

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import RequestHeaders
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestProtocolError,
    ResponseHeaders,
    ResponseEndOfMessage,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.utils import human
from mitmproxy.proxy.layers.http._http2 import CATCH_HYPER_H2_ERRORS, Http2Server, StreamState

import h2.errors
import h2.events
import h2.exceptions

from gateway import h2budget
from gateway.budget import Account
from gateway.decision import Decision

from . import frame_limits, h2_backpressure, h2_limits
from .respond import COUNTS_AS_RESET, PageFor, accept_of, challenge_fields, default_page, refusal_headers
from .refusals import REFUSAL_ATTR, _ERROR_REASONS, OnRefusal, _report, _too_many_fields, protocol_error_decision
from .refusal_layers import in_tunnel


def _data_bytes(event) -> int:
    """The body bytes an h2 event carries (what it holds while it waits in the backlog)."""
    return len(event.data) if isinstance(event, h2.events.DataReceived) else 0


def _stream_of(event) -> int | None:
    """The stream an h2 event belongs to (None or 0: the connection itself)."""
    return getattr(event, "stream_id", None)


def _opens_request(event) -> bool:
    return isinstance(event, h2.events.RequestReceived)


def _regular_fields(headers) -> int:
    """The header fields of an HTTP/2 header list, its pseudo-header fields not counted."""
    return sum(1 for name, _ in headers if not name.startswith(b":"))


class GatewayHttp2Server(Http2Server):
    """mitmproxy's HTTP/2 server, except that
    - an error it would answer with its own HTML page (quoting what failed) is answered in the
      gateway's format: text body, X-Egress-Reason (no body at all to a HEAD request);
    - what waits for the client's flow-control window is reported to addons/h2_backpressure.py
      after every event, which holds the upstream readers while it is too much;
    - the per-connection budgets of gateway/h2budget.py apply (options: addons/h2_limits.py):
      concurrent streams (over: RST_STREAM REFUSED_STREAM, `too_many_streams`), resets in a sliding
      window (over: GOAWAY ENHANCE_YOUR_CALM and close, `reset_flood`), and request-body bytes held
      in memory (a stream whose next DATA frame would pass the budget gets 503 `buffer_budget`, as
      do, heaviest first, the streams whose DATA waits in the backlog past the buffer budget);
      a stream the client reset before its HEADERS were handled never becomes a request. Refused
      streams are audited at most once per second and reason, with a `repeated` count;
    - one read's HTTP/2 events are handled through a backlog, at most STREAMS_PER_STEP new requests
      per step of the event loop, and no more once STEP_SECONDS were spent in it: each request is
      decided when it is handled (~0.3-1 ms), and a read of 100 HEADERS frames held every other
      connection of the worker for ~120 ms; 8 of them, 2-15 ms (rapid reset)."""

    STREAMS_PER_STEP = 8
    STEP_SECONDS = 0.001

    def __init__(self, context, on_refusal: OnRefusal, streams: dict | None = None, sandbox: str | None = None,
                 account: Account | None = None, page_for: PageFor | None = None):
        super().__init__(context)
        self.page_for = page_for  # how the policy words a refusal (None: the default text body)
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
        # h2 events parsed and not handled yet, in order, and the DATA they carry (charged with the pending frames)
        self._backlog = h2budget.Backlog(_data_bytes, _opens_request, self.STREAMS_PER_STEP, self.STEP_SECONDS)
        self._backlog_wakeup: commands.RequestWakeup | None = None
        self._block_wakeup: commands.RequestWakeup | None = None  # the deadline of an unfinished header block
        self._block_due = 0.0  # when that wakeup fires (monotonic)
        self.h2_conn.incoming_buffer.clock = h2_backpressure.reading_clock(context.client)
        self.h2_conn.incoming_buffer.parse_seconds = h2_limits.PARSE_SECONDS  # (continued in _run_backlog)

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
                if not self._backlog and self.h2_conn.incoming_buffer.more:
                    yield from self._tracked(self._received(b""))  # the next slice of the last read
                else:
                    yield from self._tracked(self._run_backlog())
                h2_backpressure.update(self.context.client, self._unread(), self._sandbox)
                self._charge_pending_frames()  # (only less is held now: what the step handled is released)
            elif event.command is self._block_wakeup:
                self._block_wakeup = None
                yield from self._block_deadline()
            return
        if isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            self._backlog.clear()  # what the client sent before it closed: its streams fail with it
        yield from self._handle(event)
        if isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            h2_backpressure.release(self.context.client)
            if self._frames_account is not None:
                self._frames_account.close()
            return
        h2_backpressure.update(self.context.client, self._unread(), self._sandbox)
        if isinstance(event, events.DataReceived) and event.connection is self.conn and not self._closing:
            if not self._charge_pending_frames() and not (yield from self._shed_backlog()):
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
        return self.h2_conn.incoming_buffer.pending_bytes + self._backlog.bytes

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

    def _shed_backlog(self) -> layer.CommandGenerator[bool]:
        """Over the buffer budget with DATA waiting in the backlog: the streams it waits for are
        refused, heaviest first (503 `buffer_budget`, the rest of their body reset, the windows of
        what they sent given back), until what is left fits. One stream's body no longer ends the
        connection and every other stream on it (a 1 MiB budget and 100 uploads GOAWAYed them all).
        True: it fits now, or the connection is closing anyway (a reset flood)."""
        account = self._frames_account
        while account is not None:
            need = self._pending_bytes() - account.held - (account.room() or 0)  # what must go for the rest to fit
            taken = self._backlog.take_heaviest(max(need, 1), _stream_of)
            if not taken:
                return False
            for stream_id, events_ in taken:
                for event in events_:
                    if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                        self.h2_conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
                flow = getattr(self._streams.get(stream_id), "flow", None)
                decision = Decision.deny("buffer_budget", "the HTTP/2 frames this connection sent and the gateway has "
                                                          "not handled yet would pass the connection's or the "
                                                          "sandbox's buffer budget; this stream, one of those holding "
                                                          "the most, was refused")
                yield from self._refuse_stream(stream_id, decision, flow.request if flow is not None else None)
                if (yield from self._count_reset(time.monotonic())):
                    return True
            if self._charge_pending_frames():
                return True
        return False

    def _over_budget(self) -> layer.CommandGenerator[None]:
        pending = self._pending_bytes()
        self._backlog.clear()  # (not acted on: the GOAWAY's last stream id says so)
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
        if isinstance(event, h2.events.DataReceived) and not event.data and event.stream_ended is None:
            # Empty DATA carries nothing (a flood of it is counted as control frames): it never
            # becomes an empty body piece for the layers above, only its padding is acknowledged.
            if event.flow_controlled_length:
                self.h2_conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return False
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
        accept = b", ".join(bytes(v) for k, v in event.headers if bytes(k).lower() == b"accept")
        self._send_refusal(event.stream_id, decision, accept.decode("latin-1") or None)
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
        """Before a DATA frame goes up: True to pass it on, False when its stream was refused.
        Streams that stopped holding are let go only when the budget would refuse (each once):
        a sweep per frame cost frames x streams (review 15)."""
        stream = self._streams.get(event.stream_id)
        if not self._holding(stream) or self.ledger.admit(event.stream_id, len(event.data)):
            return True
        for stream_id in list(self.ledger.held):
            if not self._holding(self._streams.get(stream_id)):
                self.ledger.release(stream_id)
        if self.ledger.admit(event.stream_id, len(event.data)):
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
            self._send_refusal(stream_id, decision, accept_of(request))
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

    def _send_refusal(self, stream_id: int, decision: Decision, accept: str | None = None) -> None:
        page = self.page_for(self.context, decision, accept) if self.page_for is not None else default_page(decision)
        body = page.body
        headers = [(b":status", b"%d" % decision.status)]
        fields = [*refusal_headers(decision, page.content_type).items(), *challenge_fields(decision)]
        headers += [(k.lower().encode(), v.encode()) for k, v in fields]
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
            flow = getattr(self._streams.get(event.stream_id), "flow", None)
            self._send_refusal(event.stream_id, decision, accept_of(getattr(flow, "request", None)))
            self._head_requests.discard(event.stream_id)  # (answered: it is not looked up again)
            yield commands.SendData(self.conn, self.h2_conn.data_to_send())
            if decision.reason == "buffer_budget" or decision.status == 429:
                # A stream refused before any hook took a token (a head over the budget), or a
                # rate's refusal answered at once (a refused head that asked for `100 Continue`,
                # addons/http_stream.py): a flood of them ends like a flood of resets (GOAWAY).
                yield from self._count_reset(time.monotonic())
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
            self._backlog.clear()
            parsed = [e]
        self._backlog.extend(parsed)
        yield from self._run_backlog()

    def _run_backlog(self) -> layer.CommandGenerator[None]:
        """Handle the backlog's events in order until STREAMS_PER_STEP requests were opened, or one
        or more in STEP_SECONDS; the rest on a wakeup, a later step of the loop (a new read meanwhile only adds to the backlog's
        end). The client's flow-control windows are acknowledged as events are handled, so what
        the backlog can hold is bounded by them, as by the stream limit and the flood budgets."""
        for h2_event in self._backlog.step():
            if (yield from self.handle_h2_event(h2_event)):
                self._backlog.clear()
                return
        if (self._backlog or self.h2_conn.incoming_buffer.more) and self._backlog_wakeup is None:
            # the step ended with events left, or the read's parse with frames left
            self._backlog_wakeup = commands.RequestWakeup(0)
            yield self._backlog_wakeup
        data = self.h2_conn.data_to_send()
        if data:
            yield commands.SendData(self.conn, data)
