"""Protocol upgrades: only `Upgrade: websocket` is inspected, so h2c in any spelling (or hidden in
a list, a second header, an HTTP2-Settings header alone) and every other protocol (connect-udp,
TLS) is refused; an upstream's unsolicited 101 is killed before any raw byte reaches the sandbox;
a WebSocket upgrade is a request like any other (method, path and destination rules apply)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.e2e.helpers import Conn, assert_refused, build_request, connect_proxy, tls_tunnel, tunnel
from tests.support.topology import ALLOWED

from .common import attack, nothing_reached

pytestmark = attack("upgrade")

WS = [("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Sec-WebSocket-Version", "13"),
      ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")]


@pytest.mark.parametrize("raw", [
    b"Connection: Upgrade\r\nUpgrade: H2c\r\n",
    b"Connection: Upgrade\r\nUpgrade: h2c \r\n",
    b"Connection: Upgrade\r\nUPGRADE: h2c\r\n",
    b"Connection: Upgrade\r\nUpgrade: websocket\r\nUpgrade: h2c\r\n",
    b"Connection: Upgrade\r\nUpgrade: WebSocket,H2C\r\n",
    b"Connection: HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
    b"Connection: Upgrade\r\nUpgrade: connect-udp\r\n",
    b"Connection: Upgrade\r\nUpgrade: TLS/1.3, HTTP/1.1\r\n",
], ids=["H2c", "h2c-trailing-space", "UPGRADE-name", "second-upgrade-header", "list", "http2-settings-alone",
        "connect-udp", "tls"])
def test_upgrade_spellings_in_a_tls_tunnel(rt, raw):
    with tls_tunnel(rt.gateway, "allowed.test:443") as tls:
        tls.send(build_request("GET", "/up", [("Host", "allowed.test")], raw_headers=raw))
        response = tls.read_response()
    assert_refused(response, 400, "upgrade_refused")
    nothing_reached(rt.everything())


def test_h2c_upgrade_on_the_proxy_port(rt):
    with connect_proxy(rt.gateway) as conn:
        response = conn.request("GET", "http://allowed.test/up", [
            ("Host", "allowed.test"), ("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"),
            ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")])
    assert_refused(response, 400, "upgrade_refused")
    nothing_reached(rt.everything())


def _read_all(conn: Conn, wait: float = 3.0) -> bytes:
    data = b""
    conn.sock.settimeout(wait)
    try:
        while chunk := conn.sock.recv(65536):
            data += chunk
    except (OSError, socket.timeout):
        pass
    return data


@pytest.mark.parametrize("asked", ["nothing", "websocket"])
def test_unsolicited_non_websocket_101_is_killed(rt, asked):
    """rogue.test (allowed, plain http) answers every request with `101 Upgrade: h2c` and raw
    bytes: the gateway must not switch the connection into an uninspected tunnel."""
    extra = WS if asked == "websocket" else []
    with connect_proxy(rt.gateway) as conn:
        started = time.monotonic()
        conn.send(build_request("GET", "http://rogue.test/switch", [("Host", "rogue.test")] + extra))
        data = _read_all(conn)
    assert time.monotonic() - started < 3.5
    assert not data.startswith(b"HTTP/1.1 101"), data[:200]
    assert b"RAW-BYTES-AFTER-101" not in data, data[:300]
    nothing_reached(rt.recorders("allowed.test", "other.test", "api.test", "deep.wild.test"))  # rogue.test is allowed


@pytest.mark.parametrize("case", ["denied-path", "denied-method", "other-host"])
def test_websocket_is_judged_like_any_request(rt, case):
    path, method, host = {"denied-path": ("/admin/ws", "GET", "api.test"),
                          "denied-method": ("/ok/ws", "POST", "api.test"),
                          "other-host": ("/ok/ws", "GET", "other.test")}[case]
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        response = tls.request(method, path, [("Host", host)] + WS)
    assert response.status in (403, 421), response.text
    assert response.status != 101
    nothing_reached(rt.everything())


def test_websocket_to_a_denied_path_on_the_proxy_port(rt):
    with connect_proxy(rt.gateway) as conn:
        response = conn.request("GET", "http://api.test/admin/ws", [("Host", "api.test")] + WS)
    assert_refused(response, 403, "path_not_allowed", rule="api")
    nothing_reached(rt.everything())


def test_websocket_in_a_plain_tunnel_to_another_host(rt):
    conn, answer = tunnel(rt.gateway, "allowed.test:80")
    with conn:
        assert answer.status == 200
        response = conn.request("GET", "/ws", [("Host", "other.test")] + WS)
    assert_refused(response, 421, "host_mismatch")
    nothing_reached(rt.everything())


@pytest.mark.parametrize("upgrade", ["h2c", "websocket, h2c"])
def test_transparent_h2c_upgrade(world, upgrade):
    with Conn(world.connect(ALLOWED, 80)) as conn:
        response = conn.request("GET", "/up", [("Host", "allowed.test"), ("Connection", "Upgrade, HTTP2-Settings"),
                                               ("Upgrade", upgrade), ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")])
    assert_refused(response, 400, "upgrade_refused")
    assert world.touched() == []
