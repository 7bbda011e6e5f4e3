"""`inspect: false` in explicit mode: CONNECT to a passthrough host relays the client's own TLS to the
gateway's pinned address, after a ClientHello check; everything else about the tunnel is refused
before any upstream connection. Asserted from both ends: what the client sees (whose certificate)
and what the upstream recorded (connections, SNI, request bytes)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import shutil
import struct
import time

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.e2e.helpers import Conn, assert_untouched, audit_for, curl, tunnel
from tests.redteam.tlsfrag import FragmentedTLS
from tests.support.waiting import value_when
from tests.transparent.clients import client_hello, read_tls_record, tlslite_with_ech

TIMEOUT = 10.0
STATUS = {"sni_mismatch": 421, "sni_required": 421, "ech_refused": 403, "bad_client_hello": 400}


def der(cert_path) -> bytes:
    return x509.load_pem_x509_certificate(cert_path.read_bytes()).public_bytes(Encoding.DER)


def open_tunnel(gateway, authority: str) -> Conn:
    conn, answer = tunnel(gateway, authority, timeout=TIMEOUT)
    assert answer.status == 200, (answer.status, answer.headers, answer.body)
    return conn


def upstream_tls(conn: Conn, ca, sni: str | None, check_hostname: bool = True,
                 alpn: list[str] | None = None) -> Conn:
    """TLS over the tunnel, trusting only `ca`."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = check_hostname and sni is not None
    context.set_alpn_protocols(alpn or ["http/1.1"])
    tls = context.wrap_socket(conn.sock, server_hostname=sni)
    tls.settimeout(TIMEOUT)
    wrapped = Conn(tls)
    wrapped.client = conn.client
    return wrapped


def touched(*servers) -> list[str]:
    return [f"{s.name}@{s.host}:{s.port}" for s in servers if s.touched]


def all_servers(upstreams, pass_upstreams) -> list:
    return [*pass_upstreams.all(), *upstreams.all()]


def deny_lines(gateway, client: str, reason: str) -> list[dict]:
    """The client's deny lines, once one has `reason` (after 3 s: as many as there are)."""
    return value_when(lambda: [e for e in gateway.audit() if e.get("client") == client and e["decision"] == "deny"],
                      lambda lines: any(e["reason"] == reason for e in lines), 3)


# --- allowed: the upstream's own TLS, end to end ------------------------------------------------------


def test_curl_sees_the_upstreams_real_certificate(gateway, pki, pass_upstreams):
    result = curl(gateway, "https://pass.test/curl?x=1", "--cacert", str(pki.ca_cert))
    assert result.status == 200, (result.returncode, result.stderr)
    assert result.body == "upstream pass.test: GET /curl?x=1\n"
    assert [(r.method, r.path, r.sni) for r in pass_upstreams.pass_tls.requests] == [("GET", "/curl?x=1", "pass.test")]


def test_curl_trusting_only_the_gateway_ca_fails_verification(gateway, pass_upstreams):
    result = curl(gateway, "https://pass.test/gateway-ca")  # --cacert: the gateway's CA only
    assert result.status == 0 and result.returncode == 60, (result.returncode, result.stderr)
    assert "certificate" in result.stderr.lower()
    assert pass_upstreams.pass_tls.requests == [], "a request went through an unverified connection"


def test_an_inspected_rule_still_gets_the_gateway_certificate(gateway, pki, upstreams):
    assert curl(gateway, "https://allowed.test/inspected").status == 200
    result = curl(gateway, "https://allowed.test/inspected", "--cacert", str(pki.ca_cert))
    assert result.returncode == 60, (result.returncode, result.stderr)


def test_httpx_through_a_passthrough_tunnel(gateway, pki, pass_upstreams):
    upstream_ca = ssl.create_default_context(cafile=str(pki.ca_cert))
    response = httpx.get("https://pass.test/httpx", proxy=gateway.proxy_url, verify=upstream_ca, timeout=TIMEOUT)
    assert response.status_code == 200 and response.headers["x-upstream"] == "pass.test"
    gateway_ca = ssl.create_default_context(cafile=str(gateway.ca_cert))
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get("https://pass.test/httpx-gw", proxy=gateway.proxy_url, verify=gateway_ca, timeout=TIMEOUT)
    assert [r.path for r in pass_upstreams.pass_tls.requests] == ["/httpx"]


