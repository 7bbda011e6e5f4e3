"""gateway/hopbyhop.py: which of the sandbox's fields stay on its hop."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.hopbyhop import forwardable


def names(fields) -> list[bytes]:
    return [k.lower() for k, _ in fields]


@pytest.mark.parametrize("spelling", [b"TE", b"te", b"Te", b"tE"])
def test_te_is_dropped_in_every_spelling_on_http1(spelling):
    fields = [(b"Host", b"a.test"), (spelling, b"gzip"), (b"Accept", b"*/*")]
    assert forwardable(fields, http2=False) == [(b"Host", b"a.test"), (b"Accept", b"*/*")]


@pytest.mark.parametrize("values", [[b"gzip"], [b"trailers"], [b"trailers, gzip"], [b"gzip;q=1.0", b"deflate"],
                                    [b"chunked"], [b""], [b"trailers", b"trailers"]])
def test_every_te_field_goes_on_http1(values):
    fields = [(b"Host", b"a.test")] + [(b"te", v) for v in values]
    assert forwardable(fields, http2=False) == [(b"Host", b"a.test")]


@pytest.mark.parametrize("values, kept", [
    ([b"trailers"], True), ([b"Trailers"], True), ([b"trailers", b"trailers"], True),
    ([b"gzip, trailers"], True),  # (HTTP/2 refuses this inbound; were it let in, only trailers goes)
    ([b"gzip"], False), ([b"deflate", b"compress"], False),
])
def test_http2_keeps_exactly_one_te_trailers_when_asked(values, kept):
    fields = [(b"content-type", b"application/grpc")] + [(b"te", v) for v in values]
    out = forwardable(fields, http2=True)
    out = fields if out is None else out
    assert [f for f in out if f[0].lower() == b"te"] == ([(b"te", b"trailers")] if kept else [])


def test_nominated_fields_are_dropped_and_connection_keeps_only_options():
    fields = [(b"Host", b"a.test"), (b"Connection", b"close, X-Trace, Cookie"), (b"X-Trace", b"1"),
              (b"cookie", b"s=1"), (b"Keep-Alive", b"timeout=5"), (b"Proxy-Connection", b"keep-alive"),
              (b"Accept", b"*/*")]
    assert forwardable(fields, http2=False) == [(b"Host", b"a.test"), (b"Connection", b"close"),
                                                (b"Accept", b"*/*")]


@pytest.mark.parametrize("protected", [b"Host", b"Content-Length", b"Transfer-Encoding", b"Upgrade"])
def test_fields_forwarding_depends_on_are_never_dropped(protected):
    fields = [(b"Host", b"a.test"), (b"Content-Length", b"3"), (b"Transfer-Encoding", b"chunked"),
              (b"Upgrade", b"websocket"), (b"Connection", b"Upgrade, " + protected)]
    out = forwardable(fields, http2=False)
    assert out == fields[:-1] + [(b"Connection", b"Upgrade")]


def test_nothing_to_do_is_none():
    fields = [(b"Host", b"a.test"), (b"Connection", b"keep-alive"), (b"Accept", b"*/*")]
    assert forwardable(fields, http2=False) is None
    assert forwardable([(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket")], http2=False) is None


def test_connection_nominating_only_fields_disappears():
    fields = [(b"Host", b"a.test"), (b"Connection", b"Authorization"), (b"Connection", b"te"),
              (b"Authorization", b"Bearer sandbox-own")]
    assert forwardable(fields, http2=False) == [(b"Host", b"a.test")]


TOKENS = st.sampled_from([b"close", b"keep-alive", b"Upgrade", b"te", b"Authorization", b"accept-encoding",
                          b"host", b"content-length", b"x-a", b"X-B", b""])
FIELDS = st.lists(st.tuples(st.sampled_from([b"Host", b"TE", b"te", b"Connection", b"Authorization", b"X-A",
                                             b"Accept-Encoding", b"Keep-Alive", b"Content-Length", b"Upgrade"]),
                            st.lists(TOKENS, max_size=3).map(b", ".join)), max_size=8)


@given(FIELDS, st.booleans())
def test_forwarded_fields_never_nominate_or_carry_hop_by_hop(fields, http2):
    out = forwardable(fields, http2)
    out = list(fields) if out is None else out
    options = [t.strip().lower() for k, v in out if k.lower() == b"connection" for t in v.split(b",") if t.strip()]
    assert set(options) <= {b"close", b"keep-alive", b"upgrade"}
    assert all(k.lower() not in (b"keep-alive", b"proxy-connection") for k, _ in out)
    te = [v for k, v in out if k.lower() == b"te"]
    assert te in ([], [b"trailers"]) and (http2 or not te)
    kept = {b"host", b"content-length", b"transfer-encoding", b"upgrade"}
    assert [f for f in fields if f[0].lower() in kept] == [f for f in out if f[0].lower() in kept]
