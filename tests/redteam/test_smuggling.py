"""Request smuggling. api.test allows only GET/HEAD under /ok/; every attack hides a second request
(`GET /admin`, a DELETE, or one for another host) behind ambiguous framing: Content-Length with
Transfer-Encoding, duplicate or list-valued Content-Length, Transfer-Encoding spelled with obs-fold
or junk, bare LF line ends, chunk extensions and malformed chunk sizes, an Expect: 100-continue
request to a denied path whose body is a request. The gateway either refuses the whole thing or
re-frames it as what it parsed: the hidden request must never reach an upstream as a request,
and nothing may reach a host no rule allows."""

from __future__ import annotations

import time

import pytest

from tests.e2e.helpers import TIMEOUT, Conn, connect_proxy, tls_tunnel
from tests.support.topology import ALLOWED

from .common import attack, nothing_reached

pytestmark = attack("smuggling")

HIDDEN = b"GET /admin HTTP/1.1\r\nHost: api.test\r\n\r\n"
HIDDEN_DELETE = b"DELETE /ok/x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 0\r\n\r\n"
N = len(HIDDEN)  # a Content-Length that covers exactly the hidden request


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n"


def _head(extra: bytes, method: bytes = b"GET", path: bytes = b"/ok/front") -> bytes:
    return method + b" " + path + b" HTTP/1.1\r\nHost: api.test\r\n" + extra


