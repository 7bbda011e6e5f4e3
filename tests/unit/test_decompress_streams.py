"""gateway/decompress.py: every stream of a concatenated body is decoded (gzip members, zlib and
raw deflate streams, zstd frames), bytes after the end that start no stream are flagged, and a
body cut short is not `finished()` -- in any chunking."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.decompress import streaming_decoder

try:
    from backports import zstd
except ImportError:  # Python 3.14+
    from compression import zstd  # type: ignore[no-redef]


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


COMPRESS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "raw-deflate": _raw_deflate,
    "zstd": zstd.compress,
}


def run(coding: str, body: bytes, cuts=()):
    decoder = streaming_decoder("deflate" if coding == "raw-deflate" else coding, 1 << 24)
    out, start = [], 0
    for cut in sorted(set(cuts)) + [len(body)]:
        out.append(decoder.decompress(body[start:cut]))
        start = cut
    out.append(decoder.flush())
    return b"".join(out), decoder.finished(), decoder.trailing


@settings(max_examples=200)
@given(st.sampled_from(sorted(COMPRESS)), st.lists(st.binary(max_size=60), min_size=1, max_size=4),
       st.lists(st.integers(0, 400), max_size=6))
def test_every_stream_is_decoded_in_any_chunking(coding, parts, cuts):
    body = b"".join(COMPRESS[coding](p) for p in parts)
    assert run(coding, body, [c for c in cuts if c <= len(body)]) == (b"".join(parts), True, False)


@pytest.mark.parametrize("coding", sorted(COMPRESS) + ["br"])
def test_trailing_bytes_and_truncation_are_flagged(coding):
    compress = COMPRESS.get(coding, brotli.compress)
    body = compress(b"a=b&_method=DELETE")
    if coding == "br":  # the binding reports no unused input: data after the end fails the decoder
        with pytest.raises(brotli.error):
            run(coding, body + b"\x00garbage!")
        assert run(coding, body + b"\x00garbage!", [len(body)])[2]  # in a later chunk: flagged
    else:
        out, finished, trailing = run(coding, body + b"\x00garbage!")
        assert out == b"a=b&_method=DELETE" and trailing
    out, finished, trailing = run(coding, body[:-3])
    assert not finished and not trailing


def test_node_style_two_gzip_members():
    body = gzip.compress(b"a=b&") + gzip.compress(b"_method=DELETE")
    assert run("gzip", body, range(0, len(body), 3)) == (b"a=b&_method=DELETE", True, False)


def test_an_empty_body_is_finished():
    for coding in ("gzip", "deflate", "br", "zstd"):
        decoder = streaming_decoder(coding, 100)
        assert decoder.flush() == b"" and decoder.finished() and not decoder.trailing


# -- the zstd window (RFC 9659: at most 8 MiB for the zstd content coding) ---------------------------


def _zstd_with_window(window_log: int, size: int = 1 << 20) -> bytes:
    c = zstd.ZstdCompressor(options={zstd.CompressionParameter.window_log: window_log})
    return c.compress(bytes(size)) + c.flush()


@pytest.mark.parametrize("make", [
    lambda: streaming_decoder("zstd", 1 << 26),
    lambda: __import__("gateway.decompress", fromlist=["x"]).stream_decoder("zstd", 1 << 26),
    lambda: __import__("gateway.decompress", fromlist=["x"]).request_decoder("zstd"),
])
def test_a_zstd_frame_needing_a_window_over_8_mib_is_too_large(make):
    """A frame that declares a 128 MiB window made the decoder allocate ~135 MiB per stream; it is
    refused as too large before that (and a second frame is no way around it)."""
    from gateway.decompress import DecodedTooLarge

    for body in (_zstd_with_window(27), zstd.compress(b"ok") + _zstd_with_window(24)):
        decoder = make()
        with pytest.raises(DecodedTooLarge):
            for start in range(0, len(body), 1000):
                list(decoder.pieces(body[start:start + 1000]))


def test_a_zstd_frame_within_the_window_still_decodes():
    from gateway.decompress import decode_whole

    assert decode_whole("zstd", _zstd_with_window(23, 3 << 20)) == bytes(3 << 20)


def test_decode_whole_reports_a_big_zstd_window_as_too_large():
    from gateway.decompress import DecodedTooLarge, decode_whole

    with pytest.raises(DecodedTooLarge):
        decode_whole("zstd", _zstd_with_window(26))


@pytest.mark.parametrize("lgwin", [10, 16, 17, 18, 20, 22, 24])
def test_a_brotli_window_is_read_from_the_stream_header(lgwin):
    """The sender chooses the window the decoder keeps for the whole stream (up to 16 MiB): read
    from the header's first bits (RFC 7932 9.1), it is charged to the buffer budget first."""
    import brotli

    from gateway.decompress import window_size

    assert window_size("br", brotli.compress(b"x" * 100_000, lgwin=lgwin)) == (1 << lgwin) - 16


