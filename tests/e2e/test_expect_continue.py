"""`Expect: 100-continue` on a request the gateway refuses at its head (RFC 9110 10.1.1).

A client that sends the expectation waits for `100 Continue` before it sends its body. mitmproxy
answers the 100 itself once the request's head is decided, also when the decision was a refusal:
the client then uploaded its whole body (an SDK's multi-MiB object, a git push) for the gateway to
read and throw away, and only then got its 403. A refused head is answered at once with its final
status instead, nothing invites the body, and the connection ends after the answer (HTTP/1: the
client may or may not send the body, so the framing of whatever follows is unknown); an allowed
one still gets its 100 and goes upstream.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    H2Client,
    build_request,
    connect_proxy,
    extra_static_hosts,
    fresh_upstreams,
    lenient_world,
    new_entry,
    tls_tunnel,
)

LAST_OCTET = 112  # in the session block

RULES = """
- id: upload
  hosts: [upload.test]
  schemes: [https, http]
  methods: [GET, POST, PUT]
  paths: ["/ok/**"]
  allow_body: true
"""

BODY_SIZE = 8 * 1024 * 1024  # what the client would upload if invited


@pytest.fixture(scope="module")
def world(tmp_path_factory, upstreams, pki):
    yield from lenient_world(tmp_path_factory, upstreams, pki, RULES, ["upload.test"], LAST_OCTET, "expect")


@pytest.fixture
def gw(world):
    return world.fresh()


def _expecting(method: str, target: str, host: str = "upload.test", size: int = BODY_SIZE) -> bytes:
    return build_request(method, target, [("Host", host), ("Expect", "100-continue"),
                                          ("Content-Length", str(size))])


def _refused_at_once(conn, status: int = 403):
    """The first answer is the final refusal (no 100), and it ends the connection."""
    response = conn.read_response()
    assert response.status == status, response
    assert response.egress_reason == "path_not_allowed", response
    assert response.header("connection").lower() == "close", response
    assert conn.closed()  # the connection ends after the answer, nothing else follows
    return response


def test_a_refused_head_is_answered_at_once_instead_of_inviting_its_body(gw, world):
    with tls_tunnel(gw, "upload.test:443") as tls:
        tls.send(_expecting("PUT", "/denied/object"))  # the body is never sent
        _refused_at_once(tls)
    assert world.tls_origin.connections == 0
    line = gw.audit_lines(gw.audit_mark, decision="deny", reason="path_not_allowed")[0]
    assert line["method"] == "PUT"


def test_a_refused_head_over_plain_http_is_answered_at_once(gw, world):
    conn = connect_proxy(gw)
    try:
        conn.send(_expecting("POST", "http://upload.test/denied"))
        _refused_at_once(conn)
    finally:
        conn.sock.close()
    assert world.plain_origin.connections == 0


def test_a_client_that_sends_its_body_without_waiting_still_reads_the_refusal(gw, world):
    """The client sends the head and the body in one go: the refusal is still read whole, not
    destroyed by a reset (the gateway reads and drops what comes after it before it closes)."""
    with tls_tunnel(gw, "upload.test:443") as tls:
        tls.send(_expecting("POST", "/denied", size=1024 * 1024) + b"x" * (1024 * 1024))
        _refused_at_once(tls)
    assert world.tls_origin.connections == 0


def test_an_allowed_head_still_gets_its_100_and_goes_upstream(gw, world):
    body = b"payload" * 10
    with tls_tunnel(gw, "upload.test:443") as tls:
        tls.send(_expecting("POST", "/ok/object", size=len(body)))
        interim = tls.read_response()
        assert interim.status == 100, interim
        tls.send(body)
        response = tls.read_response(method="POST")
        assert response.status == 200, response
    assert [e.path for e in world.tls_origin.executed] == ["/ok/object"]


def test_http2_a_refused_head_is_answered_without_an_interim_and_the_connection_goes_on(gw, world):
    client = H2Client(tls_tunnel(gw, "upload.test:443", alpn=["h2"]))
    sid = client.h2.get_next_available_stream_id()
    client.h2.send_headers(sid, [(":method", "PUT"), (":scheme", "https"), (":authority", "upload.test"),
                                 (":path", "/denied"), ("content-length", str(BODY_SIZE)),
                                 ("expect", "100-continue")])
    client._flush()
    client.responses[sid] = new_entry()
    client.wait(sid)
    entry = client.responses[sid]
    assert not entry.get("interim"), entry
    assert entry["status"] == 403 and client.header(sid, "x-egress-reason") == "path_not_allowed", entry
    after = client.send("upload.test", "/ok/after")
    client.wait(after)
    assert client.responses[after]["status"] == 200, client.responses[after]
    client.conn.close()
    assert [e.path for e in world.tls_origin.executed] == ["/ok/after"]


def test_curl_uploading_to_a_refused_path_gets_its_refusal_without_sending_the_body(gw, world, tmp_path):
    """curl asks for `100 Continue` before an HTTP/1.1 upload over 1 MiB: refused, it sends none of
    it. (Over HTTP/2 curl 7.88 does not ask, and sends its body whole.)"""
    upload = tmp_path / "object"
    upload.write_bytes(b"x" * BODY_SIZE)
    out = subprocess.run(["curl", "-sS", "--http1.1", "--max-time", "20", "--cacert", str(gw.ca_cert), "-x", gw.proxy_url,
                          "-T", str(upload), "-o", "/dev/null", "-w", "%{http_code} %{size_upload}",
                          "https://upload.test/denied/object"], capture_output=True, timeout=30)
    status, uploaded = out.stdout.decode().split()
    assert status == "403", out
    assert int(uploaded) < BODY_SIZE // 8, out  # (curl may send a little before the answer is read)
    assert world.tls_origin.connections == 0


def test_http2_rate_refusals_answered_at_once_still_end_in_goaway(start_gateway, upstreams):
    """Review 35b: 429s answered at once (a refused head with `expect`) went out past the
    connection's reset budget (300 answered, no GOAWAY); they count like any gateway 429."""
    import h2.events

    gateway = start_gateway(RULES, extra=extra_static_hosts({"upload.test": f"{upstreams.block}.{LAST_OCTET}"}), args=[
        "--set", "egress_max_requests_per_second_per_sandbox=0.001", "--set", "egress_request_burst_per_sandbox=1",
        "--set", "egress_h2_max_resets=20"])
    client = H2Client(tls_tunnel(gateway, "upload.test:443", alpn=["h2"]))
    answered, ended = 0, None
    for _ in range(100):
        sid = client.h2.get_next_available_stream_id()
        client.h2.send_headers(sid, [(":method", "PUT"), (":scheme", "https"), (":authority", "upload.test"),
                                     (":path", "/ok/object"), ("content-length", "10"), ("expect", "100-continue")])
        client._flush()
        client.responses[sid] = new_entry()
        try:
            client.wait(sid)
        except ConnectionError as goaway:
            ended = goaway
            break
        assert client.responses[sid]["status"] == 429, client.responses[sid]
        answered += 1
    assert ended is not None and "error_code:11" in str(ended), (answered, ended)  # ENHANCE_YOUR_CALM
    assert answered <= 21
    client.conn.close()


def test_a_refused_head_request_gets_no_body_and_the_connection_goes_on(gw, world):
    """Review 35b: a refused HEAD got its refusal's body, which Python's http.client then read as
    the next answer's status line."""
    with tls_tunnel(gw, "upload.test:443") as tls:
        tls.send(build_request("HEAD", "/ok/object", [("Host", "upload.test")]))  # (the rule allows no HEAD)
        refused = tls.read_response(method="HEAD")
        assert refused.status == 403 and refused.egress_reason == "method_not_allowed", refused
        after = tls.request("GET", "/ok/after", [("Host", "upload.test")])
        assert after.status == 200, after
    assert [e.path for e in world.tls_origin.executed] == ["/ok/after"]
