"""An HTTP/2 client that never reads cannot make the gateway hold a download in memory: its
upstream is throttled (addons/h2_backpressure.py), while a client that reads gets every byte."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.settings

from tests.e2e.helpers import fresh_upstreams, gateway, tls_tunnel  # noqa: F401  (fixtures)

SIZE = 64 * 1024 * 1024  # eight times the unread budget


def _client(conn, window: int, path: str = f"/chunked/{SIZE}"):
    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    client = h2.connection.H2Connection(config)
    client.local_settings.initial_window_size = window
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    conn.sock.sendall(client.data_to_send())
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", "allowed.test"),
                              (":path", path)], end_stream=True)
    conn.sock.sendall(client.data_to_send())
    return client, sid


def test_an_http2_client_that_never_reads_throttles_its_upstream(gateway, upstreams):  # noqa: F811
    """The event waited for: the origin's write blocks (its socket is full because the gateway
    stopped reading it). Before the gateway had back-pressure, the origin wrote all 64 MiB into the
    gateway's memory and never blocked."""
    origin = upstreams.tls["allowed.test"]
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client, sid = _client(conn, window=65535)
        conn.sock.settimeout(30)
        data = conn.sock.recv(65536)  # the response starts; from here on nothing is read
        assert data
        assert origin.stalled.wait(30), f"the origin was never throttled: it wrote {origin.written} bytes"
    assert origin.written < 24 * 1024 * 1024, origin.written  # 4 MiB of h2 buffer plus socket buffers


def test_an_http2_client_that_reads_gets_the_whole_body(gateway):  # noqa: F811
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client, sid = _client(conn, window=1 << 20)
        conn.sock.settimeout(30)
        received, done = 0, False
        while not done:
            data = conn.sock.recv(1 << 20)
            assert data
            for event in client.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)
                    client.acknowledge_received_data(event.flow_controlled_length, sid)
                elif isinstance(event, h2.events.StreamEnded):
                    done = True
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"reset after {received} bytes")
            conn.sock.sendall(client.data_to_send())
    assert received == SIZE


def test_what_waits_for_a_sandboxs_windows_is_bounded_per_sandbox(start_gateway, upstreams):
    """Bytes waiting for HTTP/2 flow-control windows are summed per sandbox (here: per client
    address), not only per connection: while one connection that never reads holds more than
    egress_h2_max_unread_bytes_per_sandbox (2 MiB here; each connection may hold 4 MiB), the
    sandbox's other HTTP/2 downloads wait too, and go on once it is gone. Before, each connection
    had its own 4 MiB, so N slow connections made the gateway hold N x 4 MiB. (The waiting
    download is small: the test origin gives up on a write that blocks for long.)"""
    SMALL = 200_000
    gateway = start_gateway("- id: allowed\n  hosts: [allowed.test]\n",
                            args=["--set", f"egress_h2_max_unread_bytes_per_sandbox={2 * 1024 * 1024}"])
    origin = upstreams.tls["allowed.test"]
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as hog:
        _client(hog, window=65535)
        hog.sock.settimeout(30)
        assert hog.sock.recv(65536)  # the response starts; from here on nothing is read
        assert origin.stalled.wait(30), f"the origin was never throttled: it wrote {origin.written} bytes"
        with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as reader:
            client, sid = _client(reader, window=1 << 20, path=f"/bytes/{SMALL}")
            reader.sock.settimeout(3)
            received = 0
            try:
                while True:  # a few bytes may come before its upstream's first gated read
                    data = reader.sock.recv(1 << 20)
                    assert data
                    for event in client.receive_data(data):
                        if isinstance(event, h2.events.DataReceived):
                            received += len(event.data)
                            client.acknowledge_received_data(event.flow_controlled_length, sid)
                        assert not isinstance(event, h2.events.StreamEnded), "the sandbox's total was not bounded"
                    reader.sock.sendall(client.data_to_send())
            except TimeoutError:
                pass
            assert received < SMALL, received
            hog.sock.close()  # the hog is gone: the sandbox's other downloads go on
            reader.sock.settimeout(30)
            done = False
            while not done:
                data = reader.sock.recv(1 << 20)
                assert data, received
                for event in client.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        received += len(event.data)
                        client.acknowledge_received_data(event.flow_controlled_length, sid)
                    elif isinstance(event, h2.events.StreamEnded):
                        done = True
                reader.sock.sendall(client.data_to_send())
            assert received == SMALL
