"""The ClientHello reader (gateway/clienthello.py): the same verdict however the bytes are split
into records and reads, and an oversized declared length refused from its header alone."""

from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st
from mitmproxy.proxy.layers.tls import parse_client_hello

from gateway.clienthello import (COMPLETE, MALFORMED, MAX_RECORD, MAX_RECORDS, NEED_MORE, TOO_LARGE,
                                 ClientHelloReader)
from tests.transparent.clients import client_hello

LIMIT = 4096


def handshake_message(padding: int) -> bytes:
    """A real ClientHello handshake message (no record header), grown by a padding extension
    (RFC 7685) of `padding` bytes: the size a post-quantum key share or a big ticket gives it."""
    message = client_hello("allowed.test")[5:]
    if not padding:
        return message
    body = message[4:]
    session_end = 2 + 32 + 1 + body[34]
    comp_at = session_end + 2 + int.from_bytes(body[session_end:session_end + 2], "big")
    ext_at = comp_at + 1 + body[comp_at]
    extensions = body[ext_at + 2:] + (21).to_bytes(2, "big") + padding.to_bytes(2, "big") + bytes(padding)
    body = body[:ext_at] + len(extensions).to_bytes(2, "big") + extensions
    return b"\x01" + len(body).to_bytes(3, "big") + body


def frame(message: bytes, record_sizes: list[int], version: bytes = b"\x03\x01") -> bytes:
    out, at, i = b"", 0, 0
    while at < len(message):
        size = max(1, min(MAX_RECORD, record_sizes[i % len(record_sizes)] if record_sizes else MAX_RECORD))
        chunk = message[at:at + size]
        out += b"\x16" + version + len(chunk).to_bytes(2, "big") + chunk
        at += size
        i += 1
    return out


def feed_in(reader: ClientHelloReader, data: bytes, cuts: list[int]) -> str:
    at = 0
    for cut in sorted(set(c % (len(data) + 1) for c in cuts)):
        reader.feed(data[at:cut])
        at = cut
    return reader.feed(data[at:])


@settings(max_examples=200, deadline=None)
@given(padding=st.integers(0, 3000), records=st.lists(st.integers(16, 2000), max_size=6),
       cuts=st.lists(st.integers(0, 10**6), max_size=30), trailer=st.binary(max_size=40))
def test_any_split_of_a_valid_hello_gives_the_same_hello(padding, records, cuts, trailer):
    message = handshake_message(padding)
    wire = frame(message, records) + trailer
    reader = ClientHelloReader(LIMIT)
    assert feed_in(reader, wire, cuts) == COMPLETE
    assert reader.hello == message
    canonical = reader.canonical()
    assert canonical.endswith(trailer)
    # what mitmproxy is handed parses to the same hello, in as few records as TLS allows
    parsed = parse_client_hello(canonical)
    assert parsed is not None and parsed.sni == "allowed.test"
    if len(message) <= MAX_RECORD:
        assert canonical[:5 + len(message)] == b"\x16\x03\x01" + len(message).to_bytes(2, "big") + message


def test_a_hello_sent_in_one_record_is_handed_on_byte_for_byte():
    wire = client_hello("allowed.test")
    reader = ClientHelloReader()
    assert reader.feed(wire) == COMPLETE
    assert reader.canonical() == wire
    assert reader.feed(b"later") == COMPLETE and reader.canonical() == wire + b"later"


@settings(max_examples=200, deadline=None)
@given(declared=st.integers(LIMIT - 3, 0xFFFFFF), first_record=st.integers(4, MAX_RECORD),
       junk=st.binary(min_size=0, max_size=200))
def test_an_oversized_declared_length_is_refused_from_the_first_record_header(declared, first_record, junk):
    """Refused as soon as the first record header and the handshake header are in: byte 9."""
    head = b"\x16\x03\x01" + first_record.to_bytes(2, "big") + b"\x01" + declared.to_bytes(3, "big")
    reader = ClientHelloReader(LIMIT)
    for i, byte in enumerate(head + junk):
        verdict = reader.feed(bytes([byte]))
        if verdict != NEED_MORE:
            break
    assert (verdict, i) == (TOO_LARGE, len(head) - 1)
    assert not reader.payload and not reader._pending  # nothing kept


def test_a_handshake_header_split_over_tiny_records_is_still_checked():
    message = b"\x01" + (0xFFFFFF).to_bytes(3, "big")
    reader = ClientHelloReader(LIMIT)
    assert feed_in(reader, frame(message, [1]), []) == TOO_LARGE


