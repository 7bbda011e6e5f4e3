"""Streaming decoders for response Content-Encodings, so compressed bodies of credential-bound
requests can be redacted chunk by chunk instead of being buffered whole (or passed unredacted).

Unknown or stacked encodings return None: the caller refuses the response rather than guess.

Every decoder is bounded (`BoundedDecoder`): a few hundred bytes of brotli can decode to gigabytes,
so the output is produced in pieces no larger than what is left of the budget, and decoding stops
with DecodedTooLarge before anything past it is allocated: past `limit` bytes in all, or past
MAX_RATIO times the input once more than RATIO_GRACE bytes came out.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable


MAX_RATIO = 200  # real text compresses 3-20x, repetitive logs and JSON up to ~100x
RATIO_GRACE = 16 * 1024 * 1024  # below this much output any ratio is fine
DEFAULT_BUFFERED_LIMIT = 64 * 1024 * 1024  # a body decoded whole, in memory


class DecodedTooLarge(ValueError):
    pass


class OverBudget(ValueError):
    """Keeping the next decoded piece would pass the caller's memory budget (gateway/budget.py)."""


# A zstd frame names the window its decoder must keep (up to 2 GiB; 128 MiB at window_log 27 cost
# ~135 MiB per stream, charged to no budget). RFC 9659 limits the `zstd` content coding to 8 MiB:
# a frame that needs more is refused as too large.
ZSTD_WINDOW_LOG_MAX = 23

PIECE = 256 * 1024  # what a decode asks for per step, each piece charged before it is kept (brotli hands out
# up to twice this, and fills its whole window, up to 16 MiB, on the step that needs it: addons/decode_pool.py)
INPUT_STEP = 4096  # compressed bytes given to a decoder at a time (see BoundedDecoder.pieces)


class _Concatenated:
    """A coding whose body may be several streams back to back: gzip members (RFC 1952; Node and
    gzip(1) decode them all), zlib or raw deflate streams, zstd frames. Each stream is decoded to
    its end, then the next one from the bytes after it. Bytes after a complete stream that do not
    start a new one are dropped and flagged (`trailing`); `finished()` says whether the last
    stream ended (False for a body cut short)."""

    on_window: Callable[[int], bool] | None = None  # asked before a stream's decoder is made (see BoundedDecoder.guard_window)

    def __init__(self):
        self._d = None
        self._input = b""  # bytes not yet given to a stream decoder
        self._streams = 0
        self._out = 0  # output of the current stream
        self.trailing = False

    # one stream's decoder: made from its first bytes, fed (output, input it left to us), at its end
    def _new(self, data: bytes):
        raise NotImplementedError

    def _feed(self, d, data: bytes, max_length: int) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def _more(self, d) -> bool:  # the decoder holds input it has not turned into output yet
        return False

    def decompress(self, data: bytes, max_length: int) -> bytes:
        self._input += data
        out = []
        while not self.trailing and max_length > 0:
            if self._d is not None and self._d.eof:
                if not self._input:
                    break
                self._d = None
            if self._d is None:
                if not self._input:
                    break
                self._d, self._out = self._new(self._input), 0
                self._streams += 1
            elif not self._input and not self._more(self._d):
                break
            chunk, self._input = self._input, b""
            try:
                piece, self._input = self._feed(self._d, chunk, max_length)
            except DecodedTooLarge:
                raise
            except Exception:
                if self._streams > 1 and self._out == 0:  # not a stream at all: data after the last one
                    self.trailing, self._input = True, b""
                    break
                raise
            self._out += len(piece)
            out.append(piece)
            max_length -= len(piece)
            if not piece and not self._d.eof and self._input == chunk:
                break  # no progress: wait for more input
        return b"".join(out)

    def has_more(self) -> bool:
        if self.trailing:
            return False
        return bool(self._input) or (self._d is not None and not self._d.eof and self._more(self._d))

    def finished(self) -> bool:
        if self._d is None:
            return not self._input
        return self._d.eof and not self._input

    def flush(self) -> bytes:
        return b""


