"""Restating the destination inside a transparent TLS connection pinned by its SNI: an HTTP/1.1
Host or an HTTP/2 :authority naming another host (connection coalescing, domain fronting) gets 421
and never leaves the gateway; TLS and plain HTTP on each other's ports are refused by port."""

from __future__ import annotations

import ssl

import pytest

from tests.netns.lab import read_response

from .clients import curl, http_exchange, http_request
from tests.support.topology import ALLOWED

pytestmark = pytest.mark.netns


def _tls(topology, site, server_name: str, alpn: str):
    sock = topology.connect(site.sandbox, ALLOWED, 443)
    context = ssl.create_default_context(cafile=str(site.ca))
    context.set_alpn_protocols([alpn])
    return context.wrap_socket(sock, server_hostname=server_name)


def test_http1_host_switch_inside_tls(topology, main):
    with _tls(topology, main, "allowed.test", "http/1.1") as tls:
        tls.sendall(http_request("allowed.test", "/first"))
        first = read_response(tls)
        tls.sendall(http_request("other.test", "/second"))
        second = read_response(tls)
    assert first.status == 200, first.text()
    assert (second.status, second.egress_reason) == (421, "host_mismatch"), second.text()
    assert [r.path for r in topology.server(f"{ALLOWED}:443").requests] == ["/first"]
    assert topology.touched() == [f"{ALLOWED}:443"]


def _h2_get(tls, conn, stream_id: int, authority: str, path: str) -> dict[str, str]:
    import h2.events

    conn.send_headers(stream_id, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                  (":path", path)], end_stream=True)
    tls.sendall(conn.data_to_send())
    headers: dict[str, str] = {}
    while True:
        data = tls.recv(65536)
        if not data:
            raise ConnectionError(f"connection closed while waiting for stream {stream_id}")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
                headers = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                           for k, v in event.headers}
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)) and event.stream_id == stream_id:
                tls.sendall(conn.data_to_send())
                return headers
        tls.sendall(conn.data_to_send())


def test_h2_authority_switch_on_one_connection(topology, main):
    h2_connection = pytest.importorskip("h2.connection")
    import h2.config

    with _tls(topology, main, "allowed.test", "h2") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2_connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        tls.sendall(conn.data_to_send())
        first = _h2_get(tls, conn, 1, "allowed.test", "/h2-first")
        second = _h2_get(tls, conn, 3, "other.test", "/h2-second")
    assert first.get(":status") == "200", first
    assert (second.get(":status"), second.get("x-egress-reason")) == ("421", "authority_mismatch"), second
    assert [r.path for r in topology.server(f"{ALLOWED}:443").requests] == ["/h2-first"]
    assert topology.touched() == [f"{ALLOWED}:443"]


def test_tls_on_port_80_is_refused_by_port(topology, main):
    result = curl(main.sandbox, main.ca, "https://allowed.test:80/tls-on-80")
    assert (result.status, result.egress_reason) == (403, "port_not_allowed"), result
    assert topology.touched() == []


def test_plain_http_on_port_443_is_refused_by_port(topology, main):
    with topology.connect(main.sandbox, ALLOWED, 443) as sock:
        (reply,) = http_exchange(sock, [http_request("allowed.test:443", "/plain-on-443", close=True)])
    assert (reply.status, reply.egress_reason) == (403, "port_not_allowed"), reply.text()
    assert topology.touched() == []
