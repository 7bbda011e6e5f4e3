"""The TLS ClientHello budget on redirected connections: refused before mitmproxy parses it and
before any rule is looked up (to a destination no rule allows, as to an allowed one), with a TLS
alert, a close and one audit line; no upstream connection."""

from __future__ import annotations

import struct
import time

import pytest

from .clients import client_hello, wait_closed
from tests.support.topology import ALLOWED, OTHER

pytestmark = pytest.mark.netns

ALERT = b"\x15\x03\x03\x00\x02\x02\x28"
DEFAULT_TIMEOUT = 10  # egress_client_hello_timeout's default: the session's gateways keep it


def oversized_head() -> bytes:
    body = b"\x01" + (0xFFFFFF).to_bytes(3, "big") + b"\x03\x03" + bytes(32)
    return b"\x16\x03\x01" + struct.pack("!H", 16384) + body + bytes(16384 - len(body))


@pytest.mark.parametrize("address", [OTHER, ALLOWED], ids=["no-rule", "allowed-by-ip"])
def test_an_oversized_client_hello_is_refused_before_any_rule(topology, main, address):
    mark = main.audit_mark()
    with topology.connect(main.sandbox, address, 443) as sock:
        sock.sendall(oversized_head())
        try:
            for _ in range(128):  # 2 MiB more of it: nothing is read past the first header
                sock.sendall(b"\x16\x03\x01\x40\x00" + bytes(16384))
        except OSError:
            pass
        _, answer = wait_closed(sock, timeout=10)
    assert answer.startswith(ALERT), answer[:40]
    lines = main.audit_since(mark)
    assert [(e["event"], e["decision"], e["reason"], e["original_destination"]) for e in lines] == [
        ("connection", "deny", "client_hello_too_large", f"{address}:443")], lines
    assert topology.touched() == []


def test_a_silent_client_hello_is_closed_by_the_timer(topology, main):
    mark = main.audit_mark()
    with topology.connect(main.sandbox, OTHER, 443, timeout=DEFAULT_TIMEOUT + 10) as sock:
        sock.sendall(client_hello("other.test")[:60])
        started = time.monotonic()
        _, answer = wait_closed(sock, timeout=DEFAULT_TIMEOUT + 10)
    assert time.monotonic() - started >= DEFAULT_TIMEOUT - 1
    assert answer == ALERT
    lines = main.audit_since(mark)
    assert [(e["event"], e["reason"]) for e in lines] == [("connection", "client_hello_timeout")], lines
    assert topology.touched() == []


def test_a_hello_in_tiny_records_is_still_served(topology, main):
    """The control: a real hello split into 1-byte records is re-framed, parsed once and decided
    by its SNI as usual."""
    hello = client_hello("allowed.test")
    message = hello[5:]
    wire = b"".join(b"\x16\x03\x01\x00\x01" + message[i:i + 1] for i in range(len(message)))
    mark = main.audit_mark()
    with topology.connect(main.sandbox, ALLOWED, 443) as sock:
        sock.sendall(wire)
        sock.settimeout(5)
        first = sock.recv(5)
    assert first[:1] == b"\x16", first  # a ServerHello record
    lines = main.audit_since(mark)
    assert [(e["event"], e["decision"], e["sni"]) for e in lines] == [("tls", "allow", "allowed.test")], lines

