"""The CL.0 desync in transparent mode (issue 14): a body on a method that defines none is refused
before anything reaches the origin, over plain HTTP and inside TLS, as in explicit mode."""

from __future__ import annotations

import ssl

import pytest

from .clients import read_response
from tests.support.topology import ALLOWED

pytestmark = pytest.mark.netns

HIDDEN = b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n"


def _get_with_body(host: str) -> bytes:
    return (f"GET /page HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(HIDDEN)}\r\n\r\n").encode() + HIDDEN


def test_plain_http_get_with_a_body_is_refused(topology, main):
    mark = main.audit_mark()
    with topology.connect(main.sandbox, ALLOWED, 80) as sock:
        sock.sendall(_get_with_body("allowed.test"))
        reply = read_response(sock)
    assert (reply.status, reply.egress_reason) == (400, "unexpected_body"), reply.text()
    assert topology.touched() == []
    line = main.audit_since(mark, event="request")[0]
    assert (line["mode"], line["decision"], line["reason"], line["rule"]) == ("transparent", "deny",
                                                                              "unexpected_body", "web")


def test_tls_get_with_a_body_is_refused(topology, main):
    sock = topology.connect(main.sandbox, ALLOWED, 443)
    context = ssl.create_default_context(cafile=str(main.ca))
    context.set_alpn_protocols(["http/1.1"])
    with context.wrap_socket(sock, server_hostname="allowed.test") as tls:
        tls.sendall(_get_with_body("allowed.test"))
        reply = read_response(tls)
    assert (reply.status, reply.egress_reason) == (400, "unexpected_body"), reply.text()
    assert topology.touched() == []
