"""gateway/control_server.py: what one peer can hold of the control listener (review 24: 64
connections sending a byte every 5 s, without a token, kept every slot and the platform out)."""

from __future__ import annotations

import re
import socket
from types import SimpleNamespace

import pytest

from gateway import control_server
from gateway.control import Reply
from gateway.control_server import ControlServer
from tests.support.waiting import wait_for


class _Service:
    limits = SimpleNamespace(max_body=1024)

    def refuse(self, status, error, message, principal, path):
        return Reply(status, {"error": error, "message": message})

    def handle(self, method, path, query, body, principal):
        return Reply(200, {"ok": True, "principal": principal})


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(control_server, "TIMEOUT", 0.5)
    made = ControlServer("127.0.0.1:0", _Service(), tokens={"t" * 32: "platform"})
    made.start()
    yield made
    made.stop()


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.address[1]), timeout=10)


def test_a_request_not_read_whole_in_time_is_cut(server):
    sock = _connect(server)
    sock.sendall(b"GET /v1/status HTTP/1.1\r\n")  # ... and nothing more, never
    sock.settimeout(5)  # (the per-read timeout alone would take 10 s, and a byte now and then, forever)
    assert sock.recv(1024) == b""  # closed by the gateway, within its deadline
    sock.close()


def test_one_peer_cannot_hold_more_than_its_share_and_a_token_still_gets_through(server):
    held = [_connect(server) for _ in range(control_server.MAX_PER_PEER)]
    for sock in held:
        sock.sendall(b"G")
    extra = _connect(server)  # this peer's ninth: closed at once
    extra.settimeout(10)
    assert extra.recv(1024) == b""
    extra.close()
    for sock in held:
        sock.close()
    wait_for(lambda: not server._peers, 10.0, "the peer's connections gone")
    ok = _connect(server)
    ok.sendall(b"GET /v1/status HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer " + b"t" * 32 + b"\r\n\r\n")
    assert ok.recv(4096).startswith(b"HTTP/1.1 200")
    ok.close()


def test_the_listeners_refusals_are_rate_limited_in_the_audit_log_and_the_rest_counted():
    """Review 24: anyone who can reach HOST:PORT made an audit line per 401, without limit."""
    from gateway.control import REFUSAL_LINE_BURST, REFUSAL_LINES_PER_SECOND, ControlService
    from gateway.registry import Registry

    lines, counted, now = [], [], [1000.0]
    service = ControlService(Registry(), lambda: None, lambda ops: 0, lambda **fields: lines.append(fields),
                             clock=lambda: now[0], count=lambda action, result: counted.append(result))
    for _ in range(int(REFUSAL_LINE_BURST) + 30):
        assert service.refuse(401, "unauthorized", "a valid bearer token is required", "anonymous",
                              "/v1/sandboxes/x").status == 401
    assert len(lines) == REFUSAL_LINE_BURST and len(counted) == REFUSAL_LINE_BURST + 30
    now[0] += 1 / REFUSAL_LINES_PER_SECOND
    service.refuse(401, "unauthorized", "a valid bearer token is required", "anonymous", "/v1/status")
    assert lines[-1]["suppressed"] == 30


def test_host_port_is_read_as_the_metrics_endpoint_reads_it():
    """--control HOST:PORT and --metrics HOST:PORT are one grammar (gateway/listen.py): an IP
    address or localhost, IPv6 in brackets; the control API also takes unix:PATH."""
    import ipaddress

    from gateway.control_server import ControlSpecError, parse_spec

    assert parse_spec("127.0.0.1:0") == ("tcp", (ipaddress.ip_address("127.0.0.1"), 0))
    assert parse_spec("[::1]:8081") == ("tcp", (ipaddress.ip_address("::1"), 8081))
    assert parse_spec("localhost:8081") == ("tcp", (ipaddress.ip_address("127.0.0.1"), 8081))
    assert parse_spec("unix:/run/x.sock") == ("unix", "/run/x.sock")
    for bad, said in (("8081", "expected unix:PATH, HOST:PORT or [IPV6]:PORT"), ("::1:8081", "expected unix:PATH"),
                      ("example.com:8081", "the host must be an IP address"), ("127.0.0.1:99999", "port out of range")):
        with pytest.raises(ControlSpecError, match=re.escape(said)):
            parse_spec(bad)