ATTACKS = {
    "cl-te": _head(b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "te-cl": _head(b"Transfer-Encoding: chunked\r\nContent-Length: 80\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "duplicate-cl-differing": _head(b"Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % N) + HIDDEN,
    "duplicate-cl-same": _head(b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (N, N)) + HIDDEN,
    "cl-list": _head(b"Content-Length: 0, %d\r\n\r\n" % N) + HIDDEN,
    "cl-plus": _head(b"Content-Length: +%d\r\n\r\n" % N) + HIDDEN,
    "cl-hex": _head(b"Content-Length: 0x%x\r\n\r\n" % N) + HIDDEN,
    "te-obs-fold": _head(b"Content-Length: %d\r\nTransfer-Encoding:\r\n chunked\r\n\r\n" % (N + 5)) + b"0\r\n\r\n" + HIDDEN,
    "te-xchunked": _head(b"Transfer-Encoding: xchunked\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "te-chunked-identity": _head(b"Transfer-Encoding: chunked, identity\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "te-space-before-colon": _head(b"Transfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "te-vertical-tab": _head(b"Transfer-Encoding: \x0bchunked\r\nContent-Length: 5\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "te-on-get-http10": b"GET /ok/front HTTP/1.0\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + HIDDEN,
    "bare-lf-head": b"GET /ok/front HTTP/1.1\nHost: api.test\nContent-Length: %d\n\n" % N + HIDDEN,
    "bare-lf-in-header": _head(b"X-Pad: a\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n") + b"0\r\n\r\n" + HIDDEN,
    "bare-cr-in-header": _head(b"X-Pad: a\rContent-Length: %d\r\n\r\n" % N) + HIDDEN,
    "chunk-extension": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"3;ext=\"x\r\n0\r\n\r\n\";q=1\r\nabc\r\n0\r\n\r\n" + HIDDEN,
    "chunk-extension-lf": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"3;x\nabc\r\n0\r\n\r\n" + HIDDEN,
    "chunk-size-overflow": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"10000000000000003\r\nabc\r\n0\r\n\r\n" + HIDDEN,
    "chunk-size-prefix": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"0x3\r\nabc\r\n0\r\n\r\n" + HIDDEN,
    "chunk-size-space": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"3 \r\nabc\r\n0\r\n\r\n" + HIDDEN,
    "trailer-host": _head(b"Transfer-Encoding: chunked\r\n\r\n") + b"3\r\nabc\r\n0\r\nHost: other.test\r\n\r\n" + HIDDEN_DELETE,
    "pipelined-delete": _head(b"\r\n") + HIDDEN_DELETE,
}


def _read_everything(conn: Conn, wait: float = 1.0, idle: float = 0.15) -> bytes:
    """Whatever the gateway answers (one or more responses, or nothing): until it closes, or
    `idle` s pass without more bytes after the first ones, or `wait` s in all."""
    data = b""
    start = last = time.monotonic()
    conn.sock.settimeout(0.05)
    while time.monotonic() - start < wait and not (data and time.monotonic() - last > idle):
        try:
            chunk = conn.sock.recv(65536)
        except (TimeoutError, OSError):
            continue
        if not chunk:
            break
        data += chunk
        last = time.monotonic()
    return data


def assert_hidden_never_arrived(rt) -> None:
    seen = [(r.method, r.path) for r in rt.upstreams.tls["api.test"].requests]
    assert all(method in ("GET", "HEAD") and path.startswith("/ok/") for method, path in seen), seen
    nothing_reached(rt.recorders("other.test", "allowed.test", "deep.wild.test"), context=seen)


@pytest.mark.parametrize("label", sorted(ATTACKS))
def test_smuggling_in_a_tls_tunnel(rt, label):
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        tls.send(ATTACKS[label])
        answers = _read_everything(tls)
    assert b"/admin" not in answers or b"403" in answers, answers[:500]
    assert_hidden_never_arrived(rt)


def test_request_trailers_are_refused_promptly(rt):
    """An allowed GET with a chunked body that ends in a trailer section (here one naming another
    Host). Nothing may be forwarded, and the gateway must answer (400) or close at once: a
    connection left hanging forever lets a sandbox hold gateway resources without limit."""
    request = (_head(b"Transfer-Encoding: chunked\r\n\r\n") + b"3\r\nabc\r\n0\r\nHost: other.test\r\n"
               b"X-Trailer: 1\r\n\r\n")
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        tls.send(request)
        started = time.monotonic()
        try:
            response = tls.read_response()
        except (ConnectionError, OSError):
            response = None
        elapsed = time.monotonic() - started
    assert_hidden_never_arrived(rt)
    assert rt.upstreams.tls["api.test"].requests == []
    assert elapsed < TIMEOUT, f"no answer and no close for {elapsed:.1f}s (the connection hangs)"
    assert response is None or response.status == 400, response


def test_expect_continue_to_a_denied_path(rt):
    """Expect: 100-continue on a path the rule denies: a final refusal, never `100 Continue`
    followed by forwarding; the body (itself a request) is never parsed as one upstream."""
    body = HIDDEN + b"X" * 8
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        tls.send(b"POST /admin HTTP/1.1\r\nHost: api.test\r\nExpect: 100-continue\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
        first = _read_everything(tls, 0.5)
        if not first.startswith(b"HTTP/1.1 4"):
            tls.send(body)
            first += _read_everything(tls, 0.5)
    assert b" 403 " in first.split(b"\r\n", 1)[0] or b"HTTP/1.1 403" in first, first[:300]
    assert rt.upstreams.tls["api.test"].connections == 0
    assert_hidden_never_arrived(rt)


def test_smuggling_on_the_proxy_port(rt):
    """Absolute-form with CL and TE; the hidden request names another host."""
    hidden = b"GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n"
    with connect_proxy(rt.gateway) as conn:
        conn.send(b"POST http://allowed.test/front HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + hidden)
        answers = _read_everything(conn)
    assert answers.startswith(b"HTTP/1.1 400"), answers[:300]
    nothing_reached(rt.everything())


def test_transparent_smuggling_on_port_80(world):
    hidden = b"GET /hidden HTTP/1.1\r\nHost: other.test\r\n\r\n"
    with Conn(world.connect(ALLOWED, 80)) as conn:
        conn.send(b"POST /front HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + hidden)
        answers = _read_everything(conn)
    assert answers.startswith(b"HTTP/1.1 400"), answers[:300]
    assert world.touched() == []
