"""addons/layer_guard.py `classify`: a connection's first bytes. Empty lines before a request line
are skipped there too (RFC 9112 2.2; review 11: a leading CRLF got 400 non_http), and nothing
behind them can become anything but HTTP."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from addons.layer_guard import HTTP, OTHER, WAIT, classify, _no_wait_for_http
from addons.http1_server import MAX_EMPTY_LINES

empty_line = st.sampled_from([b"\r\n", b"\n"])
request_line = st.sampled_from([b"GET http://a.test/ HTTP/1.1\r\n", b"CONNECT a.test:443 HTTP/1.1\r\n",
                                b"POST /x HTTP/1.0\n"])


@given(st.lists(empty_line, min_size=1, max_size=3 * MAX_EMPTY_LINES), request_line, st.binary(max_size=40))
def test_empty_lines_then_a_request_line_is_http(lines, line, rest):
    """Within the limit, skipped; past it, still HTTP: the HTTP layer refuses with its own reason."""
    assert classify(b"".join(lines) + line + rest) == HTTP


@given(st.lists(empty_line, min_size=1, max_size=MAX_EMPTY_LINES), st.binary(max_size=60))
def test_behind_empty_lines_only_http_or_waiting(lines, rest):
    """TLS, HTTP/2 prior knowledge or anything else behind empty lines is never classified as such."""
    assert classify(b"".join(lines) + rest) in (HTTP, WAIT, OTHER)


@given(st.lists(empty_line, min_size=1, max_size=MAX_EMPTY_LINES))
def test_empty_lines_alone_wait_for_more(lines):
    data = b"".join(lines)
    assert classify(data) == WAIT
    assert classify(data + b"\r") == WAIT  # half a CRLF


@given(st.lists(empty_line, min_size=1, max_size=MAX_EMPTY_LINES), st.sampled_from([b"G", b"GET", b"DELETE /"]))
def test_a_method_behind_empty_lines_goes_to_the_http_layer_at_once(lines, start):
    data = b"".join(lines) + start
    assert _no_wait_for_http(classify(data), data) == HTTP


def test_a_bare_cr_is_not_an_empty_line():
    assert classify(b"\rGET / HTTP/1.1\r\n") == OTHER
    assert classify(b"\r\n\rGET / HTTP/1.1\r\n") == OTHER
