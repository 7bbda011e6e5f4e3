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


class _Zlib:
    def __init__(self, wbits: int):
        self._wbits = wbits
        self._d = zlib.decompressobj(wbits)
        self._started = False
        self._tail = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if not self._started and self._wbits == zlib.MAX_WBITS and data:
            self._started = True
            # "deflate" is meant to be zlib-wrapped, but servers send raw deflate too.
            if (data[0] & 0x0F) != 8 or (len(data) > 1 and ((data[0] << 8) | data[1]) % 31):
                self._d = zlib.decompressobj(-zlib.MAX_WBITS)
        out = self._d.decompress(self._tail + data, max_length)
        self._tail = self._d.unconsumed_tail
        return out

    def has_more(self) -> bool:
        return bool(self._tail)

    def flush(self) -> bytes:
        return self._d.flush()


class _Brotli:
    def __init__(self):
        import brotli

        self._d = brotli.Decompressor()
        self._more = False

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if not data and not self._more:
            return b""
        out = self._d.process(data, output_buffer_limit=max(max_length, 1))
        self._more = not self._d.can_accept_more_data()
        return out

    def has_more(self) -> bool:
        return self._more

    def flush(self) -> bytes:
        return b""


class _Zstd:
    def __init__(self):
        try:
            from backports import zstd
        except ImportError:  # Python 3.14+
            from compression import zstd  # type: ignore[no-redef]
        self._d = zstd.ZstdDecompressor()

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._d.eof or (not data and self._d.needs_input):
            return b""
        return self._d.decompress(data, max_length)

    def has_more(self) -> bool:
        return not self._d.eof and not self._d.needs_input

    def flush(self) -> bytes:
        return b""


DECODERS: dict[str, Callable[[], object]] = {
    "gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "x-gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "deflate": lambda: _Zlib(zlib.MAX_WBITS),
    "br": _Brotli,
    "zstd": _Zstd,
}


class BoundedDecoder:
    """decompress(chunk) and flush() that never produce more than the budget (see the module)."""

    def __init__(self, inner, limit: int | None):
        self.inner = inner
        self.limit = limit
        self.read = 0
        self.produced = 0

    def _room(self) -> int:
        room = self.limit - self.produced if self.limit is not None else 1 << 62
        if self.produced + room > RATIO_GRACE:
            room = min(room, max(RATIO_GRACE, self.read * MAX_RATIO) - self.produced)
        return max(room, 0)

    def _take(self, piece: bytes, room: int) -> bytes:
        if len(piece) > room:
            raise DecodedTooLarge(
                f"decoded body over its budget ({self.produced + len(piece)} bytes from {self.read})")
        self.produced += len(piece)
        return piece

    def decompress(self, data: bytes) -> bytes:
        self.read += len(data)
        pieces = []
        room = self._room()
        pieces.append(self._take(self.inner.decompress(data, room + 1), room))
        while self.inner.has_more():
            room = self._room()
            pieces.append(self._take(self.inner.decompress(b"", room + 1), room))
        return b"".join(pieces)

    def flush(self) -> bytes:
        return self._take(self.inner.flush(), self._room())


def streaming_decoder(content_encoding: str, limit: int | None = None) -> BoundedDecoder | None:
    """A bounded decoder with decompress(chunk) and flush(), or None if the encoding is not supported."""
    encoding = content_encoding.strip().lower()
    factory = DECODERS.get(encoding)
    return BoundedDecoder(factory(), limit) if factory is not None else None


def decode_whole(content_encoding: str, data: bytes, limit: int = DEFAULT_BUFFERED_LIMIT) -> bytes:
    """A buffered body, decoded within `limit`; ValueError (DecodedTooLarge) if it does not fit or
    does not decode."""
    decoder = streaming_decoder(content_encoding, limit)
    if decoder is None:
        raise ValueError(f"unsupported Content-Encoding {content_encoding[:40]!r}")
    try:
        return decoder.decompress(data) + decoder.flush()
    except DecodedTooLarge:
        raise
    except Exception as exc:
        raise ValueError(f"cannot decode: {type(exc).__name__}") from None