class _Zlib(_Concatenated):
    def __init__(self, wbits: int):
        super().__init__()
        self._wbits = wbits

    def _new(self, data: bytes):
        wbits = self._wbits
        # "deflate" is meant to be zlib-wrapped, but servers send raw deflate too.
        if wbits == zlib.MAX_WBITS and ((data[0] & 0x0F) != 8 or (len(data) > 1 and ((data[0] << 8) | data[1]) % 31)):
            wbits = -zlib.MAX_WBITS
        return zlib.decompressobj(wbits)

    def _feed(self, d, data: bytes, max_length: int) -> tuple[bytes, bytes]:
        out = d.decompress(data, max_length)
        return out, (d.unused_data if d.eof else d.unconsumed_tail)

    def flush(self) -> bytes:
        return self._d.flush() if self._d is not None and not self._d.eof else b""


class _Brotli:
    """One brotli stream (the format has no concatenation); bytes after its end are `trailing`."""

    def __init__(self):
        import brotli

        self._d = brotli.Decompressor()
        self._more = False
        self._seen = False
        self.trailing = False

    def decompress(self, data: bytes, max_length: int) -> bytes:
        self._seen |= bool(data)
        if self._d.is_finished():
            self.trailing |= bool(data)
            return b""
        if not data and not self._more:
            return b""
        limit = max(max_length, 1)
        out = self._d.process(data, output_buffer_limit=limit)
        # brotli 1.2 says it can accept more data while output it decoded is still waiting: a
        # call that filled its limit may have more (a body whose last input decoded past one piece
        # lost its end: truncated, and a request body's scan refused as "ends early").
        self._more = len(out) >= limit or not self._d.can_accept_more_data()
        return out

    def has_more(self) -> bool:
        return self._more and not self._d.is_finished()

    def finished(self) -> bool:
        return self._d.is_finished() or not self._seen

    def flush(self) -> bytes:
        return b""


class _Zstd(_Concatenated):
    def __init__(self):
        super().__init__()
        try:
            from backports import zstd
        except ImportError:  # Python 3.14+
            from compression import zstd  # type: ignore[no-redef]
        self._zstd = zstd

    def _new(self, data: bytes):
        # Each frame has a decoder, and a window, of its own: what the caller charged for the first
        # frame's may not be this one's (a 2-byte frame, then one with 8 MiB; a fresh-eyes review).
        if self.on_window is not None and not self.on_window(_zstd_window(data)):
            raise OverBudget(f"a zstd frame's window ({_zstd_window(data)} bytes) is over the buffer budget")
        return self._zstd.ZstdDecompressor(options={self._zstd.DecompressionParameter.window_log_max: ZSTD_WINDOW_LOG_MAX})

    def _feed(self, d, data: bytes, max_length: int) -> tuple[bytes, bytes]:
        try:
            out = d.decompress(data, max_length)  # it keeps input it has not decoded yet itself
        except self._zstd.ZstdError as exc:
            if "memory" in str(exc):  # "Frame requires too much memory for decoding"
                raise DecodedTooLarge(f"a zstd frame needs a window over {1 << ZSTD_WINDOW_LOG_MAX} bytes") from None
            raise
        return out, (d.unused_data if d.eof else b"")

    def _more(self, d) -> bool:
        return not d.needs_input


DECODERS: dict[str, Callable[[], object]] = {
    "gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "x-gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "deflate": lambda: _Zlib(zlib.MAX_WBITS),
    "br": _Brotli,
    "zstd": _Zstd,
}


ZLIB_STATE = 64 * 1024  # a zlib stream's window (32 KiB) and its state
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def window_size(content_encoding: str, data: bytes) -> int:
    """The memory a decoder of this coding keeps for its whole stream, read from the stream's
    first bytes (the sender chooses it: up to 16 MiB for brotli, 8 MiB for zstd here), for a caller
    to charge to a budget before it decodes. The largest allowed when the header is not there."""
    encoding = content_encoding.strip().lower()
    if encoding == "br":
        return _brotli_window(data)
    if encoding == "zstd":
        return _zstd_window(data)
    return ZLIB_STATE


def _brotli_window(data: bytes) -> int:
    """RFC 7932 9.1: WBITS from the stream header's first bits; the window is 2**WBITS - 16."""
    if not data:
        return (1 << 24) - 16
    first = data[0]
    if not first & 1:
        bits = 16
    elif (n := (first >> 1) & 7):
        bits = 17 + n
    elif (m := (first >> 4) & 7) == 1:  # large-window brotli: not a content coding; the decoder refuses it
        bits = 24
    else:
        bits = 8 + m if m else 17
    return (1 << bits) - 16


