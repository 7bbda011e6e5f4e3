"""The TLS ClientHello budget in explicit mode: size (`egress_max_client_hello_bytes`) and time
(`egress_client_hello_timeout`), in CONNECT tunnels to inspected and to passthrough (`inspect:
false`) rules, and the deadline on first bytes the gateway is still classifying. Each refusal is a
TLS alert and a close, one audit line, a metric, and no upstream connection.

Before these limits, an unfinished multi-MiB ClientHello was buffered and re-parsed on every read
(other clients stalled for seconds) and a silent one was held until `tcp_timeout` (600 s)."""

from __future__ import annotations

import socket
import struct
import time
import urllib.request

import pytest

from tests.e2e.helpers import audit_for, curl, extra_static_hosts, shared_gateway, tunnel
from tests.observability.conftest import samples, value
from tests.support.gateway import free_port
from tests.transparent.clients import client_hello, wait_closed

ALERT = b"\x15\x03\x03\x00\x02\x02\x28"  # fatal handshake_failure
HELLO_TIMEOUT = 2
HEAD_TIMEOUT = 2

RULES = """
- id: inspected
  hosts: [allowed.test]
- id: relayed
  hosts: [other.test]
  inspect: false
"""
DESTINATIONS = {"inspected": "allowed.test:443", "passthrough": "other.test:443"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstreams, pki):
    metrics_port = free_port()
    process = shared_gateway(tmp_path_factory, upstreams, pki, RULES, name="hello", args=[
        "--set", f"egress_client_hello_timeout={HELLO_TIMEOUT}", "--set", f"egress_head_timeout={HEAD_TIMEOUT}",
        "--metrics", f"127.0.0.1:{metrics_port}"])
    process.metrics_port = metrics_port
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def fresh(upstreams):
    upstreams.reset()


def scrape(gateway) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5) as response:
        return samples(response.read().decode())


def open_tunnel(gateway, kind: str):
    conn, answer = tunnel(gateway, DESTINATIONS[kind], timeout=10)
    assert answer.status == 200, answer.body
    return conn


def oversized_hello_head(declared: int = 0xFFFFFF) -> bytes:
    """A record header and a handshake header declaring `declared` bytes, and the hello's start."""
    body = b"\x01" + declared.to_bytes(3, "big") + b"\x03\x03" + bytes(32)
    return b"\x16\x03\x01" + struct.pack("!H", 16384) + body + bytes(16384 - len(body))


def one_refusal(gateway, client: str, reason: str) -> dict:
    """The connection's one audit line after its CONNECT's (written before the close was sent)."""
    lines = [e for e in audit_for(gateway, client, 2, wait=5) if e["event"] != "connect"]
    assert [(e["event"], e["decision"], e["reason"], e["status"]) for e in lines] == [
        ("connection", "deny", reason, None)], lines
    return lines[0]


@pytest.mark.parametrize("kind", DESTINATIONS)
def test_an_oversized_client_hello_is_refused_from_its_header(gateway, upstreams, kind):
    before = value(scrape(gateway), "egress_connections_total", reason="client_hello_too_large")
    conn = open_tunnel(gateway, kind)
    conn.sock.sendall(oversized_hello_head())
    sent = 0
    try:  # a multi-MiB hello: the gateway closes at its first record, whatever follows
        for _ in range(256):
            conn.sock.sendall(b"\x16\x03\x01\x40\x00" + bytes(16384))
            sent += 16389
    except OSError:
        pass
    _, answer = wait_closed(conn.sock, timeout=10)
    assert answer.startswith(ALERT), answer[:50]
    line = one_refusal(gateway, conn.client, "client_hello_too_large")
    assert "16777219" in line["message"] and "65536" in line["message"]
    assert upstreams.untouched("allowed.test", "other.test")
    assert value(scrape(gateway), "egress_connections_total", reason="client_hello_too_large") == before + 1


@pytest.mark.parametrize("kind", DESTINATIONS)
def test_a_silent_client_hello_is_closed_by_the_timer(gateway, upstreams, kind):
    conn = open_tunnel(gateway, kind)
    conn.sock.sendall(client_hello("allowed.test")[:40])  # then nothing: the client has gone silent
    started = time.monotonic()
    _, answer = wait_closed(conn.sock, timeout=HELLO_TIMEOUT + 8)
    assert time.monotonic() - started >= HELLO_TIMEOUT - 0.5
    assert answer == ALERT
    one_refusal(gateway, conn.client, "client_hello_timeout")
    assert upstreams.untouched("allowed.test", "other.test")


