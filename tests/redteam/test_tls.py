"""TLS: upstreams with bad certificates (expired, for another name, self-signed) get no request,
so the credential the rule would inject never leaves; a ClientHello carrying ECH is judged by its
outer SNI; ALPN values that are not HTTP are refused; and a ClientHello split into tiny TLS records
and TCP segments is reassembled and judged like any other, in explicit and transparent mode."""

from __future__ import annotations

import pytest

from tests.credentials.clients import assert_no_leak, response_bytes
from tests.e2e.helpers import Conn, H2Client, assert_refused, audit_for, get, start_tls, tls_tunnel, tunnel
from tests.transparent.clients import client_hello, ech_outer_extension, read_tls_record
from tests.support.topology import ALLOWED, OTHER

from .common import attack, nothing_reached
from .tlsfrag import FragmentedTLS

pytestmark = attack("tls")

NOT_ALLOWED = ("other.test", "api.test", "deep.wild.test")


# --- upstream certificates ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["expired.test", "wrongname.test", "selfsigned.test"])
def test_bad_upstream_certificate_gets_no_request(rt, name):
    """Rule badtls injects X-Api-Key: a request must not be sent over an unverified connection."""
    with tls_tunnel(rt.gateway, f"{name}:443") as tls:
        response = get(tls, "/with-credential", name)
    assert response.status == 502, response.text
    server = rt.servers[name]
    assert server.requests == [], "a request went over an unverified connection"
    assert_no_leak(response_bytes(response), rt.secrets)
    nothing_reached(rt.recorders(*NOT_ALLOWED))


def test_bad_upstream_certificate_over_h2(rt):
    with tls_tunnel(rt.gateway, "wrongname.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.send("wrongname.test", "/h2-with-credential")
        h2.wait(stream)
    assert h2.responses[stream]["status"] == 502, h2.responses[stream]
    assert rt.servers["wrongname.test"].requests == []
    assert_no_leak(h2.responses[stream]["body"], rt.secrets)


# --- ECH --------------------------------------------------------------------------------------------


def test_ech_hello_with_another_outer_sni_in_a_tunnel(rt):
    conn, answer = tunnel(rt.gateway, "allowed.test:443")
    with conn:
        assert answer.status == 200
        conn.send(client_hello("other.test", ech=True))
        read_tls_record(conn.sock, timeout=3)
        client = conn.client
    lines = [a for a in audit_for(rt.gateway, client, 2) if a["event"] == "tls"]
    assert [(a["decision"], a["reason"], a.get("ech")) for a in lines] == [("deny", "sni_mismatch", True)]
    nothing_reached(rt.everything())


@pytest.fixture
def ech_tls_connection(monkeypatch):
    """tlslite-ng's TLSConnection, with an ECH (outer) extension added to its ClientHello."""
    tlsconnection = pytest.importorskip("tlslite.tlsconnection")
    from tlslite.extensions import TLSExtension
    from tlslite.messages import ClientHello

    body = ech_outer_extension()[4:]

    class EchClientHello(ClientHello):
        def create(self, *args, **kwargs):
            super().create(*args, **kwargs)
            self.extensions = list(self.extensions or []) + [TLSExtension(extType=0xFE0D).create(bytearray(body))]
            return self

    monkeypatch.setattr(tlsconnection, "ClientHello", EchClientHello)
    return tlsconnection.TLSConnection


def _tlslite_requests(connection, requests: list[bytes]) -> list[bytes]:
    """Send each request and read one response head (+ body by Content-Length)."""
    answers = []
    for request in requests:
        connection.write(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += bytes(connection.read())
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), b"0"))
        while len(body) < length:
            body += bytes(connection.read())
        answers.append(head + b"\r\n\r\n" + body)
    return answers


