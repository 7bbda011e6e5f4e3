"""HTTP/2 budgets per client connection: the options, and the two pieces of mitmproxy's HTTP/2
stack the gateway replaces to enforce them (the budgets themselves: gateway/h2budget.py; the
server layer that applies them: addons/http2_server.py `GatewayHttp2Server`).

- `LimitedH2Connection` (the client-facing h2 connection) advertises
  `egress_h2_max_concurrent_streams` and refuses a stream over it with RST_STREAM REFUSED_STREAM
  (h2 itself would raise TooManyStreamsError and mitmproxy would tear the whole connection down),
  still decoding its header block so that HPACK stays in step. It also remembers which streams the
  client reset in the same read, so that the server never starts a request for one of them.
  Its GOAWAY names the highest stream the server layer handled (`acted_on`), not the highest
  one parsed: streams parsed and dropped with the backlog (or with a read h2 stopped parsing
  in) never reached a hook or an upstream, and RFC 9113 6.8 lets the client retry them.
- `BoundedFrameBuffer` (its frame buffer) sums a header block's bytes as its HEADERS and
  CONTINUATION frames arrive and stops at `egress_max_head_bytes`: h2 joins the whole block (up to
  64 CONTINUATION frames of 128 KiB, 8 MiB) and HPACK decodes it in one callback before any size
  is checked (an 8 MiB Huffman value held the event loop ~2 s); its decoder's header-list limit is
  the same figure, so what is decoded is bounded too.
- `GatewayHttp2Client` (the upstream h2 connection) drains its queue of streams waiting for a free
  upstream stream slot in a loop: mitmproxy's resumes the next queued stream from inside the call
  that handled the previous one, so a run of queued streams that each close at once (opened and
  reset by the client while they waited) recursed once per stream until RecursionError. An
  upstream's header blocks are bounded as the client's are (h2's 64 KiB header-list default), and
  a response head or trailer section of more than egress_max_header_fields fails its stream; both
  are 502 response_too_large, where h2 would join and decode first and mitmproxy answer 502
  upstream_failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import h2.connection
import h2.errors
import h2.events
import h2.stream
import time

import h2.exceptions
from h2.frame_buffer import CONTINUATION_BACKLOG, FrameBuffer
from hyperframe.frame import (
    ContinuationFrame, DataFrame, HeadersFrame, PushPromiseFrame, ExtensionFrame, GoAwayFrame, PingFrame, PriorityFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame,
)
from mitmproxy.proxy.commands import CloseConnection, Log, RequestWakeup, SendData
from mitmproxy.proxy.events import ConnectionClosed, DataReceived, Wakeup
from mitmproxy.proxy.layers.http._base import HttpEvent, ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError
from mitmproxy.utils import human
from mitmproxy.proxy.layers.http._http2 import Http2Client
from mitmproxy.proxy.layers.http._http_h2 import BufferedH2Connection, SendH2Data

from gateway import h2budget
from gateway.options import DEFAULT_BODY_IDLE_TIMEOUT, DEFAULT_HEAD_TIMEOUT, DEFAULT_MAX_HEAD_BYTES

from . import fair_share, frame_limits, h2_backpressure, read_ahead
from .http1 import DEFAULT_MAX_HEADER_FIELDS, max_header_fields
from .options import declare


_CONTROL_FRAMES = (PingFrame, SettingsFrame, PriorityFrame, ExtensionFrame)
_HEADER_BLOCK_FRAMES = (HeadersFrame, ContinuationFrame, PushPromiseFrame)
_HEADER_BLOCK_TYPES = frozenset(f.type for f in _HEADER_BLOCK_FRAMES)
DEFAULT_DATA_FRAME_TIMEOUT = DEFAULT_BODY_IDLE_TIMEOUT  # an incomplete DATA frame is a body that stopped


@dataclass(frozen=True)
class Limits:
    max_concurrent_streams: int = h2budget.DEFAULT_MAX_CONCURRENT_STREAMS
    max_resets: int = h2budget.DEFAULT_MAX_RESETS
    reset_window: float = h2budget.DEFAULT_RESET_WINDOW
    max_buffered_bytes: int = h2budget.DEFAULT_MAX_BUFFERED_BYTES
    max_control_frames: int = h2budget.DEFAULT_MAX_CONTROL_FRAMES
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    head_timeout: float = DEFAULT_HEAD_TIMEOUT
    max_header_fields: int = DEFAULT_MAX_HEADER_FIELDS
    data_frame_timeout: float = DEFAULT_DATA_FRAME_TIMEOUT  # egress_body_idle_timeout

    @classmethod
    def from_options(cls, options) -> "Limits":
        """The current options (defaults where an embedding did not load this addon)."""
        def get(name, default):
            return getattr(options, name, default)

        return cls(max(1, int(get("egress_h2_max_concurrent_streams", cls.max_concurrent_streams))),
                   max(0, int(get("egress_h2_max_resets", cls.max_resets))),
                   max(0.001, float(get("egress_h2_reset_window", cls.reset_window))),
                   max(0, int(get("egress_h2_max_buffered_bytes", cls.max_buffered_bytes))),
                   max(0, int(get("egress_h2_max_control_frames", cls.max_control_frames))),
                   max(1024, int(get("egress_max_head_bytes", cls.max_head_bytes))),
                   max(0.0, float(get("egress_head_timeout", cls.head_timeout))),
                   max(0, int(get("egress_max_header_fields", cls.max_header_fields))),
                   max(0.0, float(get("egress_body_idle_timeout", cls.data_frame_timeout))))


class StreamRefused(h2.events.Event):
    """A HEADERS frame opened a stream over the concurrency limit; it was answered with
    RST_STREAM REFUSED_STREAM and exists nowhere else."""

    def __init__(self, stream_id: int, headers) -> None:
        self.stream_id = stream_id
        self.headers = headers

    def __repr__(self) -> str:
        return f"<StreamRefused stream_id:{self.stream_id}>"


class ControlFlood(h2.exceptions.ProtocolError):
    """Raised from inside receive_data when the control-frame budget is passed: h2 stops reading
    the rest of the read, queues GOAWAY ENHANCE_YOUR_CALM, and mitmproxy hands this to the server
    as an event (GatewayHttp2Server audits it and closes)."""

    error_code = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    reason = "control_frame_flood"


class ResetFlood(ControlFlood):
    """The same, when the client's RST_STREAM frames pass the reset budget: counted as h2 parses
    them, so a read of thousands of HEADERS+RST_STREAM pairs stops at the limit instead of being
    decoded whole first (one 64 KiB read holds ~1,500 pairs, tens of milliseconds of HPACK)."""

    reason = "reset_flood"


class SmallFrameFlood(ControlFlood):
    """The same, when a small DATA frame found its sandbox's small-frame bucket empty
    (addons/frame_limits.py)."""

    reason = "small_frame_flood"


class HeaderBlockTooLarge(ControlFlood):
    """The same, when a header block (HEADERS and its CONTINUATION frames, before HPACK decodes
    it), or what it decodes to, passed egress_max_head_bytes. Past that point its stream cannot be
    refused alone: HPACK's state depends on every block being decoded whole."""

    reason = "request_head_too_large"

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class FrameTooLarge(ControlFlood):
    """The same, when a frame's header declares more than the advertised maximum frame size
    (RFC 9113 4.2: FRAME_SIZE_ERROR), found before any of its body is kept."""

    error_code = h2.errors.ErrorCodes.FRAME_SIZE_ERROR
    reason = "malformed_request"


