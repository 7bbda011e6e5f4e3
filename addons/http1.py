"""HTTP/1 framing that streamed bodies need and mitmproxy 12.3's HTTP/1 layers get wrong.

- **An empty piece is "nothing yet", never the end.** mitmproxy writes every ResponseData or
  RequestData on a chunked message as a chunk, so an empty one becomes `0\\r\\n\\r\\n`, the
  end-of-body marker, after which it goes on writing chunks on a connection whose framing is
  already closed (a redactor holding back a tail returns b"" and turned a streamed answer into an
  empty body). Both writers here drop empty pieces.
- **Trailers.** mitmproxy's HTTP/1 reader raises on a chunked message with trailer fields and its
  writers have no trailers at all; gRPC's status lives there. Upstream responses' trailers are read
  and passed on (to an HTTP/2 client as trailers, to an HTTP/1 client after the last chunk).
- **HTTP/2 to HTTP/1 translation of bodies of unknown length.** A request from an HTTP/2 client
  without content-length is written upstream chunked (written bare, an HTTP/1 server would read
  the body as the next request on the connection); a response from an HTTP/2 upstream without
  content-length is written to an HTTP/1 client chunked, so it can keep the connection and get
  trailers.

`GatewayHttp1Server` (addons/http1_server.py) uses `ServerFraming`; the upstream side is mitmproxy's
Http1Client, replaced by `GatewayHttp1Client` through `install()` (mitmproxy builds it by name).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from time import perf_counter

import h11
import h11._readers
from h11._receivebuffer import ReceiveBuffer
from mitmproxy import http
from mitmproxy.net.http import http1, status_codes
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestData,
    RequestEndOfMessage,
    RequestHeaders,
    RequestProtocolError,
    RequestTrailers,
    ResponseData,
    ResponseEndOfMessage,
    ResponseHeaders,
    ResponseProtocolError,
    ResponseTrailers,
)
from mitmproxy.proxy.layers.http._http1 import Http1Client, should_make_pipe

from gateway.bodies import MAX_INTERIM_RESPONSES, UpstreamExchange, request_framing
from gateway.options import DEFAULT_MAX_HEADER_FIELDS
from gateway.streaming import FORBIDDEN_TRAILERS

from . import fair_share, frame_limits, read_ahead


def _is_chunked(message) -> bool:
    return "chunked" in message.headers.get("transfer-encoding", "").lower()


def _may_have_body(request, response) -> bool:
    return not (request.method.upper() == "HEAD" or 100 <= response.status_code < 200
                or response.status_code in (204, 304))


def last_chunk(trailers: http.Headers | None) -> bytes:
    """The end of a chunked body, with the trailer fields that may be sent there."""
    if not trailers:
        return b"0\r\n\r\n"
    kept = http.Headers([(k, v) for k, v in trailers.fields if k.lower().decode("latin-1") not in FORBIDDEN_TRAILERS])
    return b"0\r\n%s\r\n" % bytes(kept) if kept.fields else b"0\r\n\r\n"


_BLANK_LINE = re.compile(rb"\n\r?\n")  # where a head or trailer section ends (as h11 finds it)


class HeadLines:
    """The lines of a head (or trailer section) still arriving in an h11 receive buffer, counted
    incrementally (each byte once, however it is trickled), up to the blank line that ends it:
    checked before the section is parsed, whose cost grows with its fields (50,000 fields of an
    upstream's 256 KiB head cost ~70 ms of the loop in mitmproxy's parse, its trailers ~200 ms)."""

    def __init__(self) -> None:
        self.scanned = 0
        self.lines = 0

    def count(self, buf: ReceiveBuffer) -> int:
        data = buf._data  # only appended to until the section is extracted (then `reset`)
        if data[:1] == b"\n" or data[:2] == b"\r\n":
            self.__init__()  # an empty section (h11 extracts it as no lines): what follows is not in it
            return 0
        if len(data) < self.scanned:
            self.__init__()
        # a blank line ends with up to three bytes ("\n\r\n"): one that began in the last read
        # (its "\n\r" was counted there) is looked for from two bytes back
        blank = _BLANK_LINE.search(data, max(self.scanned - 2, 0))
        end = blank.start() + 1 if blank else len(data)
        if end > self.scanned:
            self.lines += data.count(b"\n", self.scanned, end)
            self.scanned = end
        return self.lines

    reset = __init__


class TooManyFields(Exception):
    """A head or trailer section passed egress_max_header_fields before it was parsed."""


class _CountedChunkedReader(h11._readers.ChunkedReader):
    """h11's chunked reader, whose trailer section is counted before h11 parses it."""

    max_fields = 0
    _trailer_lines: HeadLines | None = None

    def __call__(self, buf):
        if self._reading_trailer and self.max_fields:
            if self._trailer_lines is None:
                self._trailer_lines = HeadLines()
            if (lines := self._trailer_lines.count(buf)) > self.max_fields:
                raise TooManyFields(f"the trailer section has more than {self.max_fields} fields ({lines} lines so far)")
        return super().__call__(buf)


