"""Behaviours 2 and 3, at the byte level: credential-bound streamed responses are never truncated,
and a secret the origin echoes inside a streamed event is redacted without stopping the stream.

The client is a raw socket: CONNECT, TLS with the ssl module, hand-written HTTP/1.1, the chunked
framing read and checked byte by byte (every chunk non-empty and CRLF-terminated, no last-chunk
`0\\r\\n\\r\\n` before the origin finished, the decoded body equal to what the origin sent). The
key is 108 characters, so every form the redactor looks for (hex: 216) is longer than one ~140
byte event: a redactor that holds back "the longest form minus one" withholds whole events, and
one that answers a held-back chunk with b"" ends a chunked body early.

The origin writes each event whole, or in 1-, 5- or 17-byte writes, or in writes that straddle
event boundaries, and waits for the client to confirm each event before the next one.
"""

from __future__ import annotations

import pytest

from .clients import Fetch, connect_tunnel, follow
from .conftest import KEY, REDACTED, check_origin_saw, model_event, model_events, name
from .origins import paced_stream, pieces_of, plan_events, plan_straddling

pytestmark = pytest.mark.e2e

WRITES = {
    "whole-events": None,
    "1-byte-writes": pieces_of(1),
    "5-byte-writes": pieces_of(5),
    "17-byte-writes": pieces_of(17),
}


def bound_h1(gateway, path: str, host: str | None = None) -> Fetch:
    host = host or name("h1", "bound")
    return Fetch(connect_tunnel(gateway, host, ["http/1.1"]), "h1", host, path)


def check_chunked_framing(fetch: Fetch, body: bytes) -> None:
    client = fetch.h1
    if client.framing == "chunked":
        assert all(client.chunks), f"an empty chunk inside the body: {[len(c) for c in client.chunks]}"
        assert b"".join(client.chunks) == body
        assert client.raw_terminator == b"0\r\n\r\n", client.raw_terminator
    elif client.framing == "close":
        assert client.conn.eof_kind == "clean", (
            "a read-until-close body ended without TLS close_notify: the client cannot tell it from a truncation")
    assert not client.conn.buf, f"bytes after the end of the body: {client.conn.buf[:200]!r}"


def paced_bound_h1(gateway, routes, events, plan, framing="chunked", expected=None):
    route, lock = paced_stream(routes, plan, framing=framing)
    fetch = bound_h1(gateway, route.path)
    try:
        fetch.read_head()
        assert fetch.status == 200, fetch.headers
        lock.ack(0)
        body = follow(fetch.events(), expected or events, lock)
        check_chunked_framing(fetch, body)
    finally:
        fetch.close()
    check_origin_saw(route.exchange, "bound")
    return fetch


# -- behaviour 2: never truncated ---------------------------------------------------------------------


@pytest.mark.parametrize("writes", list(WRITES), ids=list(WRITES))
def test_bound_chunked_sse_arrives_byte_for_byte(gateway, routes, origins, writes):
    events = model_events(5)
    assert all(130 <= len(e) <= 150 for e in events), [len(e) for e in events]
    paced_bound_h1(gateway, routes, events, plan_events(events, WRITES[writes]))


@pytest.mark.parametrize("writes", ["whole-events", "5-byte-writes"])
def test_bound_read_until_close_sse_arrives_byte_for_byte(gateway, routes, origins, writes):
    """No Content-Length, no chunked, `Connection: close` from the origin."""
    events = model_events(5)
    paced_bound_h1(gateway, routes, events, plan_events(events, WRITES[writes]), framing="close")


@pytest.mark.parametrize("overlap", [1, 20, 60])
def test_bound_writes_that_straddle_events(gateway, routes, origins, overlap):
    """The tail of event n and the head of event n+1 in one write: event n must still arrive while
    the head of n+1 is in flight."""
    events = model_events(5)
    paced_bound_h1(gateway, routes, events, plan_straddling(events, overlap))


