"""What comes back to the sandbox never shows a secret: an upstream that echoes the credential (in
a JSON echo, an error body, response headers, a streamed multi-megabyte body with the value across
chunk boundaries, a compressed body, a WebSocket message, ping or close reason, an HTTP/1.1 reason
phrase) has every form of it replaced by a marker of the same length, so Content-Length stays true.
Compressed bodies the gateway cannot decode are refused (502 undecodable_response)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import time
import zlib

import brotli
import pytest

from tests.e2e.helpers import H2Client, assert_refused, build_request, open_clients
from tests.support.waiting import wait_for

from .clients import assert_length_true, assert_no_leak, fetch, leaks, response_bytes, tls_to
from .conftest import SECRETS
from .servers import stream_body

TOKEN = SECRETS["api_token"]
ENCODINGS = ("raw", "base64", "base64url", "hex", "HEX", "urlencoded", "urlencoded_plus", "basic", "basic_offset1",
             "basic_offset2", "in_blob")


def _redacted(value: str) -> bool:
    return "[REDACTED]" in value


def _check_echo_document(body: bytes) -> dict:
    document = json.loads(body)  # markers keep the JSON intact
    token_forms = document["echoed"]["token"]
    for name in ENCODINGS:
        assert _redacted(token_forms[name]), (name, token_forms[name])
    assert document["url"].startswith("https://")
    return document


def test_echoed_credential_is_redacted_in_every_encoding(cred):
    response = fetch(cred.gateway, "echo.test", "/v1/anything", method="POST", body=b"hello")
    assert response.status == 200
    assert_no_leak(response_bytes(response), SECRETS)
    assert_length_true(response)
    document = _check_echo_document(response.body)
    assert document["data"] == "hello"
    assert ["Host", "echo.test"] in document["headers"]  # what is not secret is left alone
    authorization = dict(document["headers"])["Authorization"]
    assert authorization.startswith("Bearer [REDACTED]") and len(authorization) == len(f"Bearer {TOKEN}")


def test_echo_over_http2_is_redacted(cred):
    with tls_to(cred.gateway, "echo.test", alpn=["h2"]) as tls:
        client = H2Client(tls)
        sid = client.send("echo.test", "/v1/anything/h2")
        client.wait(sid)
        entry = client.responses[sid]
    assert entry["status"] == 200
    assert_no_leak(entry["body"] + repr(entry["headers"]).encode(), SECRETS)
    _check_echo_document(entry["body"])
    length = client.header(sid, "content-length")
    assert length is None or int(length) == len(entry["body"])


def test_query_credential_echo_is_redacted(cred):
    response = fetch(cred.gateway, "qecho.test", "/v1/anything?x=1")
    assert response.status == 200
    assert_no_leak(response_bytes(response), SECRETS)
    assert_length_true(response)
    document = json.loads(response.body)
    assert _redacted(document["args"]["api_key"]) and _redacted(document["raw_query"])
    assert document["args"]["x"] == "1"


def test_error_body_with_the_token_is_redacted(cred):
    response = fetch(cred.gateway, "echo.test", "/v1/error")
    assert response.status == 401
    assert_no_leak(response_bytes(response), SECRETS)
    assert_length_true(response)
    assert response.text.startswith("401 Unauthorized: the token [REDACTED]")
    assert _redacted(response.header("WWW-Authenticate"))
    assert _redacted(response.header("X-Debug-Token"))


@pytest.mark.parametrize("style", ["quote", "quote_plus"])
def test_url_encoding_that_keeps_slashes_is_redacted(cred, style):
    """`urllib.parse.quote(token)` (safe="/" by default) is the most common URL-encoding there is."""
    response = fetch(cred.gateway, "echo.test", f"/v1/encoded?style={style}")
    assert response.status == 200
    assert "/" in TOKEN
    assert_no_leak(response_bytes(response), SECRETS)
    assert_length_true(response)


@pytest.mark.parametrize("host, server", [("echo.test", "echo"), ("mirror.test", "mirror")],
                         ids=["bound-host", "unbound-host"])
def test_response_headers_are_redacted_for_every_flow(cred, host, server):
    response = fetch(cred.gateway, host, "/v1/headers")
    assert response.status == 200
    assert len(cred.servers[server].requests) == 1
    assert_no_leak(response_bytes(response), SECRETS)
    for name in ("X-Echo-Token", "X-Echo-Base64", "X-Echo-Base64url", "Set-Cookie", "Location", "X-Basic"):
        assert _redacted(response.header(name)), (name, response.header(name))
    hexes = response.headers_all("X-Echo-Hex")
    assert len(hexes) == 2 and all(_redacted(v) for v in hexes)
    assert response.header("Set-Cookie").endswith("; Secure")
    assert response.body == b"headers only\n"


@pytest.mark.parametrize("size, chunk, te", [
    (3_000_000, 65536, "cl"),
    (2_000_000, 10007, "chunked"),
    (300_000, 4093, "cl"),  # below stream_large_bodies
], ids=["3MB-content-length", "2MB-chunked", "300kB"])
def test_streamed_body_with_the_secret_across_chunk_boundaries(cred, size, chunk, te):
    started = time.monotonic()
    response = fetch(cred.gateway, "echo.test", f"/v1/stream?size={size}&chunk={chunk}&te={te}", timeout=20)
    assert response.status == 200
    body = response.body
    assert len(body) == size
    if te == "cl":
        assert int(response.header("Content-Length")) == size
    original, planted = stream_body(size, chunk, TOKEN)
    assert len(planted) > 10
    expected = bytearray(original)
    for start, end in planted:
        assert body[start:start + len(b"[REDACTED]")] == b"[REDACTED]", (start, body[start - 5:end + 5])
        expected[start:end] = body[start:end]
    assert body == bytes(expected), "bytes outside the planted secrets changed"
    assert_no_leak(body, SECRETS, "streamed body")
    assert time.monotonic() - started < 15


def _decoded(response) -> bytes:
    encoding = (response.header("Content-Encoding") or "identity").lower()
    return {"identity": lambda b: b, "gzip": gzip.decompress, "deflate": zlib.decompress,
            "br": brotli.decompress}[encoding](response.body)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_compressed_response_is_decoded_and_redacted(cred, encoding):
    response = fetch(cred.gateway, "echo.test", f"/v1/gzip?enc={encoding}")
    assert response.status == 200
    assert_length_true(response)
    body = _decoded(response)
    assert len(body) == int(response.header("X-Plain-Length"))
    assert_no_leak(response_bytes(response), SECRETS, "raw response")
    assert_no_leak(body, SECRETS, "decoded body")
    _check_echo_document(body)


def test_large_compressed_response_is_redacted_or_refused(cred):
    """More than stream_large_bodies (1 MB) even compressed: still never the secret."""
    response = fetch(cred.gateway, "echo.test", "/v1/gzip?enc=gzip&pad=3000000", timeout=20)
    assert_no_leak(response_bytes(response), SECRETS, "raw response")
    if response.status == 502:
        assert_refused(response, 502, "undecodable_response")
        return
    assert response.status == 200
    assert_length_true(response)
    assert_no_leak(_decoded(response), SECRETS, "decoded body")


def _leading_document(body: bytes) -> bytes:
    """The echo's JSON document at the start of a padded body (`/v1/gzip?pad=`)."""
    _, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))
    return body[:end]


