"""A compressed request body's method-override scan in steps (gateway/methods/scanner.py `feed_steps`,
addons/decode_pool.py `drive`): its decoder calls run on a pool thread, the scanning of what they
return on the loop's thread, and the answer is the one the inline scan gives, in any chunking."""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib

import brotli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from addons import decode_pool
from addons.http_stream import _NOT_SCANNED
from addons.method_body import BodyOverrideCheck
from gateway import methods
from gateway.methods import scanner as body_scan
from gateway.decision import Decision
from gateway.decompress import request_decoder, streaming_decoder
from gateway.methods import BodyScanner

FORM = "application/x-www-form-urlencoded"
CODINGS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress}


def _scanner(coding: str, content_type: str = FORM) -> BodyScanner:
    return BodyScanner.for_headers([("Content-Type", content_type), ("Content-Encoding", coding)], streaming_decoder)


def _cut(body: bytes, cuts) -> list[bytes]:
    points = sorted({c for c in cuts if c <= len(body)}) + [len(body)]
    chunks, start = [], 0
    for point in points:
        chunks.append(body[start:point])
        start = point
    return chunks


def _pooled(scanner: BodyScanner, chunks: list[bytes]) -> tuple[list, str | None]:
    async def main():
        found = []
        for chunk in chunks:
            found += await decode_pool.drive(scanner.feed_steps(chunk))
        found += await decode_pool.drive(scanner.finish_steps())
        return found
    found = asyncio.run(main())
    return found, scanner.problem


def _inline(scanner: BodyScanner, chunks: list[bytes]) -> tuple[list, str | None]:
    found = []
    for chunk in chunks:
        found += scanner.feed(chunk)
    found += scanner.finish()
    return found, scanner.problem


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.sampled_from(["a=1", "_method=DELETE", "_method=put", "x_method=GET", "&", "%5Fmethod=PATCH"]),
                max_size=8),
       st.sampled_from(sorted(CODINGS)), st.lists(st.integers(0, 200), max_size=6),
       st.booleans())
