"""Counting a head's (or trailer section's) fields before it is parsed (addons/http1.py
HeadLines, count_trailer_fields): the count does not depend on how the bytes were split into
reads, stops at the blank line (a body's newlines are not counted), and a chunked body's trailer
section over the limit is refused before h11 decodes a field of it."""

from __future__ import annotations

import h11
import h11._readers
import pytest
from h11._receivebuffer import ReceiveBuffer
from hypothesis import example, given, settings
from hypothesis import strategies as st

from addons.http1 import HeadLines, TooManyFields, count_trailer_fields


def _fed(data: bytes, cuts: list[int]):
    """Yields the buffer after each read of `data` cut at `cuts`."""
    buf = ReceiveBuffer()
    at = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        buf += data[at:cut]
        at = cut
        yield buf


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=40), st.booleans(), st.binary(max_size=200),
       st.lists(st.integers(min_value=0, max_value=600), max_size=30))
@example(fields=13, bare_lf=False, body=b"", cuts=[99])  # a read ending between a blank line's \r and \n
def test_the_count_is_the_head_s_lines_however_it_is_split(fields, bare_lf, body, cuts):
    eol = b"\n" if bare_lf else b"\r\n"
    head = eol.join([b"HTTP/1.1 200 OK"] + [b"a%d:0" % n for n in range(fields)]) + eol + eol
    data = head + body + b"\n\n" * 3  # a body full of newlines and blank lines
    counter = HeadLines()
    for buf in _fed(data, [c for c in cuts if c < len(data)]):
        count = counter.count(buf)
    assert count == fields + 1


@pytest.mark.parametrize("eol", [b"\r\n", b"\n"])
def test_the_count_is_the_same_for_every_one_or_two_cuts(eol):
    """Every split point, exhaustively: a read may end inside the blank line's \\r\\n\\r\\n."""
    head = eol.join([b"GET / HTTP/1.1", b"a:0", b"b:1"]) + eol + eol
    data = head + b"\n\r\n\n"
    for first in range(len(data)):
        for second in range(first, len(data)):
            counter = HeadLines()
            for buf in _fed(data, [first, second]):
                count = counter.count(buf)
            assert count == 3, (first, second)


@pytest.mark.parametrize("fields, limit, refused", [(5, 10, False), (10, 10, False), (11, 10, True), (12000, 256, True)])
def test_a_trailer_section_over_the_limit_is_refused_before_h11_decodes_it(monkeypatch, fields, limit, refused):
    decoded: list[int] = []
    decode = h11._readers._decode_header_lines
    monkeypatch.setattr(h11._readers, "_decode_header_lines",
                        lambda lines: decoded.append(len(lines)) or decode(lines))
    reader = count_trailer_fields(h11._readers.ChunkedReader(), limit)
    buf = ReceiveBuffer()
    buf += b"3\r\nabc\r\n0\r\n" + b"".join(b"t%d: 0\r\n" % n for n in range(fields)) + b"\r\n"
    events = []
    try:
        while (event := reader(buf)) is not None:
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                break
    except TooManyFields:
        assert refused and decoded == []
        return
    assert not refused and len(events[-1].headers) == fields and decoded == [fields]


@pytest.mark.parametrize("empty", [b"\r\n", b"\n"])
def test_an_empty_section_counts_nothing_of_what_follows_it(empty):
    """A chunked body without trailers ends with an empty trailer section; the next pipelined
    request's head (257 lines) was counted as its trailers and refused 431."""
    counter = HeadLines()
    buf = ReceiveBuffer()
    buf += empty + b"GET / HTTP/1.1\r\n" + b"".join(b"f%d: 0\r\n" % n for n in range(256)) + b"\r\n"
    assert counter.count(buf) == 0
    reader = count_trailer_fields(h11._readers.ChunkedReader(), 256)
    body = ReceiveBuffer()
    body += b"3\r\nabc\r\n0\r\n" + bytes(buf)
    events = []
    while (event := reader(body)) is not None:
        events.append(event)
        if isinstance(event, h11.EndOfMessage):
            break
    assert isinstance(events[-1], h11.EndOfMessage) and list(events[-1].headers) == []
    assert bytes(body).startswith(b"GET / HTTP/1.1\r\n")  # the next head, untouched


def test_a_section_split_inside_its_leading_cr_is_still_empty():
    counter = HeadLines()
    buf = ReceiveBuffer()
    buf += b"\r"
    assert counter.count(buf) == 0
    buf += b"\nGET / HTTP/1.1\r\na: 0\r\n\r\n"
    assert counter.count(buf) == 0