class BoundedFrameBuffer(FrameBuffer):
    """h2's frame buffer, with the bytes of the header block being joined summed frame by frame:
    past `max_block_bytes` it raises HeaderBlockTooLarge, before the block is joined or decoded.
    `pending_since` is when what is still arriving of a head began: an unfinished header block's
    first frame, or an incomplete frame other than DATA (None: nothing of a head is pending)."""

    def __init__(self, server: bool, max_block_bytes: int) -> None:
        super().__init__(server=server)
        self.max_block_bytes = max_block_bytes
        self.block_bytes = 0
        self.clock: Callable[[], float] = time.monotonic  # (the server layer's stops while it does not read)
        self.block_started: float | None = None
        self.partial_started: float | None = None  # the first bytes of an incomplete frame
        self.partial_data = False  # ... which is a DATA frame, or of a type not known yet (a body's deadline)
        self._partial_seen = 0  # bytes of it seen so far
        self.pending_wall: float | None = None  # when what is pending began, on the wall clock (the cap)
        # One call's parse stops once this was spent (0: never; the gateway's server sets it: a
        # client connection's reads are parsed a slice at a time, its later steps continue them).
        self.parse_seconds = 0.0
        self.parse_clock: Callable[[], float] = time.perf_counter
        self.more = False  # the last call stopped with whole frames left: parse on (receive_data(b""))
        self._parse_began = 0.0
        self._slice = 0.0  # this call's slice: parse_seconds, less while the sandbox gives way (fair_share)

    def add_data(self, data) -> None:
        """(h2 calls this first in each receive_data: the slice's time counts from here.)"""
        super().add_data(data)
        self.more = False
        self._parse_began = self.parse_clock()
        self._slice = fair_share.parse_slice(self.parse_seconds) if self.parse_seconds else 0.0

    @property
    def pending_since(self) -> float | None:
        started = [t for t in (self.block_started, self.partial_started) if t is not None]
        return min(started) if started else None

    def deadline(self, head_timeout: float, data_timeout: float) -> float | None:
        """When what is pending must have arrived, on `clock` (None: nothing pending, or no limit):
        a header block or a frame other than DATA within `head_timeout`; a DATA frame may go
        `data_timeout` without a byte (a body's idle limit: a slow upload is not a slow head).
        0: no limit. (The caller also caps the whole wait on the wall clock: `pending_wall`.)"""
        deadlines = []
        if self.block_started is not None and head_timeout:
            deadlines.append(self.block_started + head_timeout)
        if self.partial_started is not None:
            timeout = data_timeout if self.partial_data else head_timeout
            if timeout:
                deadlines.append(self.partial_started + timeout)
        return min(deadlines) if deadlines else None

    @property
    def pending_bytes(self) -> int:
        """Bytes held until they are whole: an incomplete frame, and a header block being joined."""
        return (self.block_bytes if self._headers_buffer else 0) + len(self._data)

    def __next__(self):
        """h2 waits for a whole frame before it checks its length against the maximum: a header
        claiming 16 MiB (the gateway advertises 128 KiB) held 15 MiB sent of it per connection
        (95 connections: 2 GiB) with no refusal. Here the length is checked from the header, and a
        header-block frame's against what is left of the head's budget (padding included)."""
        if len(self._data) >= 9:
            length, kind = int.from_bytes(self._data[:3], "big"), self._data[3]
            if (kind == DataFrame.type and self._slice and len(self._data) >= 9 + length
                    and _carries_data(self._data, length)
                    and self.parse_clock() - self._parse_began >= self._slice):
                # A slice of the read is parsed; the rest on the server's next step (review 15: a
                # 64 KiB read of 1-byte DATA frames is ~6,500 frames, ~0.3 s of h2 in one call).
                # Only before a DATA frame: other frames are bounded by their own budgets, and a
                # stream reset in the read that opened it must still never be decided.
                self.more = True
                raise StopIteration
            if length > self.max_frame_size:
                self._data = bytearray()
                raise FrameTooLarge(f"an HTTP/2 frame declared {length} bytes, more than the "
                                    f"{self.max_frame_size} advertised")
            if kind in _HEADER_BLOCK_TYPES:
                joined = self.block_bytes if kind == ContinuationFrame.type and self._headers_buffer else 0
                if joined + length > self.max_block_bytes:
                    self._data = bytearray()
                    self.block_bytes = joined + length
                    raise self._too_large(f"an HTTP/2 header block frame declared {length} bytes, past the "
                                          f"{self.max_block_bytes} of a head")
        try:
            frame = super().__next__()
        except StopIteration:
            if self._data:
                self._note_partial()
            else:
                self.partial_started = None
            self._note_pending()
            raise
        self.partial_started = None
        self._note_pending()
        return frame

    def _note_partial(self) -> None:
        """An incomplete frame's deadline. A DATA frame has a body's idle limit, renewed as its bytes
        move; so do the first 1 to 3 bytes of a frame header, whose type is not known yet (a read
        may end there mid-upload: review 9). Once the type says it is not DATA, the head's deadline
        applies, counted from the frame's first byte (review 12: a header cut before its type
        started no deadline at all, and only tcp_timeout ended the connection)."""
        is_data = len(self._data) < 4 or self._data[3] == DataFrame.type
        if self.partial_started is None:
            self.partial_started = self.clock()
            self.partial_data = is_data
            self._partial_seen = len(self._data)
        elif self.partial_data and not is_data:
            self.partial_data = False
        elif self.partial_data and len(self._data) > self._partial_seen:
            self.partial_started = self.clock()  # a DATA frame's bytes are moving
            self._partial_seen = len(self._data)

    def _note_pending(self) -> None:
        if self.block_started is None and self.partial_started is None:
            self.pending_wall = None
        elif self.pending_wall is None:
            self.pending_wall = time.monotonic()

    def _update_header_buffer(self, f):
        if isinstance(f, _HEADER_BLOCK_FRAMES):
            self.block_bytes = (self.block_bytes if self._headers_buffer else 0) + len(f.data)
            if self.block_bytes > self.max_block_bytes:
                raise self._too_large(f"an HTTP/2 header block passed {self.max_block_bytes} bytes")
            if len(self._headers_buffer) >= CONTINUATION_BACKLOG:  # (h2's own limit, which is not audited)
                raise self._too_large(f"an HTTP/2 header block passed {CONTINUATION_BACKLOG} frames")
        f = super()._update_header_buffer(f)
        if not self._headers_buffer:
            self.block_started = None
        elif self.block_started is None:
            self.block_started = self.clock()
        return f

    def _too_large(self, message: str) -> HeaderBlockTooLarge:
        """The block is dropped: the connection ends, and nothing more of it is kept meanwhile."""
        error = HeaderBlockTooLarge(message, self.block_bytes)
        self._headers_buffer, self.block_bytes, self.block_started = [], 0, None
        return error