def test_the_pooled_scan_finds_what_the_inline_scan_finds_in_any_chunking(fields, coding, cuts, truncated):
    body = CODINGS[coding]("&".join(fields).encode())
    if truncated:
        body = body[: len(body) // 2]
    chunks = _cut(body, cuts)
    pooled = _pooled(_scanner(coding), chunks)
    inline = _inline(_scanner(coding), chunks)
    assert (set(pooled[0]), pooled[1]) == (set(inline[0]), inline[1])


def test_decoder_calls_run_on_the_pool_and_the_scan_on_the_loop_thread(monkeypatch):
    loop_thread = threading.current_thread()
    scanned_on, decoded_on = set(), set()
    feed = body_scan._Stream.feed

    def recording_feed(self, data, found):
        scanned_on.add(threading.current_thread())
        return feed(self, data, found)

    monkeypatch.setattr(body_scan._Stream, "feed", recording_feed)
    scanner = _scanner("br")
    inner = scanner.decoders[0].inner
    decompress = inner.decompress

    def recording_decompress(*args):
        decoded_on.add(threading.current_thread())
        return decompress(*args)

    inner.decompress = recording_decompress
    found, problem = _pooled(scanner, [brotli.compress(b"a=1&_method=DELETE" + b"&b=2" * 100_000)])
    assert problem is None and {o.method for o in found} == {"DELETE"}
    assert scanned_on == {loop_thread}
    assert decoded_on and loop_thread not in decoded_on


def test_a_bomb_is_too_large_on_the_pool_as_inline():
    bomb = brotli.compress(bytes(32 << 20), quality=5, lgwin=24)
    for scan in (_pooled, _inline):
        scanner = BodyScanner.for_headers([("Content-Type", FORM), ("Content-Encoding", "br")], request_decoder)
        try:
            scan(scanner, [bomb])
        except methods.BodyTooLarge:
            continue
        raise AssertionError(f"{scan.__name__}: no BodyTooLarge")


def _check(coding: str, recorded: list) -> BodyOverrideCheck:
    return BodyOverrideCheck(_scanner(coding), judge=lambda found: Decision.deny("method_not_allowed", "no", "r"),
                             record=lambda decision, found: recorded.append(decision.reason), bound=False, rule="r")


def test_the_check_s_hook_refuses_an_override_found_on_the_pool():
    recorded = []
    check = _check("gzip", recorded)
    assert check.decodes
    refusal = None
    for data in (gzip.compress(b"_method=DELETE"), None):  # the value ends with the body: the end's step finds it
        step = decode_pool.DecodeSteps(check.scan(data))
        asyncio.run(decode_pool.DecodePool().egress_decode_steps(step))
        refusal = refusal or check.settle(step.result)
    assert refusal is not None and refusal.reason == "method_not_allowed" and recorded == ["method_not_allowed"]


def test_a_step_no_addon_ran_refuses_the_body():
    recorded = []
    check = _check("gzip", recorded)
    refusal = check.settle(_NOT_SCANNED)
    assert refusal is not None and not refusal.allowed and refusal.reason == "internal_error"
    assert recorded == ["internal_error"]


def _body_redactor(coding: str, secret: str, failures: list):
    from mitmproxy.test import tflow

    from addons.body_redaction import BodyRedactor
    from gateway.decompress import stream_decoder
    from gateway.redact import Redactor, StreamRedactor

    flow = tflow.tflow(resp=True)
    stream = BodyRedactor(flow, StreamRedactor(Redactor({"key": secret})), stream_decoder(coding),
                           on_failure=lambda f, reason: failures.append(reason))
    return flow, stream


def _drive_response(stream, chunks: list[bytes]) -> bytes:
    async def main():
        out = []
        for chunk in chunks + [b""]:
            step = decode_pool.DecodeSteps(stream.steps(chunk))
            await decode_pool.DecodePool().egress_decode_steps(step)
            stream.ready(step.result)
            out += stream(chunk)  # what the stream callable hands on: what the steps made
        return b"".join(out)
    return asyncio.run(main())


def test_a_streamed_bound_response_decoded_on_the_pool_is_redacted_as_inline():
    secret = "sk-live-0123456789abcdef"
    body = (b"x" * 70_000 + secret.encode() + b"y" * 70_000) * 3
    compressed = gzip.compress(body)
    chunks = [compressed[i:i + 8192] for i in range(0, len(compressed), 8192)]
    failures = []
    _, pooled = _body_redactor("gzip", secret, failures)
    _, inline = _body_redactor("gzip", secret, failures)
    got = _drive_response(pooled, chunks)
    want = b""
    for chunk in chunks + [b""]:
        want += b"".join(inline(chunk))
    assert got == want and secret.encode() not in got and len(got) == len(body) and not failures


def test_a_streamed_bomb_decoded_on_the_pool_is_cut_off_and_its_decoder_dropped():
    failures = []
    flow, stream = _body_redactor("br", "sk-live-0123456789abcdef", failures)
    bomb = brotli.compress(bytes(64 << 20), quality=5, lgwin=24)
    _drive_response(stream, [bomb])
    assert failures == ["response_too_large"] and flow.error is not None and stream.decoder is None


def test_the_stream_callable_holds_its_flow_weakly():
    """The flow holds the callable (its response's stream): a strong reference back made a cycle
    that kept a cut-off stream's decoder until a full collection."""
    import gc

    flow, stream = _body_redactor("gzip", "sk-live-0123456789abcdef", [])
    flow.response.stream = stream
    assert not any(referent is flow for referent in gc.get_referents(*gc.get_referents(stream)))


def test_a_response_step_no_addon_ran_cuts_the_body_off():
    failures = []
    flow, stream = _body_redactor("gzip", "sk-live-0123456789abcdef", failures)
    stream.ready(None)
    assert stream(gzip.compress(b"hello")) == [b""] and failures == ["undecodable_response"] and flow.error is not None
