"""The streaming redactor: a secret split across any chunk boundaries is caught, and nothing but a
tail that could still become a secret form is ever held back."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.redact import Redactor, SecretMemory, StreamRedactor, _View, forms_of

TOKEN_ALPHABET = string.ascii_letters + string.digits + "-_+/="
secret_values = st.text(TOKEN_ALPHABET, min_size=8, max_size=60)
filler = st.binary(max_size=200)


def _stream(redactor: Redactor, chunks: list[bytes]) -> tuple[list[bytes], bytes]:
    stream = StreamRedactor(redactor)
    pieces = [stream(c) for c in chunks]
    pieces.append(stream(b""))
    return pieces, b"".join(pieces)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    chunks, last = [], 0
    for point in points:
        if point > last:
            chunks.append(data[last:point])
            last = point
    if last < len(data):
        chunks.append(data[last:])
    return chunks


@settings(max_examples=300, deadline=None)
@given(secret=secret_values, before=filler, after=filler, cuts=st.lists(st.integers(0, 600), max_size=12),
       form_index=st.integers(0, 100))
def test_a_form_split_across_any_chunks_is_redacted_as_a_whole(secret, before, after, cuts, form_index):
    redactor = Redactor({"s": secret})
    forms = sorted(forms_of(secret))
    form = forms[form_index % len(forms)]
    body = before + form + after
    _, streamed = _stream(redactor, _split(body, cuts))
    assert streamed == redactor.redact(body)[0]  # the same as redacting the whole body at once
    assert form not in streamed
    assert len(streamed) == len(body)


@settings(max_examples=200, deadline=None)
@given(secrets=st.lists(secret_values, min_size=1, max_size=4), body=st.binary(max_size=400),
       cuts=st.lists(st.integers(0, 400), max_size=10))
def test_streaming_equals_whole_body_redaction_for_any_body(secrets, body, cuts):
    redactor = Redactor({f"s{i}": v for i, v in enumerate(secrets)})
    _, streamed = _stream(redactor, _split(body, cuts))
    assert streamed == redactor.redact(body)[0]


@settings(max_examples=200, deadline=None)
@given(secret=secret_values, body=st.binary(max_size=300))
def test_only_a_possible_prefix_of_a_form_is_held_back(secret, body):
    redactor = Redactor({"s": secret})
    stream = StreamRedactor(redactor)
    out = stream(body)
    held = stream.pending
    assert body.endswith(held)
    assert out == redactor.redact(body[:len(body) - len(held)])[0]
    if held.endswith(b"\r"):  # may be half of a line break the next chunk completes: it waits
        held = held[:-1]
    if held:
        seen = _View(held, -1).text  # the tail as the matcher sees it (case folded, NULs skipped)
        assert any(f.lower().startswith(seen) and f.lower() != seen for f in forms_of(secret))


def test_sse_events_pass_through_with_no_delay():
    redactor = Redactor({"key": "sk-ant-" + "A1b2C3d4" * 13})  # 111 characters, like a model API key
    stream = StreamRedactor(redactor)
    for n in range(20):
        event = b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w%d"}}\n\n' % n
        assert stream(event) == event  # every byte, at once
        assert stream.pending == b""


def test_a_secret_that_is_a_prefix_of_another_is_not_redacted_early():
    short, long = "abcdef123456", "abcdef123456XYZW7890"
    redactor = Redactor({"short": short, "long": long})
    stream = StreamRedactor(redactor)
    first = stream(b"x" + short.encode())
    rest = stream(b"XYZW7890 tail") + stream(b"")
    assert long.encode() not in first + rest
    assert b"XYZW7890" not in first + rest  # the longer secret is redacted whole, not its tail left


def test_many_trailing_carriage_returns_are_released_and_do_not_recurse():
    """A chunk ending in thousands of CRs: only the last one can be half of a line break."""
    redactor = Redactor({"key": "tok-A1b2C3d4E5f6G7h8I9j0"})
    stream = StreamRedactor(redactor)
    out = stream(b"data: x\n\n" + b"\r" * 5000)
    assert len(stream.pending) == 1 and out == b"data: x\n\n" + b"\r" * 4999


def test_a_secret_split_by_any_number_of_nuls_across_chunks_is_redacted():
    secret = "tok-A1b2C3d4E5f6G7h8I9j0"
    redactor = Redactor({"key": secret})
    stream = StreamRedactor(redactor)
    out = stream(secret[:1].encode() + b"\0" * 2000) + stream(secret[1:].encode() + b" end") + stream(b"")
    assert secret.encode() not in out.replace(b"\0", b"")


def test_a_value_rotated_while_a_stream_is_open_is_redacted_from_the_next_chunk():
    memory = SecretMemory()
    memory.remember({"key": "old-Value-1234567890ab"})
    stream = StreamRedactor(memory.redactor)
    first = stream(b"event one\n")
    memory.remember({"key": "new-Value-0987654321cd"})
    second = stream(b"echo new-Value-0987654321cd and old-Value-1234567890ab\n") + stream(b"")
    assert first == b"event one\n"
    assert b"Value" not in second


def test_a_value_percent_encoded_twice_is_redacted():
    from urllib.parse import quote

    secret = "sk-Ab3/x+Yz9=Qw8Er7Ty6"
    redactor = Redactor({"key": secret})
    # The gateway sent ?api_key=<quote(secret)>; the server's redirect quotes the whole URL again.
    echo = "Location: /login?next=" + quote("/v1?api_key=" + quote(secret, safe=""), safe="")
    clean, hits = redactor.redact(echo.encode())
    assert hits == ["key"]