def _carries_data(buffer: bytearray, length: int) -> bool:
    """Whether the whole DATA frame at the start of `buffer` carries any data (an empty one,
    padded or not, is a control frame: bounded by the control-frame budget, not sliced)."""
    if buffer[4] & 0x8:  # PADDED: the pad length is the payload's first byte
        return length > 1 and length - 1 - buffer[9] > 0
    return length > 0


PARSE_SECONDS = 0.002  # what one read's parse may take before the rest waits for a later step


def _merged(events: list) -> list:
    """The DataReceived events of one stream from one read, as one while nothing else of that
    stream (or of the connection) came between: the frames' boundaries mean nothing to HTTP, and
    each event costs the layers above far more than h2's parse of it (~100 µs: a client writing
    1-byte DATA frames made one request event per byte). Frames of other streams between two of
    a stream's do not keep them apart (review 15: 9,000 one-byte frames rotating over 100 streams
    in one write, within the small-frame budget, held the loop ~1 s; streams are independent, so
    only each stream's own order, and the connection's events, must be kept)."""
    out: list = []
    open_runs: dict[int, tuple[h2.events.DataReceived, list[bytes]]] = {}  # stream -> (its run's event, data)
    runs: list[tuple[h2.events.DataReceived, list[bytes]]] = []  # every run of more than one frame
    for event in events:
        stream_id = getattr(event, "stream_id", None)
        if isinstance(event, h2.events.DataReceived) and stream_id:
            run = open_runs.get(stream_id)
            if run is None:
                out.append(event)
                if event.stream_ended is None:
                    open_runs[stream_id] = (event, [event.data])
                continue
            head, parts = run
            if len(parts) == 1:
                runs.append(run)
            parts.append(event.data)
            head.flow_controlled_length += event.flow_controlled_length
            if event.stream_ended is not None:  # its last frame: nothing more to merge into it
                head.stream_ended = event.stream_ended
                del open_runs[stream_id]
            continue
        if stream_id:
            open_runs.pop(stream_id, None)  # the stream's own event: its later DATA comes after it
        else:
            open_runs.clear()  # the connection's (settings, a ping, its window): all of it after
        out.append(event)
    for head, parts in runs:
        head.data = b"".join(parts)
    return out