def _large_echo_body() -> bytes:
    """A request body the echo sends back inside its JSON: 1.2 MB, several of the pieces a large
    body is sent to the client in (addons/http_stream.py SEND_PIECE), the same bytes checkable after."""
    return bytes(0x41 + (i * 7919 % 26) for i in range(1_200_000))


def test_a_large_bound_response_arrives_whole_in_pieces_over_http1(cred):
    body = _large_echo_body()
    response = fetch(cred.gateway, "echo.test", "/v1/anything/large", method="POST", body=body,
                     headers=[("Content-Type", "text/plain")], timeout=30)
    assert response.status == 200
    assert_length_true(response)
    assert_no_leak(response_bytes(response), SECRETS)
    document = _check_echo_document(response.body)
    assert document["data"].encode() == body  # every piece, in order


def test_a_large_bound_response_arrives_whole_in_pieces_over_http2(cred):
    with tls_to(cred.gateway, "echo.test", alpn=["h2"], timeout=30) as tls:
        client = H2Client(tls)
        sid = client.send("echo.test", "/v1/gzip?enc=identity&pad=1500000")
        client.wait(sid, timeout=30)
        entry = client.responses[sid]
    assert entry["status"] == 200 and not entry["reset"]
    assert_no_leak(entry["body"] + repr(entry["headers"]).encode(), SECRETS)
    assert len(entry["body"]) == int(client.header(sid, "x-plain-length"))
    _check_echo_document(_leading_document(entry["body"]))
    assert entry["body"].endswith(b"\n") and b"\nend " in entry["body"][-200:]


def test_a_secret_past_the_first_pieces_of_a_large_response_is_redacted(cred):
    response = fetch(cred.gateway, "echo.test", "/v1/gzip?enc=identity&pad=1500000", timeout=30)
    assert response.status == 200
    assert_length_true(response)
    assert len(response.body) == int(response.header("X-Plain-Length"))
    assert_no_leak(response_bytes(response), SECRETS)
    _check_echo_document(_leading_document(response.body))
    tail = response.body[-200:]
    assert b"\nend " in tail and _redacted(tail.decode()), tail  # the last secret, 1.5 MB in


