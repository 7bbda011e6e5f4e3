"""Open connections after a policy change: the attacker opens a connection while it is allowed and
keeps using it after the rule that allowed it was removed (a WebSocket, a WebSocket upgraded on the
proxy port, a passthrough tunnel, an HTTP/2 connection with many streams, connections opened while
the reload happens, a connection whose sandbox lost the rule while another sandbox kept it).

The oracle is at the origins (tests/support/watched.py): after the revocation line, nothing the
attacker sends arrives there, and the origin's side of every revoked connection is closed. Each
gateway here is its own process with a policy the test rewrites and reloads (SIGHUP).
"""

from __future__ import annotations

import base64
import os
import socket
import ssl
import threading

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.e2e.helpers import Conn, H2Client, get, start_tls, tunnel
from tests.support.revocation import BASE_RULES, WAIT, origins, reloadable, without  # noqa: F401

from .common import attack

pytestmark = attack("revocation")


def _websocket(gw, path: str = "/ws/chat"):
    context = ssl.create_default_context(cafile=str(gw.process.ca_cert))
    ws = ws_connect(f"wss://ws.test{path}", proxy=gw.process.proxy_url, ssl=context, open_timeout=WAIT,
                    legacy=True, ping_interval=None, close_timeout=1)
    ws.send("before")
    assert ws.recv(timeout=WAIT) == "echo: before"
    return ws


def test_keep_talking_on_a_websocket_after_its_rule_is_removed(reloadable, origins):
    gw = reloadable()
    ws = _websocket(gw)
    gw.reload(without(BASE_RULES, "ws"))
    gw.revoked(kind="websocket")
    assert origins.ws.wait_closed(1)
    for n in range(5):  # the attacker keeps sending; none of it may reach the origin
        try:
            ws.send(f"after {n}")
        except ConnectionClosed:
            break
    with pytest.raises(ConnectionClosed):
        ws.recv(timeout=WAIT)
    assert origins.ws.received == ["before"]