def count_trailer_fields(reader, max_fields: int):
    """The body reader, with a chunked body's trailer section bounded to `max_fields` (0: none).
    mitmproxy makes h11's own reader; it is given the counting subclass (same state, one more check)."""
    if max_fields and type(reader) is h11._readers.ChunkedReader:
        reader.__class__ = _CountedChunkedReader
        reader.max_fields = max_fields
    return reader


class TrailerCatcher:
    """Wraps an h11 body reader: a chunked body's trailer fields are kept in `trailers` and the end
    of message goes on without them (mitmproxy would raise NotImplementedError)."""

    def __init__(self, reader, max_fields: int = 0):
        self.reader = count_trailer_fields(reader, max_fields)
        self.trailers: http.Headers | None = None

    def __call__(self, buf):
        return self._catch(self.reader(buf))

    def read_eof(self):
        return self._catch(self.reader.read_eof())

    def _catch(self, event):
        if isinstance(event, h11.EndOfMessage) and event.headers:
            self.trailers = http.Headers([(bytes(k), bytes(v)) for k, v in event.headers])
            return h11.EndOfMessage()
        return event


class SmallChunkFlood(Exception):
    """A small chunk found its sandbox's small-frame bucket empty (addons/frame_limits.py)."""


class MalformedBody(Exception):
    """h11 could not read the request's body framing (a chunk-size line that is not one, a bare LF):
    raised instead of h11's ProtocolError, which mitmproxy turns into a silent close."""


SLICE_CHECK = 16  # chunks parsed between two looks at the clock (~8 µs each when 1 byte)
UPSTREAM_PARSE_SLICE = 0.001  # seconds of an upstream's chunked body parsed per step of the loop


