"""Every part of a response to a bound request is redacted, and the gateway's own pages quote
nothing that failed (issue 13, classes 1, 2, 4 and 5 end to end, against an origin that echoes the
credential the way real servers do: tests/credentials/servers.py)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import H2Client, get

from .clients import assert_no_leak, fetch, read_to_end, response_bytes, tls_to
from .conftest import SECRETS

TOKEN = SECRETS["api_token"]


def _raw_exchange(cred, path: str) -> bytes:
    """Everything the client receives for one HTTP/1.1 request, framing included, until close."""
    with tls_to(cred.gateway, "echo.test") as tls:
        tls.send(f"GET {path} HTTP/1.1\r\nHost: echo.test\r\nTE: trailers\r\n\r\n".encode())
        data = b""
        tls.sock.settimeout(10)
        while True:
            try:
                piece = tls.sock.recv(65536)
            except (OSError, TimeoutError):
                break
            if not piece:
                break
            data += piece
            if data.endswith(b"\r\n\r\n") and b"\r\n0\r\n" in data:
                break
    return data


def test_http1_chunked_trailers_are_passed_on_redacted(cred):
    raw = _raw_exchange(cred, "/v1/trailers")
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert b'data: {"ok": true}' in raw
    tail = raw.split(b"\r\n0\r\n", 1)[1]
    assert b"x-echo: [redacted]" in tail.lower(), tail  # the trailer arrives, its value redacted
    assert_no_leak(raw, SECRETS, "chunked trailers")


def test_trailers_reach_an_http2_client_redacted(cred):
    with tls_to(cred.gateway, "echo.test", alpn=["h2"]) as tls:
        client = H2Client(tls)
        sid = client.send("echo.test", "/v1/trailers", extra=[("te", "trailers")])
        client.wait(sid)
        entry = client.responses[sid]
    assert entry["status"] == 200
    trailers = dict(entry["trailers"])
    assert trailers.get("x-echo", "").startswith("[REDACTED]"), entry
    assert_no_leak(repr(entry["trailers"]).encode() + entry["body"], SECRETS, "HTTP/2 trailers")


@pytest.mark.parametrize("kind", ["nocolon", "te", "short", "status"])
def test_a_broken_upstream_head_is_a_502_that_quotes_nothing(cred, kind):
    response = fetch(cred.gateway, "echo.test", f"/v1/badhead?kind={kind}")
    assert response.status == 502, response
    assert_no_leak(response_bytes(response), SECRETS, f"502 page ({kind})")
    assert b"Bearer" not in response.body and b"X-Echo" not in response.body


@pytest.mark.parametrize("kind", ["nocolon", "te", "status"])
def test_a_broken_upstream_head_over_http2_is_the_gateways_page(cred, kind):
    with tls_to(cred.gateway, "echo.test", alpn=["h2"]) as tls:
        client = H2Client(tls)
        sid = client.send("echo.test", f"/v1/badhead?kind={kind}")
        client.wait(sid)
        entry = client.responses[sid]
    assert entry["status"] == 502, entry
    assert client.header(sid, "x-egress-reason") == "upstream_failed"
    assert b"<html" not in entry["body"].lower()  # not mitmproxy's page, which quotes what failed
    assert_no_leak(entry["body"] + repr(entry["headers"]).encode(), SECRETS, f"HTTP/2 502 page ({kind})")


@pytest.mark.parametrize("style", ["php-json", "dotnet-json", "html", "go-html", "upper-hex", "mixed-hex",
                                   "lower-percent", "utf16", "mime"])
def test_framework_escaped_echoes_are_redacted(cred, style):
    response = fetch(cred.gateway, "echo.test", f"/v1/escaped?style={style}")
    assert response.status == 200
    body = response.body.decode("utf-16") if style == "utf16" else response.body.decode("latin-1")
    assert TOKEN not in body
    assert_no_leak(response.body, SECRETS, f"{style} echo")
    assert "[REDACTED]" in body or "*" * 8 in body, body[:300]


def test_a_transfer_coding_other_than_chunked_is_refused_on_a_bound_flow(cred):
    response = fetch(cred.gateway, "echo.test", "/v1/te-gzip")
    assert response.status == 502
    assert response.header("x-egress-reason") == "undecodable_response"
    assert_no_leak(response_bytes(response), SECRETS, "gzip transfer-coding")


def test_trailers_that_must_not_be_trailers_never_reach_an_http2_client(cred):
    """Connection, Content-Length and Host in trailers would make the HTTP/2 message malformed (the
    client's h2 library refuses it) or restate framing and routing."""
    with tls_to(cred.gateway, "echo.test", alpn=["h2"]) as tls:
        client = H2Client(tls)  # validates inbound headers: a connection-specific trailer raises
        sid = client.send("echo.test", "/v1/trailers?forbidden=1", extra=[("te", "trailers")])
        client.wait(sid)
        entry = client.responses[sid]
    names = {k.lower() for k, _ in entry["trailers"]}
    assert "x-echo" in names and not names & {"connection", "content-length", "host"}, entry["trailers"]


def _rss_kib(pid: int) -> int:
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0])


@pytest.mark.parametrize("te", ["cl", "chunked"])
def test_a_decompression_bomb_on_a_bound_rule_stays_within_budget(cred, te):
    """96 MiB of zeros as a few hundred bytes of brotli: refused (known length, decoded whole) or
    cut off (streamed), and the worker never holds more than a budget's worth."""
    from .servers import brotli_bomb

    brotli_bomb()  # made before the clock of the request starts
    pid = cred.gateway.process.pid
    before = _rss_kib(pid)
    with tls_to(cred.gateway, "echo.test") as tls:
        tls.send(f"GET /v1/bomb?te={te} HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n".encode())
        tls.sock.settimeout(20)
        received = read_to_end(tls.sock)
    grown = _rss_kib(pid) - before
    assert len(received) < 80 << 20, len(received)
    if te == "cl":
        assert received.startswith(b"HTTP/1.1 502") and b"response_too_large" in received, received[:300]
    else:
        assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"\r\n0\r\n\r\n")
    assert grown < 200 * 1024, f"the worker grew by {grown} KiB"
    assert any(e.get("reason") == "response_too_large" for e in cred.gateway.audit()[-20:])
