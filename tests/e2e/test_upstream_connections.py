"""Upstream connections that are over are let go while their client connection lasts (issue 15).

mitmproxy kept every upstream connection it opened for a client connection until the client left,
with its TLS layer, HTTP client and last request and response: an HTTP/2 client's requests to an
HTTP/1 origin each take an upstream connection of their own, and an origin that closes after an
answer (an idle timeout, a server that closes after a POST) makes the next request on a kept-alive
tunnel open another. One long client
connection grew without bound (review 18: +66 MiB per 1,000 requests with a 30 KB cookie).

Connections that are not over but idle are bounded too: plain-HTTP requests on one proxy
connection may each go to another destination, and mitmproxy kept one open per destination for as
long as the client stayed (review 19: 10,600 sockets from one sandbox; other sandboxes' dials then
failed with EMFILE). Past `egress_max_idle_upstreams_per_connection` the least recently used idle
ones are closed.

The proxy counts its own live `Server` objects (tests/support/held_servers_probe.py); it runs as
`mitmdump -s addons/egress.py -s <probe>`, the gateway's addons with one more script.
"""

from __future__ import annotations

import pytest

from tests.conftest import policy_text
from tests.e2e.helpers import H2Client, connect_proxy, get, tls_tunnel
from tests.support import held_servers_probe
from tests.support.gateway import wait_for_port
from tests.support.mitmdump import clean_env, start_mitmdump, stop
from tests.support.waiting import wait_for

RULES = """
- id: allowed
  hosts: [allowed.test]
"""
AUTHORITY = "allowed.test:443"
REQUESTS = 30
HELD_AT_MOST = 2  # the probe is answered by the proxy itself: 0 when nothing is left over


@pytest.fixture
def gateway(tmp_path, upstreams, pki):
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES))
    proc, proxy = start_mitmdump(tmp_path, policy, pki.ca_cert, ["-s", held_servers_probe.__file__], clean_env())
    try:
        wait_for_port(proxy.host, proxy.port, process=proc)
        upstreams.reset()
        yield proxy
    finally:
        stop(proc)


def _held_servers(answer) -> int:
    assert answer.status == 200, answer
    return int(answer.body)


def test_http1_keep_alive_to_an_origin_that_closes_after_each_answer(gateway, upstreams):
    origin = upstreams.tls["allowed.test"]
    with tls_tunnel(gateway, AUTHORITY) as conn:
        for i in range(REQUESTS):
            answer = get(conn, f"/close/{i}", "allowed.test")
            assert answer.status == 200, (i, answer)
            # the next request goes out once the proxy has seen this close (else it may race it)
            wait_for(lambda: gateway.log().count("server disconnect") > i, 5, f"server close {i} handled")
        held = _held_servers(get(conn, held_servers_probe.PATH, "allowed.test"))
    assert origin.connections >= REQUESTS  # every answer closed its connection
    assert held <= HELD_AT_MOST, f"{held} upstream connections held after {REQUESTS} requests"


def test_http2_client_to_an_http1_origin(gateway, upstreams):
    """Each HTTP/2 request to an HTTP/1 origin takes its own upstream connection (mitmproxy closes
    it after the answer), whether or not the origin would keep it alive."""
    client = H2Client(tls_tunnel(gateway, AUTHORITY, alpn=["h2"]))
    try:
        for i in range(REQUESTS):
            stream = client.send("allowed.test", f"/kept/{i}")
            client.wait(stream)
            assert client.responses[stream]["status"] == 200, client.responses[stream]
        stream = client.send("allowed.test", held_servers_probe.PATH)
        client.wait(stream)
        held = int(client.responses[stream]["body"])
    finally:
        client.conn.close()
    assert upstreams.tls["allowed.test"].connections >= REQUESTS
    assert held <= HELD_AT_MOST, f"{held} upstream connections held after {REQUESTS} requests"


def test_idle_upstream_connections_past_the_limit_are_closed(start_gateway, upstreams):
    """One proxy connection, absolute-form GETs to four destinations, one idle connection allowed:
    when a request takes a connection, the least recently used idle ones are closed (the origins see
    them end while the client connection is still open); a later request to a closed one's
    destination opens a new connection and is served."""
    names = list(upstreams.plain)
    rules = "".join(f"- id: r{i}\n  hosts: [{name}]\n  schemes: [http]\n" for i, name in enumerate(names))
    gateway = start_gateway(rules, args=["--set", "egress_max_idle_upstreams_per_connection=1"])
    with connect_proxy(gateway) as conn:
        for name in names:
            answer = get(conn, f"http://{name}/idle", name)
            assert answer.status == 200, (name, answer)
        first, second, *last = (upstreams.plain[name] for name in names)
        wait_for(lambda: first.ended and second.ended, 5, "the two least recently used closed")
        assert [upstream.ended for upstream in last] == [0] * len(last)
        assert get(conn, f"http://{names[0]}/again", names[0]).status == 200
        assert first.connections == 2

