"""Refusal pages about failures quote no upstream or sandbox bytes (gateway/failure.py)."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from gateway.failure import MAX_DETAIL, WITHHELD, failure_detail


def test_mitmproxy_texts_keep_their_meaning_and_lose_the_bytes():
    text = "unexpected server response: b'HTTP/1.1 200 OK\\r\\nX-Echo: sk-SECRET'"
    assert failure_detail(text) == f"unexpected server response: {WITHHELD}"
    assert "SECRET" not in failure_detail('Cannot parse HTTP response: Invalid header: b"X-Echo sk-SECRET"')
    assert failure_detail("[Errno 111] Connect call failed ('127.0.0.1', 443)") == \
        "[Errno 111] Connect call failed ('127.0.0.1', 443)"
    assert failure_detail("Certificate verify failed: hostname mismatch") == "Certificate verify failed: hostname mismatch"


@given(secret=st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="'\"\\"), min_size=12),
       prefix=st.text(max_size=40), quote=st.sampled_from(["'", '"']), bytes_literal=st.booleans())
def test_a_quoted_literal_never_survives(secret, prefix, quote, bytes_literal):
    assume(secret not in prefix)
    assume(not _is_address(secret))  # (the one literal kept: a connect error's own pinned address)
    literal = ("b" if bytes_literal else "") + quote + secret + quote
    text = f"{prefix.replace(chr(39), '').replace(chr(34), '')}: {literal} trailing"
    detail = failure_detail(text)
    assert secret not in detail or len(secret) < 4
    assert len(detail) <= MAX_DETAIL


def _is_address(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@given(st.text(max_size=1000))
def test_bounded_and_printable(text):
    detail = failure_detail(text)
    assert len(detail) <= MAX_DETAIL
    assert all(" " <= c <= "~" for c in detail)
