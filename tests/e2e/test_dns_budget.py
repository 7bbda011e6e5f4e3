"""DNS mode's queries take tokens from the sandbox's DNS bucket (review 35): past the bucket a query is
refused and the client's connection closed, so that a flood from one UDP address and port is
dropped by mitmproxy_rs instead of queued without limit, and the audit log stays bounded."""

from __future__ import annotations

import socket
import struct

from tests.e2e.helpers import extra_static_hosts, fresh_upstreams  # noqa: F401  (fixtures are used by name)
from tests.support.gateway import free_port
from tests.support.topology import dns_query_packet, parse_dns_reply
from tests.support.waiting import value_when
from addons.dns_layer import MAX_RATE_REFUSED_IN_A_ROW

BURST = 5
RULES = """
- id: names
  hosts: [a.test]
"""


def _gateway(start_gateway, upstreams):
    port = free_port("127.0.0.1")
    gateway = start_gateway(RULES, extra=extra_static_hosts({"a.test": f"{upstreams.block}.9"}), args=[
        "--mode", f"dns@127.0.0.1:{port}", "--set", f"egress_dns_query_burst_per_sandbox={BURST}",
        "--set", "egress_max_dns_queries_per_second_per_sandbox=0.001"])  # (no token comes back during the test)
    return gateway, port


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(3)
    return sock


def _ask(sock: socket.socket, port: int, query_id: int):
    sock.sendto(dns_query_packet("a.test", "A", query_id), ("127.0.0.1", port))
    return parse_dns_reply(sock.recv(4096))


def _ready(gateway) -> bool:
    """Every listener is up, the DNS one's UDP and TCP too (the gateway says so once, in its log)."""
    return "egress gateway: ready: listening on" in gateway.log()


def test_a_udp_flood_past_the_request_bucket_is_refused_then_not_read(start_gateway, upstreams):
    gateway, port = _gateway(start_gateway, upstreams)
    assert value_when(lambda: _ready(gateway), bool, 10), gateway.log()[-2000:]
    flood, other = _udp(), _udp()
    try:
        answers = [_ask(flood, port, i).rcode for i in range(BURST)]
        assert answers == ["NOERROR"] * BURST
        for query_id in range(BURST, BURST + MAX_RATE_REFUSED_IN_A_ROW):  # the bucket is empty: refused ...
            assert _ask(flood, port, query_id).rcode == "REFUSED"
        flood.sendto(dns_query_packet("a.test", "A", 999), ("127.0.0.1", port))  # ... and then cut off: dropped
        assert _ask(other, port, 100).rcode == "REFUSED"  # another port of the same sandbox: answered, refused
        flood.setblocking(False)
        try:
            extra = flood.recv(4096)
        except BlockingIOError:
            extra = None
        assert extra is None, parse_dns_reply(extra)
    finally:
        flood.close()
        other.close()
    lines = gateway.audit_lines(0, count=1, event="dns", reason="rate_limited")
    assert lines and lines[0]["decision"] == "deny"  # (the rest within the refusal aggregation)


def test_a_tcp_client_past_the_request_bucket_gets_refused_then_closed(start_gateway, upstreams):
    gateway, port = _gateway(start_gateway, upstreams)
    assert value_when(lambda: _ready(gateway), bool, 10), gateway.log()[-2000:]
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        for query_id in range(BURST):
            query = dns_query_packet("a.test", "A", query_id)
            sock.sendall(struct.pack("!H", len(query)) + query)
        for query_id in range(BURST, BURST + MAX_RATE_REFUSED_IN_A_ROW + 10):  # the last 10 never read
            refused = dns_query_packet("a.test", "A", query_id)
            sock.sendall(struct.pack("!H", len(refused)) + refused)
        data = b""
        while chunk := sock.recv(65536):  # until the gateway closes
            data += chunk
    rcodes = []
    while data:
        (size,) = struct.unpack("!H", data[:2])
        rcodes.append(parse_dns_reply(data[2:2 + size]).rcode)
        data = data[2 + size:]
    assert rcodes == ["NOERROR"] * BURST + ["REFUSED"] * MAX_RATE_REFUSED_IN_A_ROW
