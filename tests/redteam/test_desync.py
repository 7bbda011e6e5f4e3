"""Desynchronising the origin (issue 14): a body the origin does not read, read as the next request.

The origin (tests/support/lenient_origin.py) ignores bodies on GET/HEAD/OPTIONS/DELETE and under
/static/, answers /early before reading a body, sends interim 1xx responses on /interim/N, and acts
on leftover bytes only when the next bytes arrive: exactly the timing an attacker hopes for. Every
body hides a request for `other.test` (no rule) at `/smuggled`. The oracles: for methods that define
no body the hidden request never reaches the origin at all; for every method, no answer the sandbox
reads is ever the hidden request's, and each answer belongs to the request it follows.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import H2Client, build_request, connect_proxy, extra_static_hosts, shared_gateway, tls_tunnel
from tests.support.lenient_origin import LenientOrigin

from .common import attack, reason_of, status_of

pytestmark = attack("smuggling")

LAST_OCTET = 111  # in the session block
RULES = """
- id: lenient
  hosts: [lenient.test]
  schemes: [https, http]
  methods: [GET, HEAD, OPTIONS, DELETE, POST, PUT, PATCH]
- id: search
  hosts: [search.test]
  methods: [GET, DELETE, POST]
  allow_body: true
"""
HIDDEN = b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n"
HIDDEN_POST = b"POST /smuggled HTTP/1.1\r\nHost: other.test\r\nContent-Length: 4\r\n\r\nwipe"


@pytest.fixture(scope="module")
def desync(tmp_path_factory, upstreams, pki):
    address = f"{upstreams.block}.{LAST_OCTET}"
    cert, key = pki.issue(["lenient.test", "search.test"], [address], stem="redteam-lenient")
    origin = LenientOrigin(address, 443, cert, key)
    plain = LenientOrigin(address, 80)
    extra = extra_static_hosts({"lenient.test": address, "search.test": address})
    gateway = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name="redteam-desync")
    yield gateway, origin, plain
    gateway.stop()
    origin.stop()
    plain.stop()


@pytest.fixture
def lenient(desync):
    gateway, origin, plain = desync
    origin.reset()
    plain.reset()
    return gateway, origin, plain


def _hidden_executed(origin: LenientOrigin) -> bool:
    return any(e.path == "/smuggled" or e.host == "other.test" for e in origin.executed)


def _assert_own_answers(pairs) -> None:
    for (method, host, path), response in pairs:
        assert response is not None and b"/smuggled" not in response.body and b"other.test" not in response.body, (
            "a hidden request's answer reached the sandbox", response)
        if method != "HEAD" and response.status == 200:
            assert response.text == f"{method} {host} {path}", (method, path, response)


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


FRAMINGS = {
    "content-length": lambda body: ([("Content-Length", str(len(body)))], body),
    "chunked": lambda body: ([("Transfer-Encoding", "chunked")], _chunked(body)),
    "CHUNKED": lambda body: ([("transfer-encoding", "CHUNKED")], _chunked(body)),
    "content-length-padded": lambda body: ([("Content-Length", f"0{len(body)}")], body),
}


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "DELETE", "get"])
@pytest.mark.parametrize("framing", sorted(FRAMINGS))
@pytest.mark.parametrize("hidden", [HIDDEN, HIDDEN_POST], ids=["get", "post"])
def test_a_body_on_a_bodyless_method_never_reaches_the_origin(lenient, method, framing, hidden):
    gateway, origin, _ = lenient
    headers, body = FRAMINGS[framing](hidden)
    with tls_tunnel(gateway, "lenient.test:443") as tls:
        tls.send(build_request(method, "/page", [("Host", "lenient.test"), *headers]) + body)
        try:
            response = tls.read_response(method=method.upper())
        except (ConnectionError, OSError):
            response = None
    assert response is None or status_of(response) == 400, response
    assert origin.executed == [] and origin.connections == 0


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])
def test_explicit_plain_http_get_with_a_body(lenient, version):
    gateway, _, plain = lenient
    with connect_proxy(gateway) as conn:
        conn.send(f"GET http://lenient.test/page {version}\r\nHost: lenient.test\r\nContent-Length: {len(HIDDEN)}"
                  f"\r\n\r\n".encode() + HIDDEN)
        response = conn.read_response()
    assert status_of(response) == 400 and reason_of(response) == "unexpected_body"
    assert plain.connections == 0


@pytest.mark.parametrize("path, method", [("/static/app.js", "POST"), ("/static/logo.png", "PUT"),
                                          ("/early", "POST"), ("/static/x", "PATCH")])
@pytest.mark.parametrize("hidden", [HIDDEN, HIDDEN_POST], ids=["get", "post"])
def test_an_ignored_post_body_never_answers_a_later_request(lenient, path, method, hidden):
    gateway, origin, _ = lenient
    with tls_tunnel(gateway, "lenient.test:443") as tls:
        first = tls.request(method, path, [("Host", "lenient.test")], hidden)
        pairs = [((method, "lenient.test", path), first)]
        for follow in ("/a", "/b", "/c"):
            pairs.append((("GET", "lenient.test", follow), tls.request("GET", follow, [("Host", "lenient.test")])))
    _assert_own_answers(pairs[1:])


def test_pipelined_follow_up_in_the_same_segment(lenient):
    """The follow-up request is in the same TCP write as the body: it cannot be read before the
    first exchange ends, and never gets the hidden request's answer."""
    gateway, origin, _ = lenient
    with tls_tunnel(gateway, "lenient.test:443") as tls:
        tls.send(build_request("POST", "/static/x", [("Host", "lenient.test")], HIDDEN)
                 + build_request("GET", "/next", [("Host", "lenient.test")]))
        first = tls.read_response(method="POST")
        second = tls.read_response()
    _assert_own_answers([(("POST", "lenient.test", "/static/x"), first), (("GET", "lenient.test", "/next"), second)])


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_allow_body_still_never_hands_the_hidden_answer_on(lenient, method):
    gateway, origin, _ = lenient
    with tls_tunnel(gateway, "search.test:443") as tls:
        pairs = [((method, "search.test", "/_search"), tls.request(method, "/_search", [("Host", "search.test")], HIDDEN))]
        for follow in ("/x", "/y"):
            pairs.append((("GET", "search.test", follow), tls.request("GET", follow, [("Host", "search.test")])))
    _assert_own_answers(pairs)