def _s_client(gateway, ca, request: bytes) -> subprocess.CompletedProcess:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return subprocess.run(
        ["openssl", "s_client", "-proxy", f"{gateway.host}:{gateway.port}", "-connect", "pass.test:443",
         "-servername", "pass.test", "-CAfile", str(ca), "-verify_return_error", "-ign_eof"],
        input=request, capture_output=True, timeout=30)


def test_openssl_s_client_sees_the_upstream_chain(gateway, pki, pass_upstreams):
    request = b"GET /openssl HTTP/1.1\r\nHost: pass.test\r\nConnection: close\r\n\r\n"
    result = _s_client(gateway, pki.ca_cert, request)
    out = result.stdout.decode("latin-1")
    assert "Verify return code: 0 (ok)" in out, out[-2000:] + result.stderr.decode("latin-1")
    assert "egress-gateway test CA" in out and "mitmproxy" not in out
    assert "HTTP/1.1 200" in out and "upstream pass.test: GET /openssl" in out
    refused = _s_client(gateway, gateway.ca_cert, request)
    assert refused.returncode != 0, refused.stdout.decode("latin-1")[-1500:]
    assert [r.path for r in pass_upstreams.pass_tls.requests] == ["/openssl"]


def test_allowed_passthrough_audit_line_and_bytes_as_sent(gateway, pki, pass_upstreams, upstreams):
    conn = open_tunnel(gateway, "pass.test:443")
    with upstream_tls(conn, pki.ca_cert, "pass.test", alpn=["h2", "http/1.1"]) as tls:
        assert tls.sock.getpeercert(binary_form=True) == der(pass_upstreams.cert_path), "not the upstream's certificate"
        assert tls.sock.selected_alpn_protocol() == "http/1.1"  # the upstream's choice (it offers no h2)
        # The gateway cannot read these: a foreign Host and an odd path arrive upstream as sent.
        first = tls.request("GET", "/first", {"Host": "other.test"})
        second = tls.request("GET", "/a/%2e%2e/b;x?y=%00", {"Host": "pass.test"})
    assert (first.status, second.status) == (200, 200), (first, second)
    recorded = [(r.path, dict(r.headers).get("Host"), r.sni) for r in pass_upstreams.pass_tls.requests]
    assert recorded == [("/first", "other.test", "pass.test"), ("/a/%2e%2e/b;x?y=%00", "pass.test", "pass.test")]
    assert pass_upstreams.pass_tls.connections == 1
    assert_untouched(upstreams, "other.test")

    lines = audit_for(gateway, conn.client, count=2)
    tls_lines = [e for e in lines if e["event"] == "tls"]
    assert len(tls_lines) == 1, lines
    line = tls_lines[0]
    assert (line["decision"], line.get("passthrough"), line["rule"], line["host"], line["address"], line["sni"]) == (
        "allow", True, "pass", "pass.test", pass_upstreams.addresses["pass.test"], "pass.test"), line
    assert [e["event"] for e in lines if e["event"] == "request"] == [], "requests in a passthrough tunnel are unseen"


@pytest.mark.parametrize("authority, sni", [
    ("PASS.Test:443", "pass.test"),
    ("pass.test:443", "PASS.TEST"),
    ("pass.test:443", "pass.test."),
    ("sub.pass.test:443", "Sub.Pass.Test"),
])
def test_the_sni_is_compared_canonically(gateway, pki, pass_upstreams, authority, sni):
    conn = open_tunnel(gateway, authority)
    with upstream_tls(conn, pki.ca_cert, sni, check_hostname=False) as tls:
        assert tls.sock.getpeercert(binary_form=True) == der(pass_upstreams.cert_path)
        response = tls.request("GET", "/canonical", {"Host": "pass.test", "Connection": "close"})
    assert response.status == 200, response
    # Relayed unmodified: the upstream sees the SNI exactly as the client spelled it.
    assert [(r.path, r.sni) for r in pass_upstreams.pass_tls.requests] == [("/canonical", sni)]


def test_a_fragmented_client_hello_is_reassembled_and_relayed(gateway, pki, pass_upstreams):
    conn = open_tunnel(gateway, "pass.test:443")
    tls = FragmentedTLS(conn.sock, pki.ca_cert, "pass.test", record_size=24, segment_size=7)
    with Conn(tls) as wrapped:
        response = wrapped.request("GET", "/fragmented", {"Host": "pass.test", "Connection": "close"})
    assert response.status == 200, response
    assert [(r.path, r.sni) for r in pass_upstreams.pass_tls.requests] == [("/fragmented", "pass.test")]


# --- refused: no upstream connection, a deny line, an answer from the gateway --------------------------


