"""Revocation reaches open connections (issue 14 part 4): after a reload, every established
connection is judged again by the new policy, and the ones it no longer allows are closed, at both
ends, with one audit line (`event: connection`, `reason: revoked`) and a metric.

Real gateway processes, real TLS, real origins that say when their side of a connection closed
(tests/support/watched.py), real clients: the `websockets` library through the proxy, raw TLS
sockets through CONNECT (a passthrough tunnel carries the client's own TLS to the origin's own
certificate). Every wait is on an event: the reload's audit line, the revocation's audit line, an
EOF at the client, a close at the origin.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.e2e.helpers import Conn, get, tls_tunnel, tunnel
from tests.support.gateway import free_port
from tests.support.revocation import BASE_RULES, WAIT, origins, reloadable, without  # noqa: F401

pytestmark = pytest.mark.e2e


def open_websocket(gw, path: str = "/ws/chat"):
    context = ssl.create_default_context(cafile=str(gw.process.ca_cert))
    ws = ws_connect(f"wss://ws.test{path}", proxy=gw.process.proxy_url, ssl=context, open_timeout=WAIT, legacy=True,
                    ping_interval=None, close_timeout=1)
    ws.send("hello")
    assert ws.recv(timeout=WAIT) == "echo: hello"
    host, port = ws.socket.getsockname()[:2]
    ws.egress_client = f"{host}:{port}"  # as the audit log names it (read now: the socket may close)
    return ws


def client_of(ws) -> str:
    return ws.egress_client


def assert_websocket_closed(ws) -> None:
    """The gateway closed the client's side: the next receive ends (no echo, no hang)."""
    with pytest.raises(ConnectionClosed):
        ws.send("after the reload")
        ws.recv(timeout=WAIT)


def open_passthrough(gw, pki) -> Conn:
    conn, answer = tunnel(gw.process, "relay.test:443", timeout=WAIT)
    assert answer.status == 200, answer
    context = ssl.create_default_context(cafile=str(pki.ca_cert))  # the origin's own CA: relayed unread
    tls = context.wrap_socket(conn.sock, server_hostname="relay.test")
    tls.settimeout(WAIT)
    relayed = Conn(tls)
    relayed.client = conn.client
    relayed.send(b"ping 1\n")
    assert relayed.read_exactly(7) == b"ping 1\n"
    return relayed


def open_tunnel(gw, host: str) -> Conn:
    conn = tls_tunnel(gw.process, f"{host}:443")
    response = get(conn, "/first", host)
    assert response.status == 200 and response.body == b"watched: /first\n", response
    return conn


def line_of(lines: list[dict], client: str) -> dict:
    found = [e for e in lines if e["client"] == client]
    assert len(found) == 1, lines
    return found[0]


# --- each kind of connection, closed when the new policy no longer allows it -------------------------


def test_a_websocket_whose_host_is_removed_is_closed_at_both_ends(reloadable, origins):
    gw = reloadable()
    ws = open_websocket(gw)
    client = client_of(ws)
    gw.reload(without(BASE_RULES, "ws"))
    line = line_of(gw.revoked(kind="websocket"), client)
    assert (line["decision"], line["status"], line["rule"], line["cause"]) == ("deny", None, "ws", "no_rule")
    assert (line["host"], line["port"], line["address"], line["mode"]) == (
        "ws.test", 443, origins.addresses["ws.test"], "regular")
    assert (line["method"], line["path"], line["scheme"]) == ("GET", "/ws/chat", "https")
    assert "revoked" in line["message"] and "no rule allows" in line["message"]
    assert origins.ws.wait_closed(1), "the origin's side of the WebSocket stayed open"
    assert_websocket_closed(ws)
    assert origins.ws.opened == 1


def test_a_websocket_opened_under_a_path_rule_that_was_narrowed_is_closed(reloadable, origins):
    gw = reloadable()
    ws = open_websocket(gw, "/ws/chat")
    tunnel_conn = open_tunnel(gw, "kept.test")
    narrowed = BASE_RULES.replace('paths: ["/ws/**"]', 'paths: ["/api/**"]')
    gw.reload(narrowed)
    line = line_of(gw.revoked(kind="websocket"), client_of(ws))
    assert (line["rule"], line["cause"], line["path"]) == ("ws", "path_not_allowed", "/ws/chat")
    assert origins.ws.wait_closed(1)
    assert_websocket_closed(ws)
    # the host is still allowed: a new WebSocket on an allowed path works; the kept.test tunnel is untouched
    again = open_websocket(gw, "/api/v1")
    again.close()
    assert get(tunnel_conn, "/after", "kept.test").status == 200
    assert [e["kind"] for e in gw.lines(reason="revoked")] == ["websocket"]