def _zstd_window(data: bytes) -> int:
    """RFC 8878 3.1.1.1: the frame header's window (Window_Descriptor, or the content size of a
    single-segment frame), at most the largest the decoder accepts (ZSTD_WINDOW_LOG_MAX)."""
    most = 1 << ZSTD_WINDOW_LOG_MAX
    if len(data) < 6 or data[:4] != _ZSTD_MAGIC:
        return most
    header = data[4]
    if not header & 0x20:  # a Window_Descriptor follows
        exponent, mantissa = data[5] >> 3, data[5] & 7
        base = 1 << (10 + exponent)
        return min(base + (base >> 3) * mantissa, most)
    dictionary = (0, 1, 2, 4)[header & 3]
    size_bytes = (1, 2, 4, 8)[header >> 6]
    field = data[5 + dictionary:5 + dictionary + size_bytes]
    if len(field) < size_bytes:
        return most
    size = int.from_bytes(field, "little") + (256 if size_bytes == 2 else 0)
    return min(max(size, 1), most)


class _Closed:
    """What a closed BoundedDecoder decodes with: nothing more."""

    trailing = False

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        raise ValueError("the decoder was closed")

    def has_more(self) -> bool:
        return False

    def finished(self) -> bool:
        return False

    def flush(self) -> bytes:
        return b""


class BoundedDecoder:
    """decompress(chunk) and flush() that never produce more than the budget (see the module)."""

    def __init__(self, inner, limit: int | None, ratio: int = MAX_RATIO, grace: int = RATIO_GRACE):
        self.inner = inner
        self.coding = ""  # its Content-Encoding (streaming_decoder), for window_size
        self.limit = limit
        self.ratio = ratio
        self.grace = grace
        self.read = 0
        self.produced = 0

    def _room(self) -> int:
        room = self.limit - self.produced if self.limit is not None else 1 << 62
        if self.produced + room > self.grace:
            room = min(room, max(self.grace, self.read * self.ratio) - self.produced)
        return max(room, 0)

    def _take(self, piece: bytes, room: int) -> bytes:
        if len(piece) > room:
            raise DecodedTooLarge(
                f"decoded body over its budget ({self.produced + len(piece)} bytes from {self.read})")
        self.produced += len(piece)
        return piece

    def decompress(self, data: bytes) -> bytes:
        return b"".join(self.pieces(data, 1 << 62))

    def pieces(self, data: bytes, size: int = 0):
        """The output for `data`, in pieces of at most about `size` bytes (PIECE by default), each
        decoded only when the previous one was taken: a caller can stop between them (a budget,
        a turn of the event loop) with nothing more allocated."""
        size = size or PIECE
        # The input goes in by steps, each counted before it is decoded: the ratio then bounds
        # what the bytes read so far produced, not what a whole chunk (64 KiB x ratio) may.
        for start in range(0, len(data), INPUT_STEP) or [0]:
            segment = data[start:start + INPUT_STEP]
            self.read += len(segment)
            room = self._room()
            yield self._take(self.inner.decompress(segment, min(room, size) + 1), room)
            while self.inner.has_more():
                room = self._room()
                yield self._take(self.inner.decompress(b"", min(room, size) + 1), room)

    def flush(self) -> bytes:
        return self._take(self.inner.flush(), self._room())

    def finished(self) -> bool:
        """Did the (last) compressed stream end? False for a body cut short."""
        return self.inner.finished()

    def close(self) -> None:
        """Drop the inner decoder and its window (up to 16 MiB) now, whoever still holds this."""
        self.inner = _Closed()

    def guard_window(self, charged: int, grow: Callable[[int], bool]) -> None:
        """`charged` bytes were charged for the window from the stream's first bytes; a later
        stream of the body (a zstd frame) that needs more asks `grow(more)` first, and without it
        the decode stops with OverBudget."""
        if not hasattr(self.inner, "on_window"):
            return
        state = [charged]

        def needed(window: int) -> bool:
            if window <= state[0]:
                return True
            if not grow(window - state[0]):
                return False
            state[0] = window
            return True

        self.inner.on_window = needed

    @property
    def trailing(self) -> bool:
        """Were there bytes after the end of the compressed data that start no new stream?"""
        return self.inner.trailing