def test_a_record_header_in_pieces_is_on_the_hello_clock(gateway, upstreams):
    """Two bytes of a record header, then silence: not yet TLS to the classifier, held all the same."""
    conn = open_tunnel(gateway, "inspected")
    conn.sock.sendall(b"\x16\x03")
    _, answer = wait_closed(conn.sock, timeout=HELLO_TIMEOUT + 8)
    assert answer == ALERT
    one_refusal(gateway, conn.client, "client_hello_timeout")


@pytest.mark.parametrize("first", [b"PRI * HT", b"G"], ids=["h2-preface-start", "one-byte"])
def test_first_bytes_still_being_classified_have_a_deadline(gateway, upstreams, first):
    """In a tunnel, a few bytes that are not yet TLS or HTTP, then silence: closed at egress_head_timeout,
    not held until tcp_timeout."""
    conn = open_tunnel(gateway, "inspected")
    conn.sock.sendall(first)
    wait_closed(conn.sock, timeout=HEAD_TIMEOUT + 8)
    lines = audit_for(gateway, conn.client, 1, wait=5)
    assert lines[-1]["reason"] == "request_head_timeout", lines
    assert upstreams.untouched("allowed.test")


def test_a_hello_that_cannot_be_parsed_is_refused(gateway, upstreams):
    """Complete by its lengths, in 16-byte records, but not a ClientHello inside."""
    message = b"\x01" + (600).to_bytes(3, "big") + b"\xff" * 600
    wire = b"".join(b"\x16\x03\x01" + struct.pack("!H", len(message[i:i + 16])) + message[i:i + 16]
                    for i in range(0, len(message), 16))
    conn = open_tunnel(gateway, "inspected")
    conn.sock.sendall(wire)
    _, answer = wait_closed(conn.sock, timeout=10)
    assert answer == ALERT
    one_refusal(gateway, conn.client, "bad_client_hello")


def test_a_real_client_is_served_and_the_limit_is_configurable(gateway, start_gateway, upstreams):
    small = start_gateway(RULES, args=["--set", "egress_max_client_hello_bytes=200"])
    assert curl(small, "https://allowed.test/too-big").status == 0
    lines = [e for e in small.audit() if e["reason"] == "client_hello_too_large"]
    assert len(lines) == 1 and "limit 200" in lines[0]["message"], small.audit()
    assert upstreams.untouched("allowed.test")
    assert curl(gateway, "https://allowed.test/hello").status == 200  # the default fits a real client


def test_tls_sent_straight_to_the_proxy_port_is_refused_at_once(gateway):
    sock = socket.create_connection((gateway.host, gateway.port), timeout=10)
    client = "%s:%d" % sock.getsockname()[:2]
    sock.sendall(oversized_hello_head())
    wait_closed(sock, timeout=10)
    assert audit_for(gateway, client, 1)[0]["reason"] == "non_http"


@pytest.mark.parametrize("kind", DESTINATIONS)
@pytest.mark.parametrize("items", ["extensions", "cipher_suites"])
def test_a_hello_of_too_many_items_is_refused_before_it_is_parsed(gateway, upstreams, kind, items):
    """Small in bytes, but with more extensions (or cipher suites) than any client sends: a TLS
    alert and a close, one `client_hello_too_large` line, no upstream connection. Before: a 64 KiB
    hello of ~16,000 empty extensions cost ~100 ms of CPU to parse (80 ms relayed), so 45 a second
    saturated a worker."""
    from tests.unit.test_client_hello_reader import _with_items
    message = _with_items(extra_extensions=200) if items == "extensions" else _with_items(extra_suites=600)
    conn = open_tunnel(gateway, kind)
    conn.sock.sendall(b"\x16\x03\x01" + struct.pack("!H", len(message)) + message)
    _, answer = wait_closed(conn.sock, timeout=10)
    assert answer == ALERT
    line = one_refusal(gateway, conn.client, "client_hello_too_large")
    assert items.replace("_", " ") in line["message"], line
    assert upstreams.untouched(DESTINATIONS[kind].split(":")[0])