def _plain_upgrade(gw, target: str) -> tuple[Conn, object]:
    """A `ws://` upgrade as an absolute-form request on the proxy port (no tunnel): wsproto client."""
    from wsproto.connection import Connection, ConnectionType

    sock = socket.create_connection((gw.process.host, gw.process.port), timeout=WAIT)
    conn = Conn(sock)
    key = base64.b64encode(os.urandom(16)).decode()
    conn.send(f"GET {target} HTTP/1.1\r\nHost: ws.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = conn.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    ws = Connection(ConnectionType.CLIENT)
    if conn.buf:
        ws.receive_data(conn.buf)
        conn.buf = b""
    return conn, ws


def _ws_send(conn: Conn, ws, text: str) -> None:
    from wsproto.events import TextMessage

    conn.send(ws.send(TextMessage(data=text)))


def _ws_recv(conn: Conn, ws) -> str | None:
    """The next text message, or None when the connection ended."""
    from wsproto.events import TextMessage

    while True:
        for event in ws.events():
            if isinstance(event, TextMessage):
                return event.data
        try:
            data = conn.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return None
        if not data:
            return None
        ws.receive_data(data)


def test_a_websocket_upgraded_on_the_proxy_port_is_revoked_too(reloadable, origins):
    """No tunnel, no pinned connection: only the upgrade request names the destination."""
    gw = reloadable()
    conn, ws = _plain_upgrade(gw, "http://ws.test/ws/plain")
    _ws_send(conn, ws, "before")
    assert _ws_recv(conn, ws) == "echo: before"
    gw.reload(BASE_RULES.replace('paths: ["/ws/**"]', 'paths: ["/other/**"]'))
    [line] = gw.revoked(kind="websocket")
    assert (line["cause"], line["scheme"], line["path"], line["host"], line["port"]) == (
        "path_not_allowed", "http", "/ws/plain", "ws.test", 80)
    assert origins.ws_plain.wait_closed(1)
    try:
        _ws_send(conn, ws, "after")
    except OSError:
        pass
    assert _ws_recv(conn, ws) is None
    assert origins.ws_plain.received == ["before"]


def test_keep_writing_into_a_passthrough_tunnel_after_its_rule_is_removed(reloadable, origins, pki):
    gw = reloadable()
    conn, answer = tunnel(gw.process, "relay.test:443", timeout=WAIT)
    assert answer.status == 200
    tls = ssl.create_default_context(cafile=str(pki.ca_cert)).wrap_socket(conn.sock, server_hostname="relay.test")
    tls.settimeout(WAIT)
    tls.sendall(b"before\n")
    assert tls.recv(64) == b"before\n"
    gw.reload(without(BASE_RULES, "relay"))
    gw.revoked(kind="passthrough")
    assert origins.relay.wait_closed(1)
    with pytest.raises((OSError, ssl.SSLError)):
        for _ in range(5):
            tls.sendall(b"after\n" * 1000)
            if not tls.recv(64):
                raise ConnectionError("EOF")
    assert origins.relay.received == [b"before\n"]


def test_an_http2_connection_with_many_streams_goes_whole(reloadable, origins):
    gw = reloadable()
    conn, answer = tunnel(gw.process, "gone.test:443", timeout=WAIT)
    assert answer.status == 200
    h2 = H2Client(start_tls(conn, gw.process, "gone.test", alpn=["h2"]))
    streams = [h2.send("gone.test", f"/s{n}") for n in range(8)]
    h2.wait(*streams)
    assert [h2.responses[s]["status"] for s in streams] == [200] * 8
    gw.reload(without(BASE_RULES, "gone"))
    [line] = gw.revoked(kind="tunnel")
    assert (line["host"], line["rule"]) == ("gone.test", "gone")
    assert origins.gone.wait_idle(), "an upstream connection of the HTTP/2 connection stayed open"
    before = origins.gone.opened
    with pytest.raises((ConnectionError, OSError, TimeoutError)):
        h2.wait(h2.send("gone.test", "/after"))
    assert origins.gone.opened == before  # no new upstream connection for the stream after it


def test_connections_opened_while_the_reload_happens(reloadable, origins):
    """Tunnels opened in a tight loop while the rule is removed: whichever side of the swap each
    lands on, none is left reaching the origin (refused at CONNECT, or closed as revoked)."""
    gw = reloadable()
    opened: list[Conn] = []
    stop = threading.Event()
    errors: list[str] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                conn, answer = tunnel(gw.process, "gone.test:443", timeout=WAIT)
                if answer.status != 200:
                    conn.close()
                    continue
                tls = start_tls(conn, gw.process, "gone.test")
                opened.append(tls)
                tls.send(b"GET /during HTTP/1.1\r\nHost: gone.test\r\n\r\n")
            except (OSError, ssl.SSLError, ConnectionError):
                continue
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(repr(exc))

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        gw.wait(lambda: len(opened) >= 3, "three tunnels opened before the reload")
        gw.reload(without(BASE_RULES, "gone"))
        refused_after = len(gw.lines(event="connect", decision="deny"))
        gw.wait(lambda: len(gw.lines(event="connect", decision="deny")) > refused_after + 2,
                "CONNECTs refused after the reload")
    finally:
        stop.set()
        thread.join(WAIT)
    assert errors == []
    assert origins.gone.wait_idle(), f"{origins.gone.open_now} upstream connection(s) to gone.test still open"
    for conn in opened:
        try:
            conn.send(b"GET /after HTTP/1.1\r\nHost: gone.test\r\n\r\n")
            response = conn.read_response()
            while response.body == b"watched: /during\n":  # the answer to the request sent before
                response = conn.read_response()
        except (OSError, ssl.SSLError, ConnectionError):
            continue
        assert response.status == 403, response  # refused: never reached gone.test
    assert b"/after" not in b"".join(p.encode() for p in origins.gone.paths)


def _from(gw, source: str, authority: str) -> Conn:
    sock = socket.create_connection((gw.process.host, gw.process.port), timeout=WAIT, source_address=(source, 0))
    conn = Conn(sock)
    conn.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    answer = conn.read_response(head_only=True)
    assert answer.status == 200, answer
    host = authority.rsplit(":", 1)[0]
    tls = start_tls(conn, gw.process, host)
    assert get(tls, "/first", host).status == 200
    return tls


SANDBOXES = """\
sandboxes:
  - id: ci
    source_ips: [127.0.0.1/32]
    rules: [{ci}]
  - id: default
    rules: [{default}]
"""


def test_a_sandbox_that_lost_a_rule_another_sandbox_kept(reloadable, origins):
    """Rules are per sandbox: the ci sandbox's tunnel goes when ci loses `gone`, although the
    default sandbox now has it (and keeps its own tunnel)."""
    gw = reloadable(extra=SANDBOXES.format(ci="gone, kept", default="kept"))
    ci = _from(gw, "127.0.0.1", "gone.test:443")
    other = _from(gw, "127.0.0.2", "kept.test:443")
    gw.reload(BASE_RULES, extra=SANDBOXES.format(ci="kept", default="kept, gone"))
    [line] = gw.revoked()
    assert (line["client"], line["sandbox"], line["rule"], line["cause"], line["host"]) == (
        ci.client, "ci", "gone", "no_rule", "gone.test")
    assert origins.gone.wait_closed(1)
    assert ci.closed(WAIT)
    assert get(other, "/still", "kept.test").status == 200
    fresh = _from(gw, "127.0.0.2", "gone.test:443")  # the default sandbox may use it now
    assert get(fresh, "/new", "gone.test").status == 200


def test_moving_the_client_into_another_sandbox_revokes_what_the_new_one_lacks(reloadable, origins):
    gw = reloadable(extra=SANDBOXES.format(ci="gone, kept", default="kept"))
    ci = _from(gw, "127.0.0.1", "gone.test:443")
    gw.reload(BASE_RULES, extra=SANDBOXES.format(ci="gone, kept", default="kept").replace(
        "127.0.0.1/32", "127.0.0.9/32"))
    [line] = gw.revoked()
    assert (line["client"], line["sandbox"], line["cause"]) == (ci.client, "default", "no_rule")
    assert origins.gone.wait_closed(1) and ci.closed(WAIT)