def streaming_decoder(content_encoding: str, limit: int | None = None, ratio: int = MAX_RATIO,
                      grace: int = RATIO_GRACE) -> BoundedDecoder | None:
    """A bounded decoder with decompress(chunk) and flush(), or None if the encoding is not supported."""
    encoding = content_encoding.strip().lower()
    factory = DECODERS.get(encoding)
    if factory is None:
        return None
    decoder = BoundedDecoder(factory(), limit, ratio, grace)
    decoder.coding = encoding
    return decoder


# A request body is decoded only to be scanned for method overrides (gateway/methods/), and every
# decoded byte costs scanning time on the event loop: a tighter budget than a response's. A
# compressed upload is rare, and one that inflates more than 100x past its first MiB rarer still;
# over it the body is refused, 413 request_too_large (it cannot be checked).
# Past REQUEST_LIMIT decoded bytes in all it is refused too: at 54:1 (within the ratio) a 7.7 MB
# upload decoded to 400 MiB and took seconds of scanning per request.
REQUEST_RATIO = 100
REQUEST_GRACE = 1024 * 1024
REQUEST_LIMIT = 8 * 1024 * 1024


# A streamed body's decoded bytes go out (TLS, the socket) as they come, within the same turn of the
# event loop as their input: a grace of 16 MiB would let 153 bytes of brotli send 16 MiB before the
# ratio trips. Past its first MiB, a streamed body keeps to MAX_RATIO.
STREAM_GRACE = 1024 * 1024


def stream_decoder(content_encoding: str, limit: int | None = None) -> BoundedDecoder | None:
    """The bounded decoder of a response body decoded on the fly (addons/body_redaction.py)."""
    return streaming_decoder(content_encoding, limit, MAX_RATIO, STREAM_GRACE)


def request_decoder(content_encoding: str, limit: int | None = REQUEST_LIMIT) -> BoundedDecoder | None:
    """The bounded decoder of a request body's coding, for the method-override scanner: at most
    `limit` decoded bytes in all (None: only the ratio)."""
    return streaming_decoder(content_encoding, limit, REQUEST_RATIO, REQUEST_GRACE)


def decode_pieces(content_encoding: str, data: bytes, limit: int = DEFAULT_BUFFERED_LIMIT,
                  window: tuple[int, Callable[[int], bool]] | None = None):
    """A buffered body's decoded bytes in pieces of at most about PIECE bytes, each decoded only when
    the previous one was taken (a caller charges each to its budget, or lets other clients run in
    between); ValueError (DecodedTooLarge) if it does not fit within `limit` or does not decode.
    `window`: what was charged for the decoder's window, and how to charge more (guard_window)."""
    decoder = streaming_decoder(content_encoding, limit)
    if decoder is None:
        raise ValueError(f"unsupported Content-Encoding {content_encoding[:40]!r}")
    if window is not None:
        decoder.guard_window(*window)
    try:
        yield from decoder.pieces(data)
        yield decoder.flush()
        if not decoder.finished():
            raise ValueError("the compressed body ends early")  # (a cut body is not served as if whole)
    except (DecodedTooLarge, OverBudget):
        raise
    except Exception as exc:
        raise ValueError(f"cannot decode: {type(exc).__name__}") from None


def decode_whole(content_encoding: str, data: bytes, limit: int = DEFAULT_BUFFERED_LIMIT,
                 reserve: Callable[[int], bool] | None = None) -> bytes:
    """A buffered body, decoded within `limit`; ValueError (DecodedTooLarge) if it does not fit or
    does not decode. `reserve(n)` is asked before each piece (decode_pieces) is kept, and a False
    stops the decode (OverBudget) with nothing more allocated."""
    out = bytearray()
    for piece in decode_pieces(content_encoding, data, limit):
        if reserve is not None and not reserve(len(piece)):
            raise OverBudget(f"decoded body over the buffer budget after {len(out)} bytes")
        out += piece
    return bytes(out)