def _empty_data(frame) -> bool:
    return isinstance(frame, DataFrame) and not frame.data and "END_STREAM" not in frame.flags


class CoalescedSends(BufferedH2Connection):
    """mitmproxy's send buffers (data waiting for the peer's flow-control window), with what is
    queued behind data already waiting joined into its last piece, up to a frame's size: a piece
    per send piled up otherwise, and everything that walks the buffers paid per piece (review 32:
    an HTTP/2 client that never opened its window, fed 1-byte pieces by its upstream, made the
    gateway sum millions of pieces after every event and held the worker for everyone). The piece
    being joined is a bytearray, extended in place (h2 sends any bytes-like object)."""

    def send_data(self, stream_id: int, data, end_stream: bool = False, pad_length: None = None) -> None:
        waiting = self.stream_buffers.get(stream_id)
        if waiting and data:
            last = waiting[-1]
            if not last.end_stream and len(last.data) + len(data) <= self.max_outbound_frame_size:
                joined = last.data if isinstance(last.data, bytearray) else bytearray(last.data)
                joined += data
                waiting[-1] = SendH2Data(joined, end_stream)
                return
        super().send_data(stream_id, data, end_stream, pad_length)


class UpstreamH2Connection(CoalescedSends):
    """The upstream HTTP/2 connection's h2: each read's DATA frames of one stream come out as one
    event (`_merged`), as on the client side: an upstream writing 1-byte frames made one event per
    byte through every layer in one step of the loop (review 32: another sandbox's p50 15 ms -> 4.2 s)."""

    def receive_data(self, data: bytes):
        return _merged(super().receive_data(data))