@pytest.mark.parametrize("count", [1, 2, 16])
def test_interim_responses_never_shift_the_answers(lenient, count):
    gateway, origin, _ = lenient
    with tls_tunnel(gateway, "lenient.test:443") as tls:
        pairs = [(("GET", "lenient.test", f"/interim/{count}"),
                  tls.request("GET", f"/interim/{count}", [("Host", "lenient.test")]))]
        pairs.append((("GET", "lenient.test", "/next"), tls.request("GET", "/next", [("Host", "lenient.test")])))
    _assert_own_answers(pairs)
    assert status_of(pairs[0][1]) == 200


def test_an_interim_flood_is_bounded(lenient):
    gateway, origin, _ = lenient
    with tls_tunnel(gateway, "lenient.test:443") as tls:
        response = tls.request("GET", "/interim/1000", [("Host", "lenient.test")])
    assert status_of(response) == 502


def _h2_stream(gateway, method: str, chunks: list[bytes], extra=(), trailers=()) -> dict:
    client = H2Client(tls_tunnel(gateway, "lenient.test:443", alpn=["h2"]))
    sid = client.h2.get_next_available_stream_id()
    client.h2.send_headers(sid, [(":method", method), (":scheme", "https"), (":authority", "lenient.test"),
                                 (":path", "/page"), *extra], end_stream=not chunks and not trailers)
    for i, chunk in enumerate(chunks):
        client.h2.send_data(sid, chunk, end_stream=i == len(chunks) - 1 and not trailers)
    if trailers:
        client.h2.send_headers(sid, list(trailers), end_stream=True)
    client._flush()
    client.responses[sid] = {"status": None, "headers": [], "body": b"", "trailers": [], "done": False, "reset": False}
    try:
        client.wait(sid)
    finally:
        client.conn.close()
    return client.responses[sid]


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "DELETE"])
@pytest.mark.parametrize("chunks", [[HIDDEN], [b"", HIDDEN], [b"G", HIDDEN[1:]], [b"\r\n"]],
                         ids=["whole", "empty-first", "split", "crlf"])
def test_http2_bodies_on_bodyless_methods_never_reach_the_origin(lenient, method, chunks):
    gateway, origin, _ = lenient
    response = _h2_stream(gateway, method, chunks)
    assert response["status"] == 400 or response["reset"], response
    assert origin.executed == [] and origin.connections == 0


def test_http2_head_that_declares_a_length_it_never_sends(lenient):
    gateway, origin, _ = lenient
    response = _h2_stream(gateway, "GET", [], extra=[("content-length", str(len(HIDDEN)))])
    assert response["status"] == 400 or response["reset"], response
    assert origin.connections == 0


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "DELETE"])
@pytest.mark.parametrize("chunks", [[], [b""]], ids=["no-data", "empty-data"])
def test_http2_trailers_alone_are_a_body(lenient, method, chunks):
    """Review finding: HEADERS, no DATA, then trailers. Translated to HTTP/1.1 that is a chunked body
    whose trailer block an origin ignoring the body reads as the next request."""
    gateway, origin, _ = lenient
    response = _h2_stream(gateway, method, chunks, trailers=[("x-smuggle", "GET /smuggled HTTP/1.1")])
    assert response["status"] == 400 or response["reset"], response
    assert origin.executed == [] and origin.connections == 0
