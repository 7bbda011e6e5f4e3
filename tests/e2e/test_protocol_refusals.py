"""Spec 6: what the gateway cannot inspect is refused promptly (a short socket timeout proves it
does not wait for a request head that never comes): raw bytes in a tunnel, h2c in every form,
protocol upgrades other than WebSocket, an upstream's unsolicited 101, CONNECT inside a tunnel,
TRACE/TRACK, duplicate or malformed Host headers."""

from __future__ import annotations

import socket
import ssl
import time

import httpx
import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    TIMEOUT,
    ScriptedUpstream,
    assert_refused,
    assert_untouched,
    audit_for,
    build_request,
    client_tls_context,
    connect_proxy,
    curl,
    extra_static_hosts,
    fresh_upstreams,
    gateway,
    tls_tunnel,
    tunnel,
)

SSH_BANNER = b"SSH-2.0-OpenSSH_9.0\r\n"
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2C_UPGRADE = [("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"), ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")]


def _open(gateway, where: str):
    """A connection at one of the three places a sandbox can send bytes: the proxy port itself,
    a plaintext CONNECT tunnel (to port 80) and a TLS tunnel (to port 443)."""
    if where == "proxy-port":
        return connect_proxy(gateway)
    if where == "plain-tunnel":
        conn, answer = tunnel(gateway, "allowed.test:80")
        assert answer.status == 200
        return conn
    return tls_tunnel(gateway, "allowed.test:443")


def _request_target(where: str, path: str) -> str:
    return f"http://allowed.test{path}" if where == "proxy-port" else path


def _refused_promptly_and_closed(conn, reason: str, started: float) -> None:
    response = conn.read_response()
    assert time.monotonic() - started < TIMEOUT, "the refusal was not prompt"
    assert_refused(response, 400, reason)
    assert conn.closed(), "the gateway must close the connection after refusing it"


# --- bytes that are not HTTP ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["plain-tunnel", "tls-tunnel", "proxy-port"])
def test_non_http_bytes_are_400_non_http_then_closed(gateway, upstreams, where):
    with _open(gateway, where) as conn:
        started = time.monotonic()
        conn.send(SSH_BANNER)  # an SSH client speaks first and then waits: nothing else will come
        _refused_promptly_and_closed(conn, "non_http", started)
        client = conn.client
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    lines = [a for a in audit_for(gateway, client, 2) if a["event"] == "connection"]
    assert [(a["decision"], a["reason"], a["status"]) for a in lines] == [("deny", "non_http", 400)]


def test_tls_to_the_proxy_port_is_refused(gateway, upstreams):
    conn = connect_proxy(gateway)
    context = client_tls_context(gateway)
    with pytest.raises((ssl.SSLError, OSError)):
        context.wrap_socket(conn.sock, server_hostname="allowed.test").close()
    conn.close()
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert [a["reason"] for a in audit_for(gateway, conn.client)] == ["non_http"]


# --- h2c ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["proxy-port", "plain-tunnel", "tls-tunnel"])
def test_h2c_prior_knowledge_is_refused(gateway, upstreams, where):
    with _open(gateway, where) as conn:
        started = time.monotonic()
        conn.send(H2_PREFACE)
        _refused_promptly_and_closed(conn, "h2c_refused", started)
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("alpn", [None, ["http/1.1"]])
def test_http2_preface_after_alpn_other_than_h2_is_refused(gateway, upstreams, alpn):
    """TLS whose ALPN did not settle on h2 (none offered, or only http/1.1), then HTTP/2 bytes."""
    with tls_tunnel(gateway, "allowed.test:443", alpn=alpn) as conn:
        started = time.monotonic()
        conn.send(H2_PREFACE)
        _refused_promptly_and_closed(conn, "h2c_refused", started)
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_http2_only_client_gets_http2_by_alpn(gateway, upstreams):
    """httpx with http1=False offers h2 alone: ALPN settles on h2 and the request is ordinary
    HTTP/2 (the gateway translates to the HTTP/1.1 upstream)."""
    with httpx.Client(proxy=gateway.proxy_url, verify=client_tls_context(gateway), http1=False, http2=True) as client:
        response = client.get("https://allowed.test/h2-only")
    assert response.status_code == 200
    assert response.http_version == "HTTP/2"


@pytest.mark.parametrize("where", ["proxy-port", "plain-tunnel", "tls-tunnel"])
@pytest.mark.parametrize("upgrade", ["h2c", "H2C", "websocket, h2c", "h2c, websocket", "HTTP/2.0", "TLS/1.2"])
def test_upgrade_other_than_websocket_is_400(gateway, upstreams, where, upgrade):
    headers = [("Host", "allowed.test"), ("Connection", "Upgrade"), ("Upgrade", upgrade)]
    with _open(gateway, where) as conn:
        started = time.monotonic()
        response = conn.request("GET", _request_target(where, "/up"), headers)
        assert time.monotonic() - started < TIMEOUT
    assert_refused(response, 400, "upgrade_refused")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("where", ["proxy-port", "plain-tunnel", "tls-tunnel"])
def test_h2c_upgrade_request_is_400(gateway, upstreams, where):
    with _open(gateway, where) as conn:
        response = conn.request("GET", _request_target(where, "/h2c"), [("Host", "allowed.test"), *H2C_UPGRADE])
    assert_refused(response, 400, "upgrade_refused")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("where", ["proxy-port", "tls-tunnel"])
def test_http2_settings_header_alone_is_400(gateway, upstreams, where):
    with _open(gateway, where) as conn:
        response = conn.request("GET", _request_target(where, "/h2s"), [("Host", "allowed.test"), H2C_UPGRADE[2]])
    assert_refused(response, 400, "upgrade_refused")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_websocket_upgrade_request_is_forwarded(gateway, upstreams):
    headers = [("Host", "allowed.test"), ("Connection", "Upgrade"), ("Upgrade", "websocket"),
               ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        response = tls.request("GET", "/ws", headers)
    assert response.status == 200  # the recording upstream does not switch; the point is it got it
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/ws"]


# --- an upstream's unsolicited 101 ----------------------------------------------------------

SWITCH_H2C = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nRAW-BYTES-AFTER-101"
SWITCH_WS = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
WS_HEADERS = [("Connection", "Upgrade"), ("Upgrade", "websocket"),
              ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]


@pytest.fixture
def switching_upstreams(upstreams):
    rogue = ScriptedUpstream(f"{upstreams.block}.50", SWITCH_H2C)
    honest = ScriptedUpstream(f"{upstreams.block}.51", SWITCH_WS)
    yield rogue, honest
    rogue.stop()
    honest.stop()


def _read_all(conn) -> bytes:
    data = b""
    try:
        while chunk := conn.sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError, socket.timeout):
        pass
    return data


def test_unsolicited_101_from_upstream_is_killed(start_gateway, switching_upstreams):
    rogue, honest = switching_upstreams
    gateway = start_gateway(
        f"""
        - id: switching
          hosts: [rogue.test, honest.test]
          schemes: [http]
          ports: [{rogue.port}, {honest.port}]
        """,
        extra=extra_static_hosts({"rogue.test": rogue.host, "honest.test": honest.host}),
    )
    rogue_authority = f"rogue.test:{rogue.port}"
    audited = []
    cases = [
        ("absolute-form, no upgrade asked", None, [("Host", rogue_authority)]),
        ("absolute-form, websocket asked", None, [("Host", rogue_authority), *WS_HEADERS]),
        ("plain tunnel, no upgrade asked", rogue_authority, [("Host", rogue_authority)]),
    ]
    for label, connect_to, headers in cases:
        if connect_to is None:
            conn = connect_proxy(gateway)
            target = f"http://{rogue_authority}/switch"
        else:
            conn, answer = tunnel(gateway, connect_to)
            assert answer.status == 200
            target = "/switch"
        with conn:
            started = time.monotonic()
            conn.send(build_request("GET", target, headers))
            data = _read_all(conn)
            assert time.monotonic() - started < TIMEOUT, label
        assert b"101" not in data.split(b"\r\n", 1)[0] and b"RAW-BYTES" not in data, (label, data)
        lines = [a for a in audit_for(gateway, conn.client, 2) if a["event"] == "response"]
        assert [(a["decision"], a["reason"], a["status"]) for a in lines] == [("deny", "unsolicited_upgrade", 502)], (label, lines)
        audited.append((label, lines[0]["host"], lines[0]["port"]))
    assert rogue.connections == len(cases)  # the requests were allowed; only the answers were bad

    # control: a WebSocket upgrade that was asked for and answered as such passes
    with connect_proxy(gateway) as conn:
        authority = f"honest.test:{honest.port}"
        response = conn.request("GET", f"http://{authority}/ws", [("Host", authority), *WS_HEADERS])
    assert (response.status, response.header("Upgrade")) == (101, "websocket")

    # every audit line names the destination whose answer was refused
    assert audited == [(label, "rogue.test", rogue.port) for label, _, _ in cases]


# --- CONNECT inside a tunnel ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["plain-tunnel", "tls-tunnel"])
def test_connect_inside_a_tunnel_is_400(gateway, upstreams, where):
    with _open(gateway, where) as conn:
        response = conn.request("CONNECT", "other.test:443", [("Host", "other.test:443")])
        client = conn.client
    assert response.status == 400, response.text
    assert_untouched(upstreams, "other.test")
    assert_refused(response, 400, "nested_connect")
    assert "nested_connect" in [a["reason"] for a in audit_for(gateway, client, 2)]


# --- methods and Host headers ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["proxy-port", "plain-tunnel", "tls-tunnel"])
@pytest.mark.parametrize("method", ["TRACE", "TRACK", "trace"])
def test_trace_and_track_are_403_method_forbidden(gateway, upstreams, where, method):
    with _open(gateway, where) as conn:
        response = conn.request(method, _request_target(where, "/"), [("Host", "allowed.test")])
        client = conn.client
    if method == "trace" and response.status == 400:
        # a lower-case first request line does not look like HTTP/1 at all: refused as non_http
        assert_refused(response, 400, "non_http")
        assert_untouched(upstreams, *ALL_UPSTREAMS)
        return
    assert_refused(response, 403, "method_forbidden")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    line = [a for a in audit_for(gateway, client, 2) if a["event"] == "request"][-1]
    assert (line["decision"], line["reason"], line["method"].upper()) == ("deny", "method_forbidden", method.upper())


def test_trace_with_curl(gateway, upstreams):
    for url in ("http://allowed.test/t", "https://allowed.test/t"):
        result = curl(gateway, url, "-X", "TRACE")
        assert (result.status, result.header("X-Egress-Reason")) == (403, "method_forbidden"), (url, result)
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("where", ["proxy-port", "plain-tunnel", "tls-tunnel"])
@pytest.mark.parametrize("second", ["allowed.test", "other.test"])
def test_duplicate_host_headers_are_400(gateway, upstreams, where, second):
    with _open(gateway, where) as conn:
        response = conn.request("GET", _request_target(where, "/dup"), [("Host", "allowed.test"), ("Host", second)])
    assert_refused(response, 400, "bad_host_header")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("where", ["proxy-port", "plain-tunnel", "tls-tunnel"])
def test_nul_in_host_header_is_refused(gateway, upstreams, where):
    with _open(gateway, where) as conn:
        conn.send(build_request("GET", _request_target(where, "/nul"), [("Host", "allowed.test\x00.other.test")]))
        try:
            response = conn.read_response()
        except (ConnectionError, OSError):
            response = None  # the parser may drop the connection instead: also a refusal
    if response is not None:
        assert_refused(response, 400, "bad_host_header")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_request_smuggling_framing_is_400(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        tls.send(b"POST /smuggle HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /admin HTTP/1.1\r\nHost: other.test\r\n\r\n")
        response = tls.read_response()
        client = tls.client
    assert response.status == 400, response.text
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert_refused(response, 400, "malformed_request")
    assert "malformed_request" in [a["reason"] for a in audit_for(gateway, client, 2)]
