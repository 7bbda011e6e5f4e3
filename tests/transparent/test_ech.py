"""Encrypted Client Hello (extension 0xfe0d): the real destination would sit in the encrypted inner
ClientHello, which the gateway cannot read (it holds no ECH keys, and its DNS answers HTTPS/SVCB
queries empty, so a sandbox never learns ECH configs from it). What the gateway does: it decides
on the OUTER SNI like any other ClientHello, records `ech: true` in the audit line, completes the
handshake itself (OpenSSL ignores an ECH extension it cannot decrypt, which is the "outer hello
accepted" path of RFC 9849) and pins the connection to the outer name's own address. So an ECH
hello reaches only the pinned outer SNI's host, or is refused; never the IP the sandbox dialled
and never the hidden inner name.

The hand-built hello needs nothing beyond `cryptography`; the full handshake (with an HTTP request
through it) uses tlslite-ng when it is installed, with the ECH extension added to its ClientHello.
"""

from __future__ import annotations

import pytest

from .clients import client_hello, read_tls_record, tlslite_with_ech
from tests.support.topology import ALLOWED, OTHER

pytestmark = pytest.mark.netns


def _server_hello(topology, sandbox, address: str, outer_sni: str) -> tuple[int, bytes] | None:
    with topology.connect(sandbox, address, 443) as sock:
        sock.sendall(client_hello(outer_sni, ech=True))
        return read_tls_record(sock)


def test_ech_hello_is_decided_on_the_outer_sni(topology, main):
    """Dialled to other.test's IP, outer SNI allowed.test: accepted and pinned to allowed.test's
    address (the handshake goes on: a ServerHello comes back)."""
    mark = main.audit_mark()
    record = _server_hello(topology, main.sandbox, OTHER, "allowed.test")
    assert record is not None and record[0] == 22 and record[1][:1] == b"\x02", f"no ServerHello: {record!r}"
    lines = main.audit_since(mark, event="tls")
    assert [(e["decision"], e["sni"], e["ech"], e["address"], e["original_destination"]) for e in lines] == [
        ("allow", "allowed.test", True, ALLOWED, f"{OTHER}:443")]
    assert topology.touched() == [], "no upstream connection before a request"


def test_ech_hello_with_a_denied_outer_sni_is_refused(topology, main):
    mark = main.audit_mark()
    _server_hello(topology, main.sandbox, OTHER, "other.test")
    lines = main.audit_since(mark, event="tls")
    assert [(e["decision"], e["reason"], e["sni"], e["ech"]) for e in lines] == [
        ("deny", "no_rule", "other.test", True)]
    assert topology.touched() == []


def test_ech_hello_without_outer_sni_is_decided_on_the_dialled_ip(topology, main):
    mark = main.audit_mark()
    _server_hello(topology, main.sandbox, OTHER, None)
    lines = main.audit_since(mark, event="tls")
    assert [(e["decision"], e["reason"], e["host"], e["ech"]) for e in lines] == [("deny", "no_rule", OTHER, True)]
    assert topology.touched() == []


# -- a complete handshake with tlslite-ng ----------------------------------------------------------


@pytest.fixture
def ech_tlslite(monkeypatch):
    """tlslite-ng whose ClientHello carries an ECH (outer) extension."""
    return tlslite_with_ech(monkeypatch)


def _tlslite_get(topology, sandbox, connection_class, address: str, outer_sni: str, path: str) -> bytes:
    sock = topology.connect(sandbox, address, 443)
    connection = connection_class(sock)
    try:
        connection.handshakeClientCert(serverName=outer_sni, alpn=[bytearray(b"http/1.1")])
        connection.write(f"GET {path} HTTP/1.1\r\nHost: {outer_sni}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while True:
            try:
                chunk = connection.read()
            except Exception:
                break
            if not chunk:
                break
            data += bytes(chunk)
        return data
    finally:
        try:
            connection.close()
        except Exception:
            sock.close()


def test_ech_full_handshake_reaches_only_the_outer_names_host(topology, main, ech_tlslite):
    mark = main.audit_mark()
    data = _tlslite_get(topology, main.sandbox, ech_tlslite, OTHER, "allowed.test", "/ech")
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert b"X-Upstream: allowed.test" in data
    assert [(r.path, r.sni) for r in topology.server(f"{ALLOWED}:443").requests] == [("/ech", "allowed.test")]
    assert topology.touched() == [f"{ALLOWED}:443"], "neither the dialled IP nor anything else"
    tls = main.audit_since(mark, event="tls")
    assert [(e["decision"], e["ech"], e["address"]) for e in tls] == [("allow", True, ALLOWED)]


def test_ech_full_handshake_with_a_denied_outer_sni(topology, main, ech_tlslite):
    data = _tlslite_get(topology, main.sandbox, ech_tlslite, OTHER, "other.test", "/ech")
    assert data.startswith(b"HTTP/1.1 403"), data[:300]
    assert b"X-Egress-Reason: no_rule" in data
    assert topology.touched() == []