@given(size=st.integers(MAX_RECORD + 1, 0xFFFF))
def test_a_record_over_the_tls_maximum_is_refused_from_its_header(size):
    reader = ClientHelloReader(1 << 20)
    assert reader.feed(b"\x16\x03\x01" + size.to_bytes(2, "big")) == TOO_LARGE


def test_not_a_client_hello():
    assert ClientHelloReader().feed(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00") == MALFORMED  # a ServerHello
    assert ClientHelloReader().feed(b"\x16\x03\x01\x00\x00") == MALFORMED  # an empty record
    reader = ClientHelloReader()
    first = frame(handshake_message(0), [10])
    assert reader.feed(first[:15] + b"\x17\x03\x03\x00\x01x") == MALFORMED  # application data inside the hello


def test_work_is_linear_in_the_bytes_fed():
    """A 64 KiB hello in 256-byte records, fed byte by byte: each feed does a bounded amount of work,
    whatever came before (a quadratic reader would copy gigabytes here)."""
    message = handshake_message(0)
    message = b"\x01" + (LIMIT - 4).to_bytes(3, "big") + message[4:] + os.urandom(LIMIT - len(message))
    wire = frame(message, [256])
    reader = ClientHelloReader(LIMIT)
    for i in range(len(wire)):
        verdict = reader.feed(wire[i:i + 1])
        assert len(reader._pending) <= 5 + 256
    assert verdict == COMPLETE and reader.hello == message and reader.records == LIMIT // 256
    assert len(reader.canonical()) == len(message) + 5  # one record for mitmproxy, not 16


def test_a_hello_in_too_many_records_is_refused():
    """Fragmented into 1-byte records, a hello costs a round of the reader per byte: refused at
    record MAX_RECORDS + 1, whatever its declared length."""
    message = handshake_message(600)
    reader = ClientHelloReader(LIMIT)
    wire = frame(message, [1])
    assert feed_in(reader, wire[:MAX_RECORDS * 6], []) == NEED_MORE
    assert reader.feed(wire[MAX_RECORDS * 6:MAX_RECORDS * 6 + 5]) == TOO_LARGE
    assert "256 records" in reader.error
    assert feed_in(ClientHelloReader(LIMIT), frame(message, [len(message) // MAX_RECORDS + 1]), []) == COMPLETE


def _with_items(extra_extensions: int = 0, extra_suites: int = 0) -> bytes:
    """A real ClientHello handshake message with empty extensions and cipher suites added."""
    body = client_hello("allowed.test")[5:][4:]
    suites_at = 2 + 32 + 1 + body[34]
    n = int.from_bytes(body[suites_at:suites_at + 2], "big")
    suites = body[suites_at + 2:suites_at + 2 + n] + b"".join(
        (0x3000 + i).to_bytes(2, "big") for i in range(extra_suites))
    body = body[:suites_at] + len(suites).to_bytes(2, "big") + suites + body[suites_at + 2 + n:]
    comp_at = suites_at + 2 + len(suites)
    ext_at = comp_at + 1 + body[comp_at]
    extensions = body[ext_at + 2:] + b"".join((0x2000 + i).to_bytes(2, "big") + b"\x00\x00"
                                              for i in range(extra_extensions))
    body = body[:ext_at] + len(extensions).to_bytes(2, "big") + extensions
    return b"\x01" + len(body).to_bytes(3, "big") + body


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 400), st.integers(0, 700), st.lists(st.integers(64, 3000), min_size=1, max_size=4))
def test_a_hello_of_too_many_extensions_or_cipher_suites_is_too_large(extensions, suites, sizes):
    """Within the byte budget, but with more items than any client sends: refused before anything
    parses it (a 64 KiB hello of ~16,000 empty extensions cost mitmproxy ~100 ms of CPU)."""
    from gateway.clienthello import MAX_CIPHER_SUITES, MAX_EXTENSIONS
    message = _with_items(extensions, suites)
    reader = ClientHelloReader(64 * 1024)
    verdict = reader.feed(frame(message, sizes))
    total_ext = 8 + extensions  # client_hello() sends 8
    total_suites = 5 + suites
    if total_ext > MAX_EXTENSIONS or total_suites > MAX_CIPHER_SUITES:
        assert verdict == TOO_LARGE, (total_ext, total_suites)
        assert "extensions" in reader.error or "cipher suites" in reader.error
    else:
        assert verdict == COMPLETE, reader.error
        assert parse_client_hello(reader.canonical()) is not None