def test_ech_full_handshake_cannot_restate_the_destination(rt, ech_tls_connection):
    """A complete ECH handshake (the gateway answers as the outer name) inside a tunnel: a Host
    naming the would-be inner destination is still a restatement."""
    conn, answer = tunnel(rt.gateway, "allowed.test:443")
    assert answer.status == 200
    connection = ech_tls_connection(conn.sock)
    try:
        connection.handshakeClientCert(serverName="allowed.test", alpn=[bytearray(b"http/1.1")])
        inner, outer = _tlslite_requests(connection, [
            b"GET /inner HTTP/1.1\r\nHost: other.test\r\n\r\n",
            b"GET /outer HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        ])
    finally:
        conn.close()
    assert inner.startswith(b"HTTP/1.1 421") and b"X-Egress-Reason: host_mismatch" in inner, inner[:300]
    assert outer.startswith(b"HTTP/1.1 200"), outer[:300]
    assert [r.path for r in rt.upstreams.tls["allowed.test"].requests] == ["/outer"]
    nothing_reached(rt.recorders(*NOT_ALLOWED))


def test_transparent_ech_hello_is_pinned_to_the_outer_name(world):
    """Dialled to other.test's address, ECH with outer SNI allowed.test: decided (and pinned) on the
    outer name; the dialled address is never used."""
    mark = world.audit_mark()
    with world.connect(OTHER, 443) as sock:
        sock.sendall(client_hello("allowed.test", ech=True))
        record = read_tls_record(sock)
    assert record is not None and record[0] == 22, record
    [line] = world.audit_since(mark, event="tls")
    assert (line["decision"], line["ech"], line["address"]) == ("allow", True, ALLOWED)
    assert world.touched() == []


# --- ALPN ---------------------------------------------------------------------------------------------


def _refused_or_closed(tls: Conn) -> None:
    """After non-HTTP bytes: a 400 non_http answer, or the connection closed."""
    try:
        response = tls.read_response()
    except (ConnectionError, OSError):
        return
    assert_refused(response, 400, "non_http")


@pytest.mark.parametrize("alpn", [["x-evil"], ["acme-tls/1"], ["h2c"], ["http/0.9", "spdy/3.1"]])
def test_unknown_alpn_is_not_relayed(rt, alpn):
    """The gateway must not agree to a protocol it cannot inspect; what the client then sends in
    that protocol (not HTTP) is refused and nothing is dialled."""
    conn, answer = tunnel(rt.gateway, "allowed.test:443")
    assert answer.status == 200
    try:
        tls = start_tls(conn, rt.gateway, "allowed.test", alpn=alpn)
    except OSError:
        conn.close()  # no common protocol: the handshake fails, which is a refusal too
    else:
        with tls:
            # HTTP/1 family ALPNs (mitmproxy knows http/0.9 and http/1.0) are fine: the bytes are judged
            assert tls.sock.selected_alpn_protocol() in (None, "http/1.1", "http/1.0", "http/0.9"), \
                tls.sock.selected_alpn_protocol()
            tls.send(b"\x00\x01\x02\x03 " + alpn[0].encode() + b" frames, not HTTP\r\n")
            _refused_or_closed(tls)
    nothing_reached(rt.everything())


def test_transparent_unknown_alpn(world):
    sock = world.connect(ALLOWED, 443)
    try:
        tls = start_tls(Conn(sock), world.gateway, "allowed.test", alpn=["x-evil"])
    except OSError:
        sock.close()
    else:
        with tls:
            assert tls.sock.selected_alpn_protocol() in (None, "http/1.1")
            tls.send(b"\x00\x01\x02raw x-evil frames, not HTTP\r\n")
            _refused_or_closed(tls)
    assert world.touched() == []


# --- fragmented ClientHello ------------------------------------------------------------------------


@pytest.mark.parametrize("record_size,segment_size", [(0, 1), (16, 0), (7, 3)],
                         ids=["tcp-1-byte-segments", "16-byte-records", "7-byte-records-3-byte-segments"])
def test_fragmented_client_hello_with_another_sni(rt, record_size, segment_size):
    conn, answer = tunnel(rt.gateway, "allowed.test:443")
    assert answer.status == 200
    tls = FragmentedTLS(conn.sock, rt.gateway.ca_cert, "other.test", record_size, segment_size)
    with Conn(tls) as wrapped:
        response = get(wrapped, "/fragmented", "allowed.test")
    assert_refused(response, 421, "sni_mismatch")
    nothing_reached(rt.everything())


def test_fragmented_client_hello_with_the_right_sni_works(rt):
    """The control: the same fragmentation with the pinned SNI is served (so the refusal above
    is a decision on the reassembled SNI, not a parse failure)."""
    conn, answer = tunnel(rt.gateway, "allowed.test:443")
    assert answer.status == 200
    tls = FragmentedTLS(conn.sock, rt.gateway.ca_cert, "allowed.test", 16, 3)
    with Conn(tls) as wrapped:
        response = get(wrapped, "/fragmented-ok", "allowed.test")
    assert response.status == 200, response.text
    nothing_reached(rt.recorders(*NOT_ALLOWED))


@pytest.mark.parametrize("record_size,segment_size", [(16, 0), (0, 1)], ids=["16-byte-records", "tcp-1-byte"])
def test_transparent_fragmented_client_hello(world, record_size, segment_size):
    """Dialled to allowed.test's address (allowed by an IP rule), SNI other.test in pieces: the
    SNI must still be found and refused (a missed SNI would fall back to the dialled IP)."""
    tls = FragmentedTLS(world.connect(ALLOWED, 443), world.ca, "other.test", record_size, segment_size)
    with Conn(tls) as wrapped:
        response = get(wrapped, "/fragmented", "other.test")
    assert (response.status, response.egress_reason) == (403, "no_rule"), response.text
    assert world.touched() == []