@pytest.mark.parametrize("sni, reason", [
    ("pass2.test", "sni_mismatch"),  # another passthrough name: would reach pass2.test's site at pass.test's address
    ("other.test", "sni_mismatch"),
    ("allowed.test", "sni_mismatch"),
    (None, "sni_required"),
])
def test_a_client_hello_that_does_not_name_the_pin_is_refused(gateway, pass_upstreams, upstreams, sni, reason):
    conn = open_tunnel(gateway, "pass.test:443")
    context = ssl.create_default_context(cafile=str(gateway.ca_cert))  # the gateway answers itself
    context.check_hostname = False
    context.set_alpn_protocols(["http/1.1"])
    with context.wrap_socket(conn.sock, server_hostname=sni) as tls:
        tls.settimeout(TIMEOUT)
        answer = Conn(tls).request("GET", "/refused", {"Host": "pass.test", "Connection": "close"})
    assert (answer.status, answer.egress_reason) == (STATUS[reason], reason), (answer.status, answer.text)
    assert touched(*all_servers(upstreams, pass_upstreams)) == [], "an upstream connection was made"
    lines = deny_lines(gateway, conn.client, reason)
    assert any(e["reason"] == reason for e in lines), f"no deny line with {reason}: {lines}"


def test_a_fragmented_client_hello_naming_another_host_is_refused(gateway, pass_upstreams, upstreams):
    conn = open_tunnel(gateway, "pass.test:443")
    try:
        tls = FragmentedTLS(conn.sock, gateway.ca_cert, "other.test", record_size=24, segment_size=7)
        answer = Conn(tls).request("GET", "/frag-refused", {"Host": "pass.test", "Connection": "close"})
        assert answer.status == 421 and answer.egress_reason == "sni_mismatch", answer
    except (ConnectionError, ssl.SSLError, OSError):
        pass  # refused without an HTTP answer: the checks below still apply
    finally:
        conn.close()
    assert touched(*all_servers(upstreams, pass_upstreams)) == []
    assert any(e["reason"] == "sni_mismatch" for e in deny_lines(gateway, conn.client, "sni_mismatch"))


def test_an_ech_client_hello_is_refused(gateway, pass_upstreams, upstreams):
    conn = open_tunnel(gateway, "pass.test:443")
    with conn:
        conn.send(client_hello("pass.test", ech=True))
        read_tls_record(conn.sock, timeout=5)  # whatever the gateway answers
    assert touched(*all_servers(upstreams, pass_upstreams)) == [], "an ECH hello reached an upstream"
    lines = deny_lines(gateway, conn.client, "ech_refused")
    assert any(e["reason"] == "ech_refused" for e in lines), lines


@pytest.fixture
def ech_tlslite(monkeypatch):
    """tlslite-ng whose ClientHello carries an ECH (outer) extension (as in tests/transparent/test_ech.py)."""
    return tlslite_with_ech(monkeypatch)


def test_an_ech_handshake_gets_the_gateways_refusal(gateway, pass_upstreams, upstreams, ech_tlslite):
    conn = open_tunnel(gateway, "pass.test:443")
    connection = ech_tlslite(conn.sock)
    data = b""
    try:
        connection.handshakeClientCert(serverName="pass.test", alpn=[bytearray(b"http/1.1")])
        connection.write(b"GET /ech HTTP/1.1\r\nHost: pass.test\r\nConnection: close\r\n\r\n")
        while True:
            try:
                chunk = connection.read()
            except Exception:  # noqa: BLE001  (tlslite raises on close)
                break
            if not chunk:
                break
            data += bytes(chunk)
    finally:
        conn.close()
    assert data.startswith(b"HTTP/1.1 403") and b"X-Egress-Reason: ech_refused" in data, data[:300]
    assert touched(*all_servers(upstreams, pass_upstreams)) == []


def _with_two_server_names(first: str, second: str) -> bytes:
    """A ClientHello with two server_name extensions (an upstream might read either one)."""
    hello = client_hello(first)
    extra = second.encode()
    body = struct.pack("!H", len(extra) + 3) + b"\x00" + struct.pack("!H", len(extra)) + extra
    extension = struct.pack("!HH", 0, len(body)) + body
    record = bytearray(hello)
    # record header (5) + handshake header (4) + version (2) + random (32) + session id, suites, compression
    offset = 5 + 4 + 2 + 32
    offset += 1 + record[offset]
    offset += 2 + struct.unpack("!H", record[offset:offset + 2])[0]
    offset += 1 + record[offset]
    ext_len = struct.unpack("!H", record[offset:offset + 2])[0]
    record[offset:offset + 2] = struct.pack("!H", ext_len + len(extension))
    record += extension
    record[3:5] = struct.pack("!H", len(record) - 5)
    record[6:9] = (len(record) - 9).to_bytes(3, "big")
    return bytes(record)


