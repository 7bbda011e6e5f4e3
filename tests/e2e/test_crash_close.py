"""A real gateway whose HTTP stream raises (addons/crash_close.py).

A bug in a layer is stood in for by tests/support/crash_injection: the gateway started here has it
on its PYTHONPATH, and its HTTP stream raises at a request head with `x-egress-test-crash`, or at a
response piece with the bytes `EGRESS-TEST-CRASH`. Before, mitmproxy logged "mitmproxy has
crashed!", dropped the event and carried on with the layer left halfway. Now:
- the sandbox's connection is reset (RST), and a streamed answer cut short is never a clean end;
- no upstream is opened for a request whose head raised;
- one `connection` line says `internal_error`;
- the gateway serves the next connection as before.
Over HTTP/1.1 in a TLS tunnel, plain HTTP through the proxy port, and HTTP/2."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest

from tests.e2e.helpers import (
    H2Client,
    assert_untouched,
    audit_for,
    connect_proxy,
    curl,
    extra_static_hosts,
    get,
    tls_tunnel,
)
from tests.support.gateway import PROJECT_ROOT, NamespacedGateway, free_port
from tests.support.tcp_origin import TcpOrigin, read_head

INJECTION = PROJECT_ROOT / "tests" / "support" / "crash_injection"
STREAM_OCTET = 240  # in the session block: the streaming origin
CRASH = [("x-egress-test-crash", "1")]


class TwoPartStream(TcpOrigin):
    """Answers an SSE stream with no length (it ends when the connection closes): a first event,
    then, once the test has read it (`read_first`), an event that makes the gateway's stream raise;
    then holds the connection until it is closed."""

    def __init__(self, host: str) -> None:
        self.read_first = threading.Event()
        self.ended = threading.Event()
        super().__init__(host, 80)

    def handle(self, conn: socket.socket, number: int) -> None:
        if read_head(conn) is None:
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                     b"data: first\n\n")
        self.read_first.wait(10)  # the client's acknowledgement (a deadline only if the test broke)
        try:
            conn.sendall(b"data: EGRESS-TEST-CRASH\n\n")
            while conn.recv(4096):
                pass
        except OSError:
            pass
        self.ended.set()


@pytest.fixture(scope="module")
def world(tmp_path_factory, upstreams, pki):
    origin = TwoPartStream(f"{upstreams.block}.{STREAM_OCTET}")
    workdir = tmp_path_factory.mktemp("crash")
    policy = workdir / "policy.yaml"
    from tests.conftest import policy_text

    policy.write_text(policy_text(upstreams, """
        - id: allowed
          hosts: [allowed.test]
        - id: stream
          hosts: [stream.crash.test]
          schemes: [http]
          ports: [80]
        """, extra_static_hosts({"stream.crash.test": origin.host})))
    port = free_port()
    gateway = NamespacedGateway(policy, workdir / "gw", port=port, upstream_ca=pki.ca_cert,
                                command_prefix=["env", f"PYTHONPATH={INJECTION}:{PROJECT_ROOT}", "EGRESS_TEST_CRASH=1"])
    gateway.start()
    upstreams.reset()
    yield gateway, origin
    gateway.stop()
    origin.stop()


def _read_to_end(sock) -> bytes | Exception:
    """What the socket gives until it ends: its bytes on a clean end, the exception on a reset.
    Through TLS, Python's ssl (OpenSSL 3) reports a TCP reset as `SSLEOFError`, as it does a FIN
    with no TLS close_notify; either way, not a clean end (which gives b"")."""
    sock.settimeout(10)
    if hasattr(sock, "suppress_ragged_eofs"):
        sock.suppress_ragged_eofs = False
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, ssl.SSLEOFError) as reset:
        return reset
    return got


def _crash_line(gateway, client: str) -> dict:
    lines = [a for a in audit_for(gateway, client, 1, wait=5, since=gateway.audit_mark)
             if a.get("event") == "connection" and a.get("reason") == "internal_error"]
    assert len(lines) == 1, audit_for(gateway, client, 1, since=gateway.audit_mark)
    return lines[0]


def _still_serves(gateway) -> None:
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert get(tls, "/after", "allowed.test").status == 200


def test_a_request_head_that_raises_resets_the_tunnel_and_opens_no_upstream(world, upstreams):
    gateway, _ = world
    gateway.mark()
    upstreams.reset()
    tls = tls_tunnel(gateway, "allowed.test:443")
    tls.send(b"GET /crash HTTP/1.1\r\nHost: allowed.test\r\nx-egress-test-crash: 1\r\n\r\n")
    ended = _read_to_end(tls.sock)
    assert isinstance(ended, Exception), f"the tunnel ended cleanly after {ended!r}, not with a reset"
    assert_untouched(upstreams, "allowed.test")
    line = _crash_line(gateway, tls.client)
    assert (line["decision"], line["status"]) == ("deny", None), line
    assert "mitmproxy has crashed! The egress gateway reset every socket" in gateway.log()
    _still_serves(gateway)


@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
def test_curl_reports_the_reset_as_a_failure(world, upstreams, version):
    """A real client: an error (exit 56 or 55: the reset met while receiving or while still sending,
    e.g. HTTP/2's settings acknowledgement), never a response or a clean end."""
    gateway, _ = world
    upstreams.reset()
    result = curl(gateway, "https://allowed.test/crash", version, "-H", "x-egress-test-crash: 1")
    assert result.returncode in (55, 56) and result.status == 0 and "reset by peer" in result.stderr, result
    assert_untouched(upstreams, "allowed.test")


def test_a_streamed_answer_cut_by_a_raise_is_reset_never_a_clean_end(world):
    """Its body runs until the connection closes: a FIN would read as the whole answer."""
    gateway, origin = world
    gateway.mark()
    conn = connect_proxy(gateway)
    conn.send(b"GET http://stream.crash.test/events HTTP/1.1\r\nHost: stream.crash.test\r\n\r\n")
    head = conn.read_until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    first = conn.read_until(b"\n\n")
    assert b"data: first" in first, first
    origin.read_first.set()
    ended = _read_to_end(conn.sock)
    assert isinstance(ended, ConnectionResetError), f"the answer ended with {ended!r}, not a reset"
    assert origin.ended.wait(10), "the upstream connection was not closed"
    _crash_line(gateway, conn.client)
    _still_serves(gateway)


def test_an_http2_stream_that_raises_resets_the_whole_connection(world, upstreams):
    gateway, _ = world
    gateway.mark()
    upstreams.reset()
    tls = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])
    client = H2Client(tls)
    fine = client.send("allowed.test", "/first")
    client.wait(fine)
    assert client.responses[fine]["status"] == 200
    client.send("allowed.test", "/crash", extra=CRASH)
    ended = _read_to_end(tls.sock)
    assert isinstance(ended, Exception), f"the connection ended cleanly after {ended!r}, not with a reset"
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/first"]
    _crash_line(gateway, tls.client)
    _still_serves(gateway)