def test_a_zstd_window_is_read_from_the_frame_header_and_capped():
    from gateway.decompress import ZSTD_WINDOW_LOG_MAX, window_size

    assert window_size("zstd", _zstd_with_window(20, 3 << 20)) == 1 << 20
    assert window_size("zstd", _zstd_with_window(26)) == 1 << ZSTD_WINDOW_LOG_MAX  # refused anyway: at most the cap
    try:
        from backports import zstd
    except ImportError:  # Python 3.14+
        from compression import zstd  # type: ignore[no-redef]
    assert window_size("zstd", zstd.compress(b"z" * 1000)) == 1000  # a single-segment frame: its content size


def test_an_unknown_or_missing_header_is_charged_the_most():
    from gateway.decompress import ZLIB_STATE, ZSTD_WINDOW_LOG_MAX, window_size

    assert window_size("br", b"") == (1 << 24) - 16
    assert window_size("zstd", b"\x00" * 8) == 1 << ZSTD_WINDOW_LOG_MAX
    assert window_size("gzip", b"") == ZLIB_STATE


def _two_frames() -> bytes:
    """A 2-byte single-segment zstd frame (a 2-byte window), then one with an 8 MiB window."""
    return zstd.compress(b"hi") + _zstd_with_window(23, 3 << 20)


def test_a_later_zstd_frame_s_bigger_window_is_charged_before_its_decoder_exists():
    """A fresh-eyes review: the window was charged from the first frame only, and the second
    frame's decoder then kept 8 MiB uncharged (28 held streams: 465 MiB of RSS)."""
    from gateway.decompress import OverBudget, decode_pieces, window_size

    data = _two_frames()
    charged = window_size("zstd", data)
    assert charged == 2
    asked = []
    with pytest.raises(OverBudget):
        list(decode_pieces("zstd", data, 64 << 20, (charged, lambda more: asked.append(more) or False)))
    assert asked == [(1 << 23) - 2]
    asked.clear()
    body = b"".join(decode_pieces("zstd", data, 64 << 20, (charged, lambda more: asked.append(more) or True)))
    assert body == b"hi" + bytes(3 << 20) and asked == [(1 << 23) - 2]  # asked once: the next frames fit


def test_a_request_body_s_later_zstd_frame_over_the_budget_is_refused():
    from gateway.decompress import request_decoder
    from gateway.methods import BodyScanner

    scanner = BodyScanner.for_headers([("Content-Type", "application/x-www-form-urlencoded"),
                                       ("Content-Encoding", "zstd")], request_decoder)
    scanner.decoders[0].guard_window(2, lambda more: False)
    from gateway.decompress import OverBudget

    with pytest.raises(OverBudget):
        scanner.feed(_two_frames())


@pytest.mark.parametrize("size", [300 << 10, 5 << 20])
def test_a_brotli_body_whose_last_input_decodes_past_a_piece_decodes_whole(size):
    """brotli 1.2 reports it can take more input while decoded output still waits: the end of a
    body whose last input step decoded past one piece was lost (5 MiB of repetitive text decoded
    whole came out as 491,456 bytes, served as if complete)."""
    import brotli

    from gateway.decompress import decode_pieces, streaming_decoder
    from gateway.methods import SCAN_PIECE

    body = b"x" * size
    assert b"".join(decode_pieces("br", brotli.compress(body))) == body
    decoder = streaming_decoder("br", 64 << 20)
    assert b"".join(decoder.pieces(brotli.compress(body), SCAN_PIECE)) + decoder.flush() == body
    assert decoder.finished()


def test_a_compressed_body_cut_short_is_not_decoded_as_if_whole():
    from gateway.decompress import decode_pieces

    with pytest.raises(ValueError):
        list(decode_pieces("gzip", gzip.compress(bytes(100_000))[:-20]))