class LimitedH2Connection(CoalescedSends):
    def __init__(self, config, max_streams: int, max_control_frames: int = h2budget.DEFAULT_MAX_CONTROL_FRAMES,
                 small_frame: Callable[[int], bool] | None = None, resets: h2budget.ResetTracker | None = None,
                 max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES):
        super().__init__(config)
        self.incoming_buffer = BoundedFrameBuffer(not config.client_side, max_head_bytes)
        self.resets = resets  # the connection's reset budget, shared with its server layer
        self.small_frame = small_frame  # a small DATA frame arrived: False when its sandbox has no tokens
        self.small_frames = 0
        self.stream_limit = max_streams
        self.control = h2budget.ControlFrameTracker(max_control_frames)
        # Advertised in the first SETTINGS frame; acknowledged here at once (as mitmproxy does for
        # its own settings) so that h2's own check and the one below agree from the first frame.
        self.local_settings.max_concurrent_streams = max_streams
        self.local_settings.max_header_list_size = max_head_bytes
        self.decoder.max_header_list_size = max_head_bytes  # (h2 sets it only when a SETTINGS ACK comes)
        self.local_settings.acknowledge()
        self.acted_on = 0  # the highest stream id whose request the server layer has handled

    def close_connection(self, error_code=0, additional_data=None, last_stream_id=None) -> None:
        super().close_connection(error_code, additional_data,
                                 self.acted_on if last_stream_id is None else last_stream_id)

    def _terminate_connection(self, error_code) -> None:
        """h2's GOAWAY for an error met while parsing (a flood raised in `_receive_frame`)."""
        goaway = GoAwayFrame(0)
        goaway.last_stream_id = self.acted_on
        goaway.error_code = error_code
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_GOAWAY)
        self._prepare_for_sending([goaway])

    def receive_data(self, data: bytes):
        return _merged(super().receive_data(data))

    def _receive_frame(self, frame):
        """Counts the frames that carry no request (gateway/h2budget.py `ControlFrameTracker`) and
        drops those of an unknown type here: mitmproxy would turn each into a log line."""
        if isinstance(frame, RstStreamFrame) and self.resets is not None and self.resets.note(time.monotonic()):
            raise ResetFlood(f"more than {self.resets.limit} HTTP/2 streams reset in {self.resets.window:g}s")
        if isinstance(frame, WindowUpdateFrame):
            over = self.control.window_update(time.monotonic())
        elif isinstance(frame, _CONTROL_FRAMES) or _empty_data(frame):
            over = self.control.control(time.monotonic())
        else:
            if (isinstance(frame, DataFrame) and self.small_frame is not None
                    and frame_limits.small(frame.flow_controlled_length)):
                self.small_frames += 1
                if not self.small_frame(frame_limits.H2_FRAME_COST):
                    raise SmallFrameFlood(f"{frame_limits.describe()}; the connection was closed (GOAWAY)")
            return super()._receive_frame(frame)
        if over:
            raise ControlFlood(f"more than {self.control.limit} HTTP/2 control frames in "
                               f"{h2budget.CONTROL_WINDOW:g}s")
        if isinstance(frame, ExtensionFrame):
            return []  # RFC 9113 4.1: a frame of an unknown type is ignored and discarded
        return super()._receive_frame(frame)

    def _prepare_for_sending(self, frames):
        """Each DATA frame sent earns the WINDOW_UPDATEs a reading client sends back for it."""
        sent = sum(1 for frame in frames if isinstance(frame, DataFrame))
        if sent:
            self.control.data_sent(sent)
        return super()._prepare_for_sending(frames)

    def _receive_headers_frame(self, frame):
        stream_id = frame.stream_id
        if (stream_id not in self.streams and stream_id > self.highest_inbound_stream_id and stream_id % 2 == 1
                and self.open_inbound_streams >= self.stream_limit):
            headers = h2.connection._decode_headers(self.decoder, frame.data)  # HPACK state must stay in step
            events = self.state_machine.process_input(h2.connection.ConnectionInputs.RECV_HEADERS)
            self.highest_inbound_stream_id = stream_id
            # Later frames on it get what h2 does for a stream it reset itself (RST_STREAM again;
            # the connection window still counts their DATA).
            self._closed_streams[stream_id] = h2.stream.StreamClosedBy.SEND_RST_STREAM
            refusal = RstStreamFrame(stream_id)
            refusal.error_code = h2.errors.ErrorCodes.REFUSED_STREAM
            return [refusal], [*events, StreamRefused(stream_id, headers)]
        return super()._receive_headers_frame(frame)


