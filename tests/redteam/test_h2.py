"""HTTP/2 header injection and downgrade splitting. The upstreams speak HTTP/1.1 only, so the
gateway translates every HTTP/2 request: a CR/LF/NUL in a header name or value, or in :path, would
split the HTTP/1.1 request it writes; `te`, `transfer-encoding`, `connection` and a content-length
that lies about the DATA frames would reframe it; pseudo-header tricks (duplicate :authority, an
absolute URL in :path, :authority contradicting host, a late pseudo-header) would restate the
destination. Each is refused (stream reset, 4xx or GOAWAY) without anything reaching any upstream.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import Conn, H2Client, start_tls, tls_tunnel
from tests.support.topology import ALLOWED

from .common import attack, nothing_reached

pytestmark = attack("h2")

BASE = [(":method", "GET"), (":scheme", "https"), (":authority", "allowed.test"), (":path", "/h2")]


def _send_raw(h2: H2Client, headers: list[tuple[str, str]], body: bytes | None = None) -> int:
    stream = h2.h2.get_next_available_stream_id()
    h2.h2.send_headers(stream, headers, end_stream=body is None)
    if body is not None:
        h2.h2.send_data(stream, body, end_stream=True)
    h2._flush()
    h2.responses[stream] = {"status": None, "headers": [], "body": b"", "done": False, "reset": False}
    return stream


def _attempt(tls: Conn, headers, body: bytes | None = None) -> dict:
    """Send one crafted stream; the outcome (status None when the stream or connection died)."""
    h2 = H2Client(tls)
    stream = _send_raw(h2, headers, body)
    try:
        h2.wait(stream)
    except (ConnectionError, OSError, TimeoutError) as exc:
        return {"status": None, "error": repr(exc)}
    return h2.responses[stream]


def _refused(outcome: dict) -> None:
    assert outcome["status"] in (None, 400, 421), outcome


def _with(**changes) -> list[tuple[str, str]]:
    headers = [(k, changes.pop(k, v)) for k, v in BASE]
    return headers + list(changes.items())


INJECTIONS = {
    "crlf-in-value": BASE + [("x-note", "a\r\nhost: other.test")],
    "lf-in-value": BASE + [("x-note", "a\nhost: other.test")],
    "cr-in-value": BASE + [("x-note", "a\rhost: other.test")],
    "nul-in-value": BASE + [("x-note", "a\x00b")],
    "crlf-in-name": BASE + [("x-note\r\nhost", "other.test")],
    "colon-in-name": BASE + [("host:other.test", "x")],
    "space-in-name": BASE + [("x note", "x")],
    "uppercase-name": BASE + [("Host", "other.test")],
    "crlf-in-path": _with(**{":path": "/h2 HTTP/1.1\r\nhost: other.test\r\n\r\nGET /smuggled"}),
    "crlf-in-method": _with(**{":method": "GET /x HTTP/1.1\r\nhost: other.test\r\n\r\nGET"}),
    "crlf-in-authority": _with(**{":authority": "allowed.test\r\nhost: other.test"}),
    "te-chunked": BASE + [("te", "chunked")],
    "transfer-encoding": BASE + [("transfer-encoding", "chunked")],
    "connection": BASE + [("connection", "keep-alive")],
    "upgrade-h2c": BASE + [("upgrade", "h2c")],
    "http2-settings": BASE + [("http2-settings", "AAMAAABkAARAAAAAAAIAAAAA")],
    "duplicate-authority": BASE + [(":authority", "other.test")],
    "host-contradicts-authority": BASE + [("host", "other.test")],
    "authority-contradicts-host": _with(**{":authority": "other.test"}) + [("host", "allowed.test")],
    "no-authority-other-host": [(":method", "GET"), (":scheme", "https"), (":path", "/h2"), ("host", "other.test")],
    "absolute-url-in-path": _with(**{":path": "https://other.test/h2"}),
    "path-without-slash": _with(**{":path": "other.test/h2"}),
    "late-pseudo-header": [(":method", "GET"), (":scheme", "https"), (":path", "/h2"), ("x-a", "b"),
                           (":authority", "other.test")],
    "unknown-pseudo-header": BASE + [(":host", "other.test")],
    "scheme-http": _with(**{":scheme": "http", ":authority": "allowed.test:80"}),
}


@pytest.mark.parametrize("label", sorted(INJECTIONS))
def test_h2_header_tricks(rt, label):
    with tls_tunnel(rt.gateway, "allowed.test:443", alpn=["h2"]) as tls:
        outcome = _attempt(tls, INJECTIONS[label])
    _refused(outcome)
    nothing_reached(rt.everything())


def test_h2_space_in_path_splits_the_downgraded_request_line(rt):
    """api.test allows GET /ok/** only. `:path: /admin /../ok/x` is judged as /ok/x (the
    `admin ` segment is climbed out of), but written to the HTTP/1.1 upstream as the request line
    `GET /admin /../ok/x HTTP/1.1`: a server that takes the target up to the first space (as the
    request-line grammar says it ends there) serves /admin. A space can never be part of an
    HTTP/1.1 request-target: the stream must be refused and nothing sent."""
    headers = [(":method", "GET"), (":scheme", "https"), (":authority", "api.test"), (":path", "/admin /../ok/x")]
    with tls_tunnel(rt.gateway, "api.test:443", alpn=["h2"]) as tls:
        outcome = _attempt(tls, headers)
    nothing_reached(rt.everything(), context=outcome)
    assert outcome["status"] in (None, 400), outcome


def test_h2_content_length_lies_to_smuggle_a_request(rt):
    """content-length 0 with a DATA frame that is a whole HTTP/1.1 request for another host: a
    gateway that wrote `Content-Length: 0` and then the DATA would smuggle it."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n"
    headers = _with(**{":method": "POST"}) + [("content-length", "0")]
    with tls_tunnel(rt.gateway, "allowed.test:443", alpn=["h2"]) as tls:
        outcome = _attempt(tls, headers, smuggled)
    _refused(outcome)
    nothing_reached(rt.everything())


def test_h2_data_beyond_content_length(rt):
    headers = _with(**{":method": "POST", ":path": "/ok/x"}) + [("content-length", "3")]
    with tls_tunnel(rt.gateway, "allowed.test:443", alpn=["h2"]) as tls:
        outcome = _attempt(tls, headers, b"abc" + b"\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n")
    _refused(outcome)
    nothing_reached(rt.everything())


def test_h2_rapid_reset_sends_nothing_upstream(rt):
    """CVE-2023-44487: HEADERS+RST_STREAM pairs as fast as they can be written, to an allowed
    host. A gateway that starts an upstream request per stream and drops it only later sends
    cancelled requests upstream (it did: ~1,000 of 6,000); here the flood ends in GOAWAY
    ENHANCE_YOUR_CALM and no upstream sees a byte."""
    import h2.errors
    import h2.events

    with tls_tunnel(rt.gateway, "allowed.test:443", alpn=["h2"]) as tls:
        client = H2Client(tls)
        try:
            for _ in range(40):
                for _ in range(25):
                    stream = client.h2.get_next_available_stream_id()
                    client.h2.send_headers(stream, BASE, end_stream=True)
                    client.h2.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                client._flush()
        except OSError:
            pass  # closed by the gateway mid-flood
        goaway = None
        tls.sock.settimeout(5)
        try:
            while goaway is None and (data := tls.sock.recv(65536)):
                goaway = next((e for e in client.h2.receive_data(data)
                               if isinstance(e, h2.events.ConnectionTerminated)), None)
        except OSError:
            pass
    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, goaway
    nothing_reached(rt.everything())


def _transparent_h2(world) -> Conn:
    return start_tls(Conn(world.connect(ALLOWED, 443)), world.gateway, "allowed.test", ["h2"])


@pytest.mark.parametrize("label", ["crlf-in-value", "host-contradicts-authority", "absolute-url-in-path"])
def test_transparent_h2_header_tricks(world, label):
    with _transparent_h2(world) as tls:
        outcome = _attempt(tls, INJECTIONS[label])
    _refused(outcome)
    assert world.touched() == []