@pytest.mark.parametrize("path", ["/v1/gzip?enc=x-unknown", "/v1/gzip?enc=broken-gzip"])
def test_undecodable_compressed_response_is_refused(cred, path):
    response = fetch(cred.gateway, "echo.test", path)
    assert_refused(response, 502, "undecodable_response")
    assert_no_leak(response_bytes(response), SECRETS)
    assert len(cred.echo.requests) == 1


class WebSocketClient:
    """wsproto over a TLS tunnel to echo.test, after a hand-written upgrade request."""

    def __init__(self, cred):
        from wsproto.connection import Connection, ConnectionType

        self.tls = tls_to(cred.gateway, "echo.test")
        key = base64.b64encode(os.urandom(16)).decode()
        self.tls.send(build_request("GET", "/v1/ws", [("Host", "echo.test"), ("Upgrade", "websocket"),
                                                       ("Connection", "Upgrade"), ("Sec-WebSocket-Key", key),
                                                       ("Sec-WebSocket-Version", "13")]))
        self.answer = self.tls.read_response(head_only=True)
        assert self.answer.status == 101, (self.answer, self.tls.buf)
        self.ws = Connection(ConnectionType.CLIENT)
        self.leftover, self.tls.buf = self.tls.buf, b""
        self.pings: list[bytes] = []

    def send_text(self, text: str) -> None:
        from wsproto.events import TextMessage

        self.tls.send(self.ws.send(TextMessage(data=text)))

    def receive(self, messages: int = 0, close: bool = False, pings: int = 0,
                timeout: float = 5) -> tuple[list[bytes], object]:
        """Read until `messages` whole messages (text or binary, as bytes), `pings` pings (payloads go
        to self.pings) or a close arrive."""
        from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

        received, pending, closed = [], b"", None
        deadline = time.monotonic() + timeout
        while ((len(received) < messages or (close and closed is None) or len(self.pings) < pings)
               and time.monotonic() < deadline):
            data, self.leftover = self.leftover or self.tls.sock.recv(65536), b""
            if not data:
                break
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, CloseConnection):
                    closed = event
                elif isinstance(event, Ping):
                    self.pings.append(bytes(event.payload))
                elif isinstance(event, (TextMessage, BytesMessage)):
                    pending += event.data.encode() if isinstance(event, TextMessage) else bytes(event.data)
                    if event.message_finished:
                        received.append(pending)
                        pending = b""
        return received, closed

    def close(self) -> None:
        self.tls.close()


def test_websocket_messages_from_the_upstream_are_redacted(cred):
    client = WebSocketClient(cred)
    try:
        client.send_text("hello")
        received, _ = client.receive(messages=2)
    finally:
        client.close()
    assert len(received) == 2, received
    text, binary = received
    assert text.startswith(b"you said 'hello'; your token is [REDACTED]"), text
    assert binary.startswith(b"binary [REDACTED]"), binary
    for message in received:
        assert_no_leak(message, SECRETS, "WebSocket message")
    [handshake] = cred.echo.requests
    assert handshake.header_all("authorization") == [f"Bearer {TOKEN}"]


def test_websocket_close_reason_from_the_upstream_is_redacted(cred):
    client = WebSocketClient(cred)
    try:
        client.send_text("close please")
        _, closed = client.receive(close=True)
    finally:
        client.close()
    assert closed is not None, "no close frame arrived"
    assert closed.code == 4001
    assert_no_leak(closed.reason or "", SECRETS, "WebSocket close reason")


def test_websocket_ping_payload_from_the_upstream_is_redacted(cred):
    client = WebSocketClient(cred)
    try:
        client.send_text("ping please")
        client.receive(pings=1)
    finally:
        client.close()
    assert client.pings, "no ping arrived"
    assert client.pings[0].startswith(b"ping ")
    # the gateway has logged all it will about this connection once it has finished with it
    wait_for(lambda: client.tls.client not in open_clients(cred.gateway), what="the WebSocket's client disconnect",
             detail=cred.gateway.log)
    problems = {}
    for where, data in (("ping payload the sandbox got", b"".join(client.pings)),
                        ("gateway log", cred.gateway.log_path.read_bytes())):
        found = {name: leaks(data, value) for name, value in SECRETS.items()}
        problems.update({f"{where}: {name}": hits[:2] for name, hits in found.items() if hits})
    assert not problems, problems


def test_reason_phrase_with_the_token_is_redacted(cred):
    """An upstream's HTTP/1.1 reason phrase goes to an HTTP/1.1 client as it is: part of the head."""
    response = fetch(cred.gateway, "echo.test", "/v1/reason")
    assert response.status == 401
    assert response.body == b"see the status line\n"
    assert_no_leak(response.reason, SECRETS, "status line")