class ChunkMerger:
    """Wraps an h11 body reader: what one read brought comes out as one Data event however many
    chunks it was sent in (chunk boundaries mean nothing to HTTP, and each event costs the layers
    above far more than h11's parse: 1-byte chunks made one event per byte). A request from the
    client: each chunk under egress_small_frame_bytes takes a token through `take`; when none is
    left, `SmallChunkFlood` is raised. A response from an upstream (`take` None, `malformed`
    False): merged only, its framing errors left to mitmproxy (review 32: an upstream's 1-byte
    chunks held the loop for every sandbox, another's p50 17 ms -> 3.5 s). With `slice_seconds`, a
    read's parse stops after about that long (checked every SLICE_CHECK chunks) and sets `cut`: the
    caller continues it at a wakeup, a later step (merged, a read of 64 KiB of 1-byte chunks was
    still one ~0.1 s step)."""

    def __init__(self, reader, take: Callable[[int], bool] | None, max_fields: int = 0, malformed: bool = True,
                 slice_seconds: float | None = None):
        self.reader = count_trailer_fields(reader, max_fields)
        self.take = take
        self.malformed = malformed  # raise MalformedBody for h11's ProtocolError (False: let it through)
        self.slice_seconds = slice_seconds  # parse at most about this long per step (None: all of a read)
        self.cut = False  # a run was cut at the slice: what is left in the buffer waits for the next step
        self.small_chunks = 0
        self._chunk = 0  # bytes of the chunk being read
        self._next = None  # the event that ended a merged run, returned on the next call
        self._paused = False  # the next call says "no more for now" (None), once
        self._error: Exception | None = None  # bad framing met after merged pieces: raised at the next call

    def __call__(self, buf):
        if self._next is not None:
            event, self._next = self._next, None
            return event
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._paused:
            self._paused = False
            return None
        pieces = []
        began = perf_counter() if self.slice_seconds is not None else 0.0
        while True:
            try:
                event = self.reader(buf)
            except h11.ProtocolError as exc:
                if self.malformed:  # a client's: refused, nothing of the read goes on
                    raise MalformedBody(str(exc)) from None
                if not pieces:
                    raise
                self._error = exc  # an upstream's: what came before the bad framing goes on first (review 33)
                return h11.Data(data=b"".join(pieces))
            if not isinstance(event, h11.Data):
                break
            self._meter(event)
            pieces.append(bytes(event.data))
            if (self.slice_seconds is not None and len(pieces) % SLICE_CHECK == 0
                    and perf_counter() - began > self.slice_seconds):
                self.cut = self._paused = True  # the rest of the read on a later step (the caller's wakeup)
                return h11.Data(data=b"".join(pieces))
        if not pieces:
            return event
        self._next = event
        return h11.Data(data=b"".join(pieces))

    def read_eof(self):
        return self.reader.read_eof()  # a body cut short by the client's close: mitmproxy's handling

    def _meter(self, event: h11.Data) -> None:
        if event.chunk_start:
            self._chunk = 0
        self._chunk += len(event.data)
        if event.chunk_end and self.take is not None and frame_limits.small(self._chunk):
            self.small_chunks += 1
            if not self.take(frame_limits.FRAME_COST):
                raise SmallChunkFlood(frame_limits.describe())


class ServerFraming:
    """Towards the client (mixed into the gateway's Http1Server): no empty chunk, trailers after
    the last chunk, chunked framing for translated HTTP/2 responses of unknown length."""

    _pending_trailers: http.Headers | None = None

    def send_framed(self, event) -> layer.CommandGenerator[bool]:
        """Handles the events whose framing the gateway owns; False: the caller sends it as usual."""
        if isinstance(event, ResponseHeaders):
            yield from self._send_head(event)
            return True
        if isinstance(event, ResponseData) and not event.data:
            return True
        if isinstance(event, ResponseTrailers):
            # Sent after the last chunk; without chunked framing there is nowhere to put them.
            self._pending_trailers = event.trailers if self.response is not None and _is_chunked(self.response) else None
            return True
        if (isinstance(event, ResponseEndOfMessage) and self._pending_trailers is not None
                and self.request is not None and self.request.method.upper() != "HEAD"):
            trailers, self._pending_trailers = self._pending_trailers, None
            yield commands.SendData(self.conn, last_chunk(trailers))
            yield from self.mark_done(response=True)
            return True
        return False

    def _send_head(self, event: ResponseHeaders) -> layer.CommandGenerator[None]:
        response = event.response
        self._pending_trailers = None
        if response.is_http2 or response.is_http3:
            response = response.copy()
            response.http_version = "HTTP/1.1"
            response.reason = status_codes.RESPONSES.get(response.status_code, "")
            if (not event.end_stream and "content-length" not in response.headers
                    and self.request is not None and _may_have_body(self.request, response)):
                response.headers["transfer-encoding"] = "chunked"
        # The framing that follows is the framing of what was written.
        self.response = response
        yield commands.SendData(self.conn, http1.assemble_response_head(response))


def _interim_status(buf) -> int | None:
    """The status of the response head at the start of `buf` when it is an interim one (1xx but
    101, which switches protocols), else None."""
    start = bytes(buf)[:13]
    if len(start) < 13 or not start.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1")) or start[12:13] not in (b" ", b"\r", b"\n"):
        return None
    try:
        status = int(start[9:12])
    except ValueError:
        return None
    return status if status != 101 else None