def test_a_passthrough_tunnel_is_closed_at_both_ends(reloadable, origins, pki):
    gw = reloadable()
    relayed = open_passthrough(gw, pki)
    gw.reload(without(BASE_RULES, "relay"))
    line = line_of(gw.revoked(kind="passthrough"), relayed.client)
    assert (line["rule"], line["cause"], line["host"], line["port"]) == ("relay", "no_rule", "relay.test", 443)
    assert origins.relay.wait_closed(1), "the origin's side of the passthrough tunnel stayed open"
    assert relayed.closed(WAIT)


def test_a_passthrough_tunnel_whose_host_is_now_only_inspected_is_closed(reloadable, origins, pki):
    """Relayed unread was what the rule allowed; the new one wants every request seen: a new tunnel
    would be intercepted, so the unread one goes (cause `passthrough_withdrawn`)."""
    gw = reloadable()
    relayed = open_passthrough(gw, pki)
    gw.reload(BASE_RULES.replace("  inspect: false\n", "  paths: ['/simple/**']\n"))
    line = line_of(gw.revoked(kind="passthrough"), relayed.client)
    assert (line["rule"], line["cause"]) == ("relay", "passthrough_withdrawn")
    assert origins.relay.wait_closed(1)
    assert relayed.closed(WAIT)


def test_a_kept_alive_tunnel_whose_host_is_gone_is_closed_and_one_whose_paths_changed_is_not(reloadable, origins):
    gw = reloadable()
    gone = open_tunnel(gw, "gone.test")
    kept = open_tunnel(gw, "kept.test")
    narrowed = without(BASE_RULES, "gone").replace("  hosts: [kept.test]\n", "  hosts: [kept.test]\n  paths: ['/ok/**']\n")
    gw.reload(narrowed)
    line = line_of(gw.revoked(kind="tunnel"), gone.client)
    assert (line["rule"], line["cause"], line["host"]) == ("gone", "no_rule", "gone.test")
    assert origins.gone.wait_closed(1), "the origin's side of the revoked tunnel stayed open"
    assert gone.closed(WAIT)
    # the host is still allowed: the tunnel stays; each request is judged by the new paths
    refused = get(kept, "/first", "kept.test")
    assert (refused.status, refused.egress_reason) == (403, "path_not_allowed")
    assert get(kept, "/ok/1", "kept.test").status == 200
    assert origins.kept.open_now == 1 and origins.kept.closed == 0
    assert len(gw.lines(reason="revoked")) == 1


# --- what must not be closed ------------------------------------------------------------------------


def test_a_reload_that_changes_nothing_or_still_allows_everything_closes_nothing(reloadable, origins, pki):
    gw = reloadable()
    ws = open_websocket(gw)
    relayed = open_passthrough(gw, pki)
    kept = open_tunnel(gw, "kept.test")
    gw.process.process.send_signal(signal.SIGHUP)  # the same file: not even a reload
    # a real change that still allows every open connection (a new rule, a rule renamed)
    gw.reload(BASE_RULES.replace("- id: gone", "- id: gone-renamed") + "- id: extra\n  hosts: [other.test]\n")
    assert len(gw.lines(event="policy_reload", result="ok")) == 1  # the unchanged SIGHUP reloaded nothing
    ws.send("still")
    assert ws.recv(timeout=WAIT) == "echo: still"
    relayed.send(b"ping 2\n")
    assert relayed.read_exactly(7) == b"ping 2\n"
    assert get(kept, "/still", "kept.test").status == 200
    assert [e for e in gw.process.audit() if e.get("reason") == "revoked"] == []
    assert (origins.ws.closed, origins.relay.closed, origins.kept.closed) == (0, 0, 0)
    ws.close()


def test_report_mode_keeps_what_it_would_revoke_and_says_so(reloadable, origins, pki):
    """Report mode lets through what the allowlist would refuse: an open connection the new policy
    would revoke stays open, logged `would_deny` (`reason: revoked`, `cause`), so the team sees what
    enforcing would cut."""
    gw = reloadable()
    ws = open_websocket(gw)
    relayed = open_passthrough(gw, pki)
    gw.reload(without(BASE_RULES, "ws", "relay"), extra="mode: report\n")
    lines = gw.revoked(2, decision="would_deny")
    assert sorted((e["kind"], e["rule"], e["cause"], e["status"]) for e in lines) == [
        ("passthrough", "relay", "no_rule", None), ("websocket", "ws", "no_rule", None)]
    ws.send("still")
    assert ws.recv(timeout=WAIT) == "echo: still"
    relayed.send(b"ping 2\n")
    assert relayed.read_exactly(7) == b"ping 2\n"
    assert gw.lines(reason="revoked", decision="deny") == []
    ws.close()


# --- the metric ------------------------------------------------------------------------------------------


