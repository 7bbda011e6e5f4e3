"""Streaming decoders for response Content-Encodings, so compressed bodies of credential-bound
requests can be redacted chunk by chunk instead of being buffered whole (or passed unredacted).

Unknown or stacked encodings return None: the caller refuses the response rather than guess.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable


class _Zlib:
    def __init__(self, wbits: int):
        self._wbits = wbits
        self._d = zlib.decompressobj(wbits)
        self._started = False

    def decompress(self, data: bytes) -> bytes:
        if not self._started and self._wbits == zlib.MAX_WBITS and data:
            self._started = True
            # "deflate" is meant to be zlib-wrapped, but servers send raw deflate too.
            if (data[0] & 0x0F) != 8 or (len(data) > 1 and ((data[0] << 8) | data[1]) % 31):
                self._d = zlib.decompressobj(-zlib.MAX_WBITS)
        return self._d.decompress(data)

    def flush(self) -> bytes:
        return self._d.flush()


class _Brotli:
    def __init__(self):
        import brotli

        self._d = brotli.Decompressor()

    def decompress(self, data: bytes) -> bytes:
        return self._d.process(data) if data else b""

    def flush(self) -> bytes:
        return b""


class _Zstd:
    def __init__(self):
        try:
            from backports import zstd
        except ImportError:  # Python 3.14+
            from compression import zstd  # type: ignore[no-redef]
        self._d = zstd.ZstdDecompressor()

    def decompress(self, data: bytes) -> bytes:
        return self._d.decompress(data) if data else b""

    def flush(self) -> bytes:
        return b""


DECODERS: dict[str, Callable[[], object]] = {
    "gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "x-gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "deflate": lambda: _Zlib(zlib.MAX_WBITS),
    "br": _Brotli,
    "zstd": _Zstd,
}


def streaming_decoder(content_encoding: str):
    """A decoder with decompress(chunk) and flush(), or None if the encoding is not supported."""
    encoding = content_encoding.strip().lower()
    factory = DECODERS.get(encoding)
    return factory() if factory is not None else None