MAX_RESPONSE_HEAD_BYTES = 256 * 1024  # an upstream's response head, or bytes it sends with no response due


def max_header_fields(context) -> int:
    """The field limit of one head or trailer section, in either direction (0: none)."""
    return max(0, int(getattr(context.options, "egress_max_header_fields", DEFAULT_MAX_HEADER_FIELDS)))


class GatewayHttp1Client(Http1Client):
    """Towards the upstream: no empty chunk, chunked framing for translated HTTP/2 request bodies of
    unknown length, request trailers after the last chunk, and response trailers read. And the
    connection is reused only after an exchange that cannot have left bytes behind
    (gateway/bodies.py `UpstreamExchange`): interim 1xx responses are read past (mitmproxy took the
    first for the final response), and a request body, an early response or an interim response
    ends the connection once the exchange is over."""

    _chunked_body = False
    _pending_trailers: http.Headers | None = None
    _exchange: UpstreamExchange | None = None

    def __init__(self, context):
        super().__init__(context)
        self._head_lines = HeadLines()  # of the response head arriving

    def send(self, event) -> layer.CommandGenerator[None]:
        self._note_sent(event)
        if isinstance(event, RequestProtocolError):
            # The stream is over (a client's reset, a refusal): mitmproxy closes the connection,
            # and nobody wants what it sent that is not parsed yet (parsed at its close, it was
            # steps of ~0.2 s for a response already cut off: review 33).
            self.buf = ReceiveBuffer()
            read_ahead.settle_bytes(self.context.client, self, 0)
        if isinstance(event, RequestHeaders) and (event.request.is_http2 or event.request.is_http3):
            if self.stream_id is None:
                self.stream_id = event.stream_id
                self.request = event.request
            yield from self._send_translated_head(event)
            return
        if isinstance(event, RequestData):
            if not event.data:
                return
            if self._chunked_body:
                yield commands.SendData(self.conn, b"%x\r\n%s\r\n" % (len(event.data), event.data))
                return
        elif isinstance(event, RequestTrailers):
            self._pending_trailers = event.trailers
            return
        elif isinstance(event, RequestEndOfMessage) and (self._chunked_body or _is_chunked(self.request)):
            trailers, self._pending_trailers = self._pending_trailers, None
            self._chunked_body = False
            yield commands.SendData(self.conn, last_chunk(trailers))
            yield from self.mark_done(request=True)
            return
        yield from super().send(event)

    def _send_translated_head(self, event: RequestHeaders) -> layer.CommandGenerator[None]:
        """mitmproxy's HTTP/2 to HTTP/1 request conversion, plus chunked framing when the body's
        length is not declared."""
        request = event.request.copy()
        request.http_version = "HTTP/1.1"
        if "Host" not in request.headers and request.authority:
            request.headers.insert(0, "Host", request.authority)
        request.authority = ""
        cookies = request.headers.get_all("Cookie")
        if len(cookies) > 1:
            request.headers["Cookie"] = "; ".join(cookies)
        self._chunked_body = not event.end_stream and "content-length" not in request.headers
        if self._chunked_body:
            request.headers["transfer-encoding"] = "chunked"
        yield commands.SendData(self.conn, http1.assemble_request_head(request))

    def _note_sent(self, event) -> None:
        if isinstance(event, RequestHeaders):
            self._exchange = UpstreamExchange()
            self._exchange.request_head(request_framing(event.request.headers.items(multi=True), event.end_stream))
        elif self._exchange is not None:
            if isinstance(event, RequestData):
                self._exchange.request_data(len(event.data))
            elif isinstance(event, RequestEndOfMessage):
                self._exchange.request_end()

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        """What mitmproxy keeps unparsed is bounded: a response head still incomplete, or bytes an
        upstream sends while no response is being read ("FIXME: protect against header size DoS"
        in mitmproxy). Past MAX_RESPONSE_HEAD_BYTES the upstream connection is closed and the
        stream fails, 502 response_too_large."""
        if isinstance(event, events.Wakeup):
            if event.command is self._parse_wakeup:
                self._parse_wakeup = None
                if self.state == self.read_body:  # the body's parse goes on where its slice cut it
                    yield from self.read_body(events.DataReceived(self.conn, b""))
                else:
                    read_ahead.settle_bytes(self.context.client, self, 0)
                    yield from self._close_when_parsed()
            return
        if isinstance(event, events.ConnectionClosed) and event.connection is self.conn:
            read_ahead.settle_bytes(self.context.client, self, 0)  # nothing more is read from it
        if (isinstance(event, events.DataReceived) and self.state in (self.read_headers, self.wait)
                and len(self.buf) + len(event.data) > MAX_RESPONSE_HEAD_BYTES):
            self.buf = ReceiveBuffer()
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            if self.stream_id is not None and not self.response_done:
                yield ReceiveHttp(ResponseProtocolError(
                    self.stream_id, f"the upstream sent more than {MAX_RESPONSE_HEAD_BYTES} bytes of response head",
                    ErrorCode.RESPONSE_TOO_LARGE))
            return
        yield from super()._handle_event(event)

    def read_headers(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived) and self.request is not None and self._exchange is not None:
            while (status := _interim_status(self.buf)) is not None:
                if self.buf.maybe_extract_lines() is None:
                    return  # the rest of the interim head is still on its way
                self._head_lines.reset()
                self._exchange.response_head(status)
                if self._exchange.too_many_interim:
                    yield commands.CloseConnection(self.conn)
                    yield ReceiveHttp(ResponseProtocolError(
                        self.stream_id, f"the server sent more than {MAX_INTERIM_RESPONSES} interim (1xx) responses",
                        ErrorCode.GENERIC_SERVER_ERROR))
                    self.state = self.done
                    return
        limit = max_header_fields(self.context)
        if isinstance(event, events.DataReceived) and limit and self._head_lines.count(self.buf) - 1 > limit:
            yield from self._too_many_fields(f"the upstream's response head has more than {limit} header fields "
                                             f"(egress_max_header_fields)")
            return
        for command in super().read_headers(event):
            if isinstance(command, ReceiveHttp) and isinstance(command.event, ResponseHeaders):
                self._head_lines.reset()
                if self._exchange is not None:
                    self._exchange.response_head(command.event.response.status_code)
            yield command

    def _too_many_fields(self, message: str) -> layer.CommandGenerator[None]:
        """Every field costs every later header lookup in the hooks: an upstream's response head
        (or trailer section) of too many ends its connection, 502 response_too_large."""
        self.buf = ReceiveBuffer()
        yield commands.CloseConnection(self.conn)
        self.state = self.done
        if self.stream_id is not None:
            yield ReceiveHttp(ResponseProtocolError(self.stream_id, message, ErrorCode.RESPONSE_TOO_LARGE))

    def mark_done(self, *, request: bool = False, response: bool = False) -> layer.CommandGenerator[None]:
        self.request_done = self.request_done or request
        self.response_done = self.response_done or response
        exchange = self._exchange
        if (self.request_done and self.response_done and exchange is not None and self.request is not None
                and self.response is not None and not should_make_pipe(self.request, self.response)
                and exchange.single_use_reason() is not None):
            self._exchange = None
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            return
        if self.request_done and self.response_done:
            self._exchange = None
        elif self.response_done and exchange is not None and exchange.early_response:
            # The answer came before the request body was sent: the connection ends once the body
            # is through, and whatever the origin sends meanwhile answers no request (mitmproxy's
            # finished reader would report the end of the response again and crash the stream).
            self.state = self._discard_until_request_done
        yield from super().mark_done()

    def _discard_until_request_done(self, event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            self.buf.maybe_extract_at_most(len(self.buf))
        yield from ()

    _parse_wakeup: commands.RequestWakeup | None = None  # a body's parse cut at its slice goes on then
    # The upstream's close while a parse was left: held until it is parsed (False: delivered)
    _close_pending: events.ConnectionClosed | bool | None = None

    def read_body(self, event) -> layer.CommandGenerator[None]:
        if not isinstance(self.body_reader, TrailerCatcher):
            merged = ChunkMerger(self.body_reader, None, max_header_fields(self.context), malformed=False,
                                 slice_seconds=UPSTREAM_PARSE_SLICE)
            self.body_reader = TrailerCatcher(merged)
        catcher = self.body_reader
        merger = catcher.reader
        merger.slice_seconds = fair_share.parse_slice(UPSTREAM_PARSE_SLICE)
        if isinstance(event, events.ConnectionClosed) and self.buf and self._close_pending is None:
            # What the upstream sent before it closed is read first, in slices like the rest
            # (mitmproxy goes to the end of the body at the close, and would not read what a cut
            # parse left behind; parsed whole, up to 320 KiB of 1-byte chunks was one ~0.3 s step:
            # review 33); the close follows once nothing is cut.
            self._close_pending = event
            event = events.DataReceived(self.conn, b"")
        try:
            for command in self._relayed(super().read_body(event), catcher):
                yield command
        except TooManyFields as too_many:
            yield from self._too_many_fields(f"the upstream's {too_many} (egress_max_header_fields)")
            return
        if merger.cut and self.state == self.read_body:
            merger.cut = False
            if self._parse_wakeup is None:
                self._parse_wakeup = commands.RequestWakeup(0)
                yield self._parse_wakeup
        yield from self._bound_unparsed()
        yield from self._close_when_parsed()

    def _close_when_parsed(self) -> layer.CommandGenerator[None]:
        """The upstream's close, held while what it sent before is parsed, goes on once no parse
        is cut: to whatever state the connection is in by then."""
        if isinstance(self._close_pending, events.ConnectionClosed) and self._parse_wakeup is None:
            close, self._close_pending = self._close_pending, False
            yield from self.state(close)

    def _relayed(self, commands_, catcher):
        """The body's commands, with the trailers a chunked body ended with before its end."""
        for command in commands_:
            if (isinstance(command, ReceiveHttp) and isinstance(command.event, ResponseEndOfMessage)
                    and catcher.trailers is not None):
                trailers, catcher.trailers = catcher.trailers, None
                yield ReceiveHttp(ResponseTrailers(command.event.stream_id, trailers))
            yield command

    def _bound_unparsed(self) -> layer.CommandGenerator[None]:
        """What is left unparsed is bounded. A parse cut at its slice leaves whole chunks behind:
        past READ_AHEAD_BYTES the connection's readers wait until the wakeups have worked it down
        to half (addons/read_ahead.py: TCP back-pressure on the upstream). Otherwise what h11 left
        unread is an unfinished chunk-size line (its extensions) or trailer section: h11 bounds
        neither, and an upstream could grow it without end."""
        if self.state != self.read_body:
            read_ahead.settle_bytes(self.context.client, self, 0)
            return
        if self._parse_wakeup is not None:
            read_ahead.settle_bytes(self.context.client, self, len(self.buf))
            return
        read_ahead.settle_bytes(self.context.client, self, 0)
        if len(self.buf) > MAX_RESPONSE_HEAD_BYTES:
            self.buf = ReceiveBuffer()
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            if self.stream_id is not None and not self.response_done:
                yield ReceiveHttp(ResponseProtocolError(
                    self.stream_id, f"the upstream sent a chunk-size line or trailer section of more than "
                                    f"{MAX_RESPONSE_HEAD_BYTES} bytes", ErrorCode.RESPONSE_TOO_LARGE))


def install() -> None:
    """Make mitmproxy build the gateway's HTTP/1 client for every upstream connection."""
    from mitmproxy.proxy.layers import http as http_layers

    if http_layers.Http1Client is not GatewayHttp1Client:
        http_layers.Http1Client = GatewayHttp1Client