class GatewayHttp2Client(Http2Client):
    """mitmproxy's upstream HTTP/2 connection with an iterative stream queue (see the module
    docstring); otherwise the same code as Http2Client._handle_event (mitmproxy 12.3)."""

    _draining = False

    _parse_wakeup: RequestWakeup | None = None  # a read's parse cut at its slice goes on then
    _close_pending: ConnectionClosed | None = None  # the upstream's close, held while a parse is cut

    def __init__(self, context):
        super().__init__(context)
        self.h2_conn.__class__ = UpstreamH2Connection  # (mitmproxy made it; the same state, merged reads)
        self.h2_conn.incoming_buffer = BoundedFrameBuffer(False, self.h2_conn.DEFAULT_MAX_HEADER_LIST_SIZE)
        # A read's frames are parsed PARSE_SECONDS per step, as the client side's: 64 KiB of 1-byte
        # DATA frames from an upstream was one step of 70-146 ms (review 33).
        self.h2_conn.incoming_buffer.parse_seconds = PARSE_SECONDS

    def handle_h2_event(self, event):
        if isinstance(event, (HeaderBlockTooLarge, FrameTooLarge, h2.exceptions.DenialOfServiceError)):
            message = (f"the upstream's HTTP/2 header block passed {self.h2_conn.DEFAULT_MAX_HEADER_LIST_SIZE} bytes"
                       if not isinstance(event, FrameTooLarge) else f"the upstream's {event}"[:300])
            yield Log(f"{human.format_address(self.conn.peername)}: egress gateway: {message}")
            yield SendData(self.conn, self.h2_conn.data_to_send())  # the GOAWAY h2 queued as it raised
            yield CloseConnection(self.conn)
            for stream_id in self.streams:
                yield ReceiveHttp(ResponseProtocolError(stream_id, message, ErrorCode.RESPONSE_TOO_LARGE))
            self.streams.clear()
            self._handle_event = self.done
            return True
        if (isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived))
                and event.stream_id in self.streams):
            fields = sum(1 for name, _ in event.headers if not name.startswith(b":"))
            if fields > (limit := max_header_fields(self.context)) > 0:
                section = "response head" if isinstance(event, h2.events.ResponseReceived) else "trailer section"
                if not self.is_closed(event.stream_id):  # (its END_STREAM may have come with it)
                    self.h2_conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.CANCEL)
                    yield SendData(self.conn, self.h2_conn.data_to_send())
                self.streams.pop(event.stream_id, None)
                yield ReceiveHttp(ResponseProtocolError(
                    event.stream_id, f"the upstream's {section} has {fields} header fields, more than "
                                     f"egress_max_header_fields ({limit})", ErrorCode.RESPONSE_TOO_LARGE))
                return False
        return (yield from super().handle_h2_event(event))

    def _no_free_streams(self) -> bool:
        return self.h2_conn.open_outbound_streams >= (
            self.provisional_max_concurrency or self.h2_conn.remote_settings.max_concurrent_streams)

    def _handle_event(self, event):
        """The stream queue (`_handle_queued`), with a read's parse in slices: what a slice left is
        parsed at a wakeup, while more than READ_AHEAD_BYTES waits the client connection's readers
        wait (addons/read_ahead.py), and the upstream's close waits until it is all parsed."""
        if isinstance(event, Wakeup) and event.command is self._parse_wakeup:
            self._parse_wakeup = None
            event = DataReceived(self.conn, b"")  # the next slice of what was read
        elif isinstance(event, ConnectionClosed) and event.connection is self.conn and self.h2_conn.incoming_buffer.more:
            self._close_pending = event
            return
        yield from self._handle_queued(event)
        buffer = self.h2_conn.incoming_buffer
        # (A connection that ended in this event answers with `done` from now on: what it left
        # unparsed is never parsed, and must not hold the client's readers.)
        more = buffer.more and "_handle_event" not in self.__dict__
        if more and self._parse_wakeup is None:
            self._parse_wakeup = RequestWakeup(0)
            yield self._parse_wakeup
        read_ahead.settle_bytes(self.context.client, self, len(buffer._data) if more else 0)
        if not buffer.more and self._close_pending is not None:
            close, self._close_pending = self._close_pending, None
            yield from self._handle_queued(close)

    def _handle_queued(self, event):
        if isinstance(event, HttpEvent):
            ours = self.our_stream_id.get(event.stream_id, None)
            if ours is None:
                # A stream already waiting keeps waiting behind its own first event.
                if event.stream_id in self.stream_queue or self._no_free_streams():
                    self.stream_queue[event.stream_id].append(event)
                    return
                ours = self.h2_conn.get_next_available_stream_id()
                self.our_stream_id[event.stream_id] = ours
                self.their_stream_id[ours] = event.stream_id
            event.stream_id = ours

        for cmd in self._handle_event2(event):
            if isinstance(cmd, ReceiveHttp):
                cmd.event.stream_id = self.their_stream_id[cmd.event.stream_id]
            yield cmd

        if self._draining:
            return  # the outer call goes on with the queue
        self._draining = True
        try:
            while self.stream_queue and not self._no_free_streams():
                events = self.stream_queue.pop(next(iter(self.stream_queue)))  # FIFO
                for queued in events:
                    yield from self._handle_queued(queued)
        finally:
            self._draining = False


def install() -> None:
    """Make mitmproxy's HTTP layer build `GatewayHttp2Client` for upstream h2 connections
    (HttpLayer and HttpClient look the class up in their module at run time)."""
    from mitmproxy.proxy.layers import http as http_layers

    http_layers.Http2Client = GatewayHttp2Client


class Http2Limits:
    """Declares the HTTP/2 budget options; the HTTP/2 server reads them per connection."""

    def __init__(self) -> None:
        install()

    def load(self, loader) -> None:
        declare(
            loader,
            "egress_h2_max_concurrent_streams",
            "egress_h2_max_resets",
            "egress_h2_reset_window",
            "egress_h2_max_control_frames",
            "egress_h2_max_unread_bytes_per_sandbox",
            "egress_h2_max_buffered_bytes",
        )

    def configure(self, updated) -> None:
        if "egress_h2_max_unread_bytes_per_sandbox" in updated:
            from mitmproxy import ctx
            h2_backpressure.sandbox_high_water = max(0, int(ctx.options.egress_h2_max_unread_bytes_per_sandbox))