def test_revocations_are_counted_by_kind(reloadable, origins, pki):
    metrics = f"127.0.0.1:{free_port()}"
    gw = reloadable(args=["--metrics", metrics])
    ws = open_websocket(gw)
    relayed = open_passthrough(gw, pki)
    gone = open_tunnel(gw, "gone.test")
    gw.reload(without(BASE_RULES, "ws", "relay", "gone"))
    gw.revoked(3)
    assert origins.ws.wait_closed(1) and origins.relay.wait_closed(1) and origins.gone.wait_closed(1)
    text = urllib.request.urlopen(gw.metrics_url, timeout=WAIT).read().decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("egress_") and not line.startswith("#")}
    for kind, expected in (("websocket", 1), ("passthrough", 1), ("tunnel", 1), ("tcp", 0), ("http", 0)):
        assert samples[f'egress_revoked_connections_total{{kind="{kind}"}}'] == expected, kind
    assert samples['egress_connections_total{decision="deny",mode="regular",reason="revoked"}'] == 3
    for conn in (relayed, gone):
        assert conn.closed(WAIT)
    assert_websocket_closed(ws)
    json.dumps(samples)  # the scrape parsed


# --- requests in flight (review finding: an endless upload outlived the rule) -------------------------


def _start_upload(sock_conn: Conn, target: str, host: str) -> None:
    sock_conn.send(f"POST {target} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
                   "Content-Type: application/octet-stream\r\n\r\n".encode() + b"10\r\n" + b"x" * 16 + b"\r\n")
    answer = sock_conn.read_response()  # this origin answers at the head and goes on reading
    assert answer.status == 200, answer


def test_an_upload_in_flight_on_the_proxy_port_is_closed_when_its_host_is_removed(reloadable, origins):
    gw = reloadable()
    conn = Conn(socket.create_connection((gw.process.host, gw.process.port), timeout=WAIT))
    _start_upload(conn, "http://kept.test/upload", "kept.test")
    assert origins.kept_plain.wait_opened(1)
    gw.reload(without(BASE_RULES, "kept"))
    line = line_of(gw.revoked(kind="request"), conn.client)
    assert (line["rule"], line["cause"], line["method"], line["path"]) == ("kept", "no_rule", "POST", "/upload")
    assert origins.kept_plain.wait_closed(1), "the upload's upstream stayed open"
    assert conn.closed(WAIT)


def test_an_upload_in_flight_in_a_tunnel_is_closed_when_its_path_is_no_longer_allowed(reloadable, origins):
    """The tunnel's host stays allowed, so the tunnel would stay; the request in flight on it would
    not be allowed now, so the connection carrying it is closed."""
    gw = reloadable()
    conn = tls_tunnel(gw.process, "kept.test:443")
    _start_upload(conn, "/upload", "kept.test")
    narrowed = BASE_RULES.replace("  hosts: [kept.test]\n", "  hosts: [kept.test]\n  paths: ['/ok/**']\n")
    gw.reload(narrowed)
    line = line_of(gw.revoked(kind="request"), conn.client)
    assert (line["rule"], line["cause"], line["path"]) == ("kept", "path_not_allowed", "/upload")
    assert conn.closed(WAIT)


def test_a_finished_request_leaves_nothing_to_revoke(reloadable, origins):
    gw = reloadable()
    conn = tls_tunnel(gw.process, "kept.test:443")
    assert get(conn, "/first", "kept.test").status == 200
    narrowed = BASE_RULES.replace("  hosts: [kept.test]\n", "  hosts: [kept.test]\n  paths: ['/ok/**']\n")
    gw.reload(narrowed)
    assert get(conn, "/ok/1", "kept.test").status == 200  # the connection stayed open
    assert gw.lines(reason="revoked") == []


def test_a_body_override_after_a_reload_is_judged_by_the_new_rule(reloadable, origins):
    """Review finding: the body check kept the rule of the head's moment. The rule allowed DELETE
    when the upload started; a reload narrows it to GET and POST; the `_method=DELETE` that arrives
    next in the body is refused, before the end of the body goes on."""
    gw = reloadable()
    conn = Conn(socket.create_connection((gw.process.host, gw.process.port), timeout=WAIT))
    conn.send(b"POST http://kept.test/form HTTP/1.1\r\nHost: kept.test\r\nTransfer-Encoding: chunked\r\n"
              b"Content-Type: application/x-www-form-urlencoded\r\n\r\n4\r\na=1&\r\n")
    assert conn.read_response().status == 200  # this origin answers at the head
    gw.reload(BASE_RULES.replace("  hosts: [kept.test]\n", "  hosts: [kept.test]\n  methods: [GET, POST]\n"))
    assert gw.lines(reason="revoked") == []  # POST /form is still allowed: the connection stays
    conn.send(b"e\r\n_method=DELETE\r\n0\r\n\r\n")
    def body_lines():
        return [e for e in gw.lines(event="request_body") if e["client"] == conn.client]

    gw.wait(body_lines, "the request_body refusal")
    refused = body_lines()
    assert (refused[0]["decision"], refused[0]["reason"], refused[0]["rule"]) == ("deny", "method_not_allowed", "kept")
    assert refused[0]["method_override"] == ["form field _method: DELETE"]
    assert conn.closed(WAIT)