def test_bound_sse_over_http2_arrives_byte_for_byte(gateway, routes, origins):
    """The same, read by an h2 client from the h2 origin, with 5-byte DATA frames."""
    events = model_events(5)
    route, lock = paced_stream(routes, plan_events(events, pieces_of(5)))
    host = name("h2", "bound")
    fetch = Fetch(connect_tunnel(gateway, host, ["h2"]), "h2", host, route.path)
    try:
        fetch.read_head()
        lock.ack(0)
        follow(fetch.events(), events, lock)
        frames = fetch.h2.responses[fetch.sid].frames
        assert all(frames), "an empty DATA frame"
    finally:
        fetch.close()
    check_origin_saw(route.exchange, "bound")


# -- behaviour 3: an echoed secret is redacted, and the stream goes on ---------------------------------


def secret_event() -> bytes:
    return model_event(2, text=f"your key is {KEY} (do not share)")


def redaction_plan(events: list[bytes], how: str):
    secret = events[1]
    at = secret.index(KEY.encode())
    if how == "raw":
        return plan_events(events)
    if how == "split":
        # The first half of the key travels in the same write as event 1, the second half only after
        # the client confirmed event 1: the gateway has certainly seen the halves apart.
        cut = at + len(KEY) // 2
        return [0, events[0] + secret[:cut], 1, secret[cut:], 2, events[2], 3, events[3], 4]
    if how == "1-byte-writes":
        return plan_events(events, pieces_of(1))
    raise ValueError(how)


@pytest.mark.parametrize("client", ["h1", "h2"])
@pytest.mark.parametrize("how", ["raw", "split", "1-byte-writes"])
def test_echoed_secret_is_redacted_and_the_stream_goes_on(gateway, routes, origins, client, how):
    events = [model_event(1), secret_event(), model_event(3), model_event(4)]
    expected = [e.replace(KEY.encode(), REDACTED) for e in events]
    assert len(expected[1]) == len(events[1]) and expected[1] != events[1]
    route, lock = paced_stream(routes, redaction_plan(events, how))
    host = name("h1" if client == "h1" else "h2", "bound")
    fetch = Fetch(connect_tunnel(gateway, host, ["http/1.1"] if client == "h1" else ["h2"]), client, host,
                  route.path)
    try:
        fetch.read_head()
        lock.ack(0)
        body = follow(fetch.events(), expected, lock)
        if client == "h1":
            check_chunked_framing(fetch, body)
    finally:
        fetch.close()
    assert KEY.encode() not in body
    assert b"your key is " + REDACTED + b" (do not share)" in body
    check_origin_saw(route.exchange, "bound")


def test_secret_split_by_chunk_framing_read_until_close(gateway, routes, origins):
    """The same split, from a read-until-close origin."""
    events = [model_event(1), secret_event(), model_event(3), model_event(4)]
    expected = [e.replace(KEY.encode(), REDACTED) for e in events]
    paced_bound_h1(gateway, routes, events, redaction_plan(events, "split"), framing="close", expected=expected)


def _compressed_plan(events: list[bytes], encoding: str):
    """Each event compressed and flushed on its own (as a streaming server does), then a wait for
    the client to confirm it; the compressed stream's end after the last one."""
    import zlib

    import brotli

    if encoding == "gzip":
        compressor = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        piece, end = (lambda e: compressor.compress(e) + compressor.flush(zlib.Z_SYNC_FLUSH)), compressor.flush
    else:
        compressor = brotli.Compressor()
        piece, end = (lambda e: compressor.process(e) + compressor.flush()), compressor.finish
    plan = [0]
    for n, event in enumerate(events, 1):
        plan += [piece(event), n]
    return plan + [end()]


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_bound_compressed_sse_is_decoded_and_arrives_event_by_event(gateway, routes, origins, encoding):
    """A compressed stream on a bound rule is decoded as it comes, each chunk's decoder call on the
    decode pool while the stream waits (addons/decode_pool.py): the client still gets each event
    before the origin sends the next, with no empty chunk and the body whole."""
    events = model_events(5)
    route, lock = paced_stream(routes, _compressed_plan(events, encoding), headers=[("Content-Encoding", encoding)])
    fetch = bound_h1(gateway, route.path)
    try:
        fetch.read_head()
        assert fetch.status == 200, fetch.headers
        lock.ack(0)
        body = follow(fetch.events(), events, lock)
        check_chunked_framing(fetch, body)
    finally:
        fetch.close()
    check_origin_saw(route.exchange, "bound")
