"""Report mode in transparent mode says what it did (issue 14 part 5).

The report sandbox's gateway runs `mode: report`: allowed.test (GET) and raw TCP to tcp.test:22
are allowed; anything else the allowlist refuses is let through and must be audited as
`would_deny`, never as `allow`. The TLS line (the SNI named a destination no rule covers) and the
raw TCP line (bytes to an address no `protocol: tcp` rule covers) used to spell the verdict by
hand from "was it let through", and wrote `allow`.
"""

from __future__ import annotations

import ssl

import pytest

from .clients import tls_get
from .test_raw_tcp import SSH_BANNER
from tests.support.topology import ALLOWED, OTHER, TCP_HOST

pytestmark = pytest.mark.netns


def _echo(topology, sandbox, address: str, port: int) -> bytes:
    with topology.connect(sandbox, address, port) as sock:
        sock.sendall(SSH_BANNER)
        sock.settimeout(5)
        echoed = b""
        while len(echoed) < len(SSH_BANNER):
            chunk = sock.recv(1024)
            if not chunk:
                break
            echoed += chunk
    return echoed


def test_tls_to_a_destination_no_rule_covers_is_would_deny(topology, report):
    mark = report.audit_mark()
    reply = tls_get(topology, report.sandbox, OTHER, "other.test", report.ca, "other.test", "/report")
    assert reply.status == 200, reply  # let through: report mode
    assert topology.touched() == [f"{OTHER}:443"]
    tls = report.audit_since(mark, event="tls")
    assert [(e["decision"], e["reason"], e["status"], e["sni"], e["address"]) for e in tls] == [
        ("would_deny", "no_rule", None, "other.test", OTHER)]
    requests = report.audit_since(mark, event="request")
    assert [(e["decision"], e["reason"], e["path"]) for e in requests] == [("would_deny", "no_rule", "/report")]
    assert not [e for e in report.gateway.audit()[mark:] if e["decision"] == "allow"]


def test_tls_to_an_allowed_destination_is_allow(topology, report):
    mark = report.audit_mark()
    reply = tls_get(topology, report.sandbox, ALLOWED, "allowed.test", report.ca, "allowed.test", "/ok")
    assert reply.status == 200, reply
    tls = report.audit_since(mark, event="tls")
    assert [(e["decision"], e["reason"], e["rule"]) for e in tls] == [("allow", "allowed", "web")]
    requests = report.audit_since(mark, event="request")
    assert [(e["decision"], e["rule"]) for e in requests] == [("allow", "web")]


def test_a_request_its_rule_refuses_inside_an_allowed_tls_connection(topology, report):
    """The connection is allowed (allow), the request is not (would_deny): each line its own verdict."""
    mark = report.audit_mark()
    with topology.connect(report.sandbox, ALLOWED, 443) as raw:
        context = ssl.create_default_context(cafile=str(report.ca))
        context.check_hostname = False
        with context.wrap_socket(raw, server_hostname="allowed.test") as tls:
            tls.sendall(b"DELETE /thing HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    lines = report.audit_since(mark)
    assert [(e["event"], e["decision"], e["reason"]) for e in lines] == [
        ("tls", "allow", "allowed"), ("request", "would_deny", "method_not_allowed")]


def test_raw_tcp_no_rule_covers_is_would_deny(topology, report):
    mark = report.audit_mark()
    assert _echo(topology, report.sandbox, OTHER, 22) == SSH_BANNER  # relayed: report mode
    assert topology.touched() == [f"{OTHER}:22"]
    lines = report.audit_since(mark, event="connection")
    assert [(e["decision"], e["reason"], e["status"], e["protocol"], e["address"], e["original_destination"])
            for e in lines] == [("would_deny", "no_rule", None, "tcp", OTHER, f"{OTHER}:22")]


def test_raw_tcp_a_rule_allows_is_allow(topology, report):
    mark = report.audit_mark()
    assert _echo(topology, report.sandbox, TCP_HOST, 22) == SSH_BANNER
    lines = report.audit_since(mark, event="connection")
    assert [(e["decision"], e["reason"], e["rule"], e["protocol"]) for e in lines] == [
        ("allow", "allowed", "ssh-by-ip", "tcp")]