def test_a_client_hello_with_two_server_names_is_refused(gateway, pass_upstreams, upstreams):
    conn = open_tunnel(gateway, "pass.test:443")
    with conn:
        conn.send(_with_two_server_names("pass.test", "other.test"))
        read_tls_record(conn.sock, timeout=5)
    assert touched(*all_servers(upstreams, pass_upstreams)) == []
    lines = deny_lines(gateway, conn.client, "bad_client_hello")
    assert any(e["reason"] in ("bad_client_hello", "sni_mismatch") for e in lines), lines


def test_plain_http_inside_a_passthrough_tunnel_is_refused(gateway, pass_upstreams, upstreams):
    conn = open_tunnel(gateway, "pass.test:443")
    started = time.monotonic()
    with conn:
        conn.send(b"GET /plain HTTP/1.1\r\nHost: pass.test\r\n\r\n")
        conn.sock.settimeout(5)
        data = b""
        try:
            while True:
                chunk = conn.sock.recv(65536)
                if not chunk:
                    break
                data += chunk
                if b"\r\n\r\n" in data:
                    break
        except (ConnectionResetError, socket.timeout):
            pass
    assert time.monotonic() - started < 5, "not refused at once"
    assert not data.startswith(b"HTTP/1.1 200"), data[:300]
    assert touched(*all_servers(upstreams, pass_upstreams)) == []
    lines = [e for e in audit_for(gateway, conn.client, count=2) if e["decision"] == "deny"]
    assert lines, "no deny line for plain HTTP in a passthrough tunnel"


def test_plain_http_to_a_passthrough_only_host_is_refused(gateway, pass_upstreams, upstreams):
    result = curl(gateway, "http://pass.test/plain")
    assert result.status == 403 and result.header("X-Egress-Reason") == "scheme_not_allowed", (
        result.status, result.headers, result.body)
    assert touched(*all_servers(upstreams, pass_upstreams)) == []


def test_the_pinned_address_is_the_gateways_resolution(gateway, pki, pass_upstreams, upstreams):
    """CONNECT names pass.test; static_hosts says .161; nothing the client says can change that (a
    Host header naming pass2.test inside does not move the connection)."""
    conn = open_tunnel(gateway, "pass.test:443")
    with upstream_tls(conn, pki.ca_cert, "pass.test") as tls:
        assert tls.request("GET", "/where", {"Host": "pass2.test", "Connection": "close"}).status == 200
    assert [r.path for r in pass_upstreams.pass_tls.requests] == ["/where"]
    assert not pass_upstreams.pass2_tls.touched
    peer = pass_upstreams.pass_tls.requests[0].peer
    assert peer[0].startswith("127."), peer


def test_a_passthrough_dial_over_the_sandbox_s_upstream_cap_is_refused_and_audited(
        tmp_path, upstreams, pki, pass_upstreams):
    """A relay has no HTTP stream to answer a refused dial: its client only saw the connection
    end, and only the gateway log said why (review 38). Nothing is dialled; the audit line says
    `too_many_connections`."""
    from tests.passthrough.conftest import pass_policy
    from tests.support.gateway import GatewayProcess
    from tests.e2e.helpers import get, tls_tunnel

    policy = tmp_path / "policy.yaml"
    policy.write_text(pass_policy(upstreams, pass_upstreams))
    gateway = GatewayProcess(policy, tmp_path / "gw", upstream_ca=pki.ca_cert,
                             extra_args=["--set", "egress_max_upstream_connections_per_sandbox=1"]).start()
    try:
        pass_upstreams.reset()
        with tls_tunnel(gateway, "allowed.test:443") as holding:  # kept alive: the sandbox's one upstream
            assert get(holding, "/held", "allowed.test").status == 200
            conn = open_tunnel(gateway, "pass.test:443")
            with pytest.raises((ssl.SSLError, OSError)):
                upstream_tls(conn, pki.ca_cert, "pass.test")
            lines = deny_lines(gateway, conn.client, "too_many_connections")
            assert [line["event"] for line in lines if line["reason"] == "too_many_connections"] == ["connection"]
            assert pass_upstreams.pass_tls.connections == 0
    finally:
        gateway.stop()
