"""HTTP/2 budgets per client connection (gateway/h2budget.py, addons/http2_server.py GatewayHttp2Server):
streams over the concurrency limit are refused (RST_STREAM REFUSED_STREAM) and audited in
aggregate; a rapid-reset flood ends in GOAWAY ENHANCE_YOUR_CALM with one audit line and no
upstream request; a stream the client reset while its upstream connection was being made is
never sent; the request bodies one connection buffers stay within a budget (503 buffer_budget).
One real gateway, real TLS, real origins on this session's loopback block (.202: a gated h2 origin)."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import h2.errors
import h2.events
import h2.settings
import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures)
    H2Client, audit_for, extra_static_hosts, fresh_upstreams, get, shared_gateway, tls_tunnel,
)
from tests.support.h2_origin import serve_h2
from tests.support.tcp_origin import start_accepting
from tests.support.waiting import wait_for

MAX_STREAMS = 10
MAX_RESETS = 100
BUDGET = 256 * 1024
WAIT = 10.0

RULES = """
- id: allowed
  hosts: [allowed.test, gated.test]
"""


class GatedH2Origin:
    """An h2 origin that accepts TCP at once but starts its TLS handshake only once released, so a
    test can act while the gateway is still making its upstream connection. Records request paths."""

    def __init__(self, host: str, cert, key):
        self.accepted, self.release = threading.Event(), threading.Event()
        self.paths: list[str] = []
        self.seen = threading.Condition()
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(cert), str(key))
        self._tls.set_alpn_protocols(["h2"])
        self._sock = socket.create_server((host, 443))
        start_accepting(self._sock, self._handle)

    def _handle(self, raw: socket.socket) -> None:
        self.accepted.set()
        if not self.release.wait(WAIT * 3):
            raw.close()
            return
        serve_h2(raw, self._tls, self._answer, WAIT * 3)

    def _answer(self, sock, conn, event) -> None:
        with self.seen:
            self.paths.append(dict(event.headers)[":path"])
            self.seen.notify_all()
        conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", "3")])
        conn.send_data(event.stream_id, b"ok\n", end_stream=True)

    def stop(self) -> None:
        self.release.set()
        self._sock.close()


@pytest.fixture(scope="module")
def gated(upstreams, pki):
    host = f"{upstreams.block}.202"
    cert, key = pki.issue(["gated.test"], [host], stem="gated")
    origin = GatedH2Origin(host, cert, key)
    yield origin
    origin.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstreams, pki, gated):
    extra = extra_static_hosts({"gated.test": f"{upstreams.block}.202"})
    process = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name="h2limits", args=[
        "--set", f"egress_h2_max_concurrent_streams={MAX_STREAMS}", "--set", f"egress_h2_max_resets={MAX_RESETS}",
        "--set", "egress_h2_reset_window=30", "--set", f"egress_h2_max_buffered_bytes={BUDGET}"])
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def _audit_mark(gateway):
    gateway.mark()


@pytest.fixture(autouse=True)
def no_crash(gateway):
    """mitmproxy logs an exception in a layer and goes on: the refusal may be out while the
    stream behind it was never ended (and kept its buffer)."""
    before = len(gateway.log())
    yield
    new = gateway.log()[before:]
    assert "Traceback" not in new and "has crashed" not in new, new[-3000:]


def _events(client: H2Client, until, timeout: float = WAIT) -> list:
    """Read h2 events until `until(events so far)` holds; raises on timeout or close."""
    seen: list = []
    deadline = time.monotonic() + timeout
    client.conn.sock.settimeout(timeout)
    while not until(seen):
        if time.monotonic() > deadline:
            raise TimeoutError(f"h2 events so far: {seen}")
        data = client.conn.sock.recv(65536)
        if not data:
            seen.append("closed")
            continue
        for event in client.h2.receive_data(data):
            seen.append(event)
            if isinstance(event, h2.events.DataReceived):
                client.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        try:
            client._flush()
        except OSError:  # a flood's write cut short by the gateway's close: TLS cannot write again (BAD_LENGTH)
            pass
    return seen


def _headers(authority: str, path: str, method: str = "GET", extra: list | None = None) -> list:
    return [(":method", method), (":scheme", "https"), (":authority", authority), (":path", path)] + (extra or [])


def _refusals(gateway, client: str, reason: str, total: int) -> list[dict]:
    """The audit lines of one connection with `reason`, once their `repeated` counts add up to `total`."""
    def lines() -> list[dict]:
        return [a for a in gateway.audit_since_mark() if a.get("client") == client and a.get("reason") == reason]

    def counted() -> tuple[list[dict]] | None:
        found = lines()
        return (found,) if sum(a.get("repeated") or 1 for a in found) >= total else None

    try:
        return wait_for(counted, WAIT, f"{total} {reason} refusals")[0]
    except AssertionError:
        return lines()  # fewer: the caller's assertion says how many


def test_streams_over_the_concurrency_limit_are_refused_and_the_connection_goes_on(gateway, upstreams):
    """The gateway advertises MAX_CONCURRENT_STREAMS; a client that opens more anyway (here: before
    it read the SETTINGS) gets RST_STREAM REFUSED_STREAM for each stream over it, the streams under
    it are served, and the audit log gets at most a line per second for the refusals, with their
    count. Before: h2's own check tore the whole connection down at stream 101, with no audit."""
    extra = 3 * MAX_STREAMS
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        ids = []
        for _ in range(MAX_STREAMS + extra):
            ids.append(client.h2.get_next_available_stream_id())
            client.h2.send_headers(ids[-1], _headers("allowed.test", "/held", "POST", [("content-length", "2")]))
        client._flush()
        refused = lambda seen: {e.stream_id for e in seen if isinstance(e, h2.events.StreamReset)  # noqa: E731
                                and e.error_code == h2.errors.ErrorCodes.REFUSED_STREAM}
        seen = _events(client, lambda seen: len(refused(seen)) >= extra)
        assert refused(seen) == set(ids[MAX_STREAMS:])
        settings = next(e for e in seen if isinstance(e, h2.events.RemoteSettingsChanged))
        assert settings.changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == MAX_STREAMS
        # the streams under the limit go on
        client.h2.send_data(ids[0], b"ok", end_stream=True)
        client._flush()
        seen = _events(client, lambda seen: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == ids[0]
                                                for e in seen))
        answer = next(e for e in seen if isinstance(e, h2.events.ResponseReceived) and e.stream_id == ids[0])
        assert dict(answer.headers)[":status"] == "200"
        lines = _refusals(gateway, conn.client, "too_many_streams", extra)
    assert sum(a.get("repeated") or 1 for a in lines) == extra, lines
    assert len(lines) <= 2, lines  # the first at once, the rest of that second in one line
    assert all(a["decision"] == "deny" and a["status"] is None for a in lines), lines
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/held"]


def test_a_rapid_reset_flood_ends_in_goaway_and_reaches_no_upstream(gateway, upstreams):
    """HEADERS+RST_STREAM pairs as fast as the client can write them (CVE-2023-44487): GOAWAY
    ENHANCE_YOUR_CALM once more than MAX_RESETS streams were reset, the connection closes, one
    `reset_flood` line; a stream reset in the same read as its HEADERS is never decided (no audit
    line for it) and nothing reaches the upstream. Another client is served afterwards."""
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        sent = 0
        try:
            while sent < 4 * MAX_RESETS:
                for _ in range(25):
                    sid = client.h2.get_next_available_stream_id()
                    client.h2.send_headers(sid, _headers("allowed.test", "/flood"), end_stream=True)
                    client.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                    sent += 1
                client._flush()
        except OSError:
            pass  # the gateway closed the connection while the flood was still being written
        seen = _events(client, lambda seen: "closed" in seen)
        goaway = [e for e in seen if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, seen
        lines = audit_for(gateway, conn.client, count=1)
        flood = _refusals(gateway, conn.client, "reset_flood", 1)
    assert len(flood) == 1 and flood[0]["event"] == "connection" and flood[0]["status"] is None, flood
    decided = [a for a in gateway.audit_since_mark() if a.get("client") == conn.client and a.get("path") == "/flood"]
    assert len(decided) < MAX_RESETS // 4, len(decided)  # not one decision per stream
    assert not [r for r in upstreams.tls["allowed.test"].requests if r.path == "/flood"]
    with tls_tunnel(gateway, "allowed.test:443") as other:
        assert get(other, "/after", "allowed.test").status == 200
    assert lines


def test_one_read_of_many_streams_is_handled_in_order_across_loop_steps(gateway, upstreams):
    """One write opens MAX_STREAMS streams (more than GatewayHttp2Server.STREAMS_PER_STEP, so the
    rest wait in the backlog for a later step of the loop) and resets the last one: every other
    stream is answered and reaches the origin, in order, and the reset one is never decided nor
    sent upstream."""
    from addons.http2_server import GatewayHttp2Server

    assert MAX_STREAMS > GatewayHttp2Server.STREAMS_PER_STEP
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        ids = []
        for n in range(MAX_STREAMS):
            ids.append(client.h2.get_next_available_stream_id())
            client.h2.send_headers(ids[-1], _headers("allowed.test", f"/step{n}"), end_stream=True)
        client.h2.reset_stream(ids[-1], h2.errors.ErrorCodes.CANCEL)
        client._flush()
        ended = lambda seen: {e.stream_id for e in seen if isinstance(e, h2.events.StreamEnded)}  # noqa: E731
        seen = _events(client, lambda seen: ended(seen) >= set(ids[:-1]))
        statuses = {e.stream_id: dict(e.headers)[":status"] for e in seen if isinstance(e, h2.events.ResponseReceived)}
    assert statuses == {sid: "200" for sid in ids[:-1]}, statuses
    paths = [r.path for r in upstreams.tls["allowed.test"].requests if r.path.startswith("/step")]
    assert sorted(paths) == [f"/step{n}" for n in range(MAX_STREAMS - 1)], paths
    decided = [a for a in gateway.audit_since_mark() if a.get("client") == conn.client and a.get("path") == f"/step{MAX_STREAMS - 1}"]
    assert not decided, decided


def test_the_goaway_of_a_flood_reaches_a_client_that_is_still_writing(gateway):
    """A flooder that keeps writing after its GOAWAY is sent still gets to read the GOAWAY: the
    gateway half-closes and lingers instead of closing with the flood unread (the kernel would
    answer that with a reset, destroying the GOAWAY on its way), and closes in full once the client
    does."""
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        for _ in range(4 * MAX_RESETS):
            sid = client.h2.get_next_available_stream_id()
            client.h2.send_headers(sid, _headers("allowed.test", "/flood-on"), end_stream=True)
            client.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        flood = client.h2.data_to_send()
        for n in range(20000):
            client.h2.ping(n.to_bytes(8, "big"))
        flood += client.h2.data_to_send()  # ~340 KB the gateway will not want to read
        writer = threading.Thread(target=lambda: _write_all(conn.sock, flood), daemon=True)
        writer.start()
        seen, ended = [], None
        conn.sock.settimeout(WAIT)
        while ended is None:
            try:
                data = conn.sock.recv(65536)
            except OSError as exc:  # a reset, or TLS without close_notify: either way the end
                ended = exc
                break
            if not data:
                ended = "closed"
                break
            seen += client.h2.receive_data(data)
        writer.join(WAIT)
    goaway = [e for e in seen if isinstance(e, h2.events.ConnectionTerminated)]
    assert not isinstance(ended, ConnectionResetError), (ended, seen[-3:])
    assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, (ended, seen[-3:])


def _write_all(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # closed by the gateway while still writing: what the test is about


def test_a_stream_reset_while_its_upstream_connection_is_made_is_never_sent(gateway, gated):
    """The request was decided and its upstream connection is being made when the client resets
    it: once the connection is up, nothing of that stream goes upstream (mitmproxy sent the whole
    request and only then the reset; a flood forwarded ~1,000 cancelled GETs). A later stream on
    the same client connection uses the same upstream connection, so what reaches the origin
    first shows whether the reset one was sent."""
    with tls_tunnel(gateway, "gated.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        first = client.send("gated.test", "/first")
        assert gated.accepted.wait(WAIT), "the gateway never connected upstream"
        client.h2.reset_stream(first, h2.errors.ErrorCodes.CANCEL)
        client.h2.ping(b"resetnow")  # answered after the reset was read
        client._flush()
        _events(client, lambda seen: any(isinstance(e, h2.events.PingAckReceived) for e in seen))
        gated.release.set()
        second = client.send("gated.test", "/second")
        client.wait(second, timeout=WAIT)
        assert client.responses[second]["status"] == 200
        with gated.seen:
            assert gated.seen.wait_for(lambda: gated.paths, WAIT)
    assert gated.paths == ["/second"]


def test_buffered_request_bodies_are_bounded_per_connection(gateway, upstreams):
    """Bodies of known length below stream_large_bodies are buffered until they end. Three streams
    of 90,000 bytes each, none ended, on a connection whose budget is 256 KiB: the stream whose
    DATA would pass the budget gets 503 buffer_budget (and never reaches the upstream); the two
    others are untouched and complete. Before: the gateway held every byte (+98 MiB for 100
    streams of 900 KB)."""
    piece = b"x" * 90_000
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        started = {h2.events.RemoteSettingsChanged, h2.events.WindowUpdated}
        _events(client, lambda seen: {type(e) for e in seen} >= started)
        ids = []
        for i in range(3):
            ids.append(client.h2.get_next_available_stream_id())
            client.h2.send_headers(ids[-1], _headers("allowed.test", f"/upload{i}", "POST",
                                                     [("content-length", str(len(piece) + 1))]))
            client.h2.send_data(ids[-1], piece)
            client._flush()
            for sid in ids:
                client.responses.setdefault(sid, {"status": None, "headers": [], "body": b"", "trailers": [],
                                                  "done": False, "reset": False})
        client.wait(ids[2], timeout=WAIT)
        refused = client.responses[ids[2]]
        assert refused["status"] == 503 and client.header(ids[2], "x-egress-reason") == "buffer_budget", refused
        for sid in ids[:2]:
            client.h2.send_data(sid, b"!", end_stream=True)
        client._flush()
        client.wait(*ids[:2], timeout=WAIT)
        assert [client.responses[s]["status"] for s in ids[:2]] == [200, 200]
        lines = _refusals(gateway, conn.client, "buffer_budget", 1)
    assert len(lines) == 1 and lines[0]["status"] == 503 and lines[0]["path"] == "/upload2", lines
    received = {r.path: len(r.body) for r in upstreams.tls["allowed.test"].requests}
    assert received == {"/upload0": len(piece) + 1, "/upload1": len(piece) + 1}, received


def _frame(kind: int, stream_id: int = 0, payload: bytes = b"", flags: int = 0) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


CONTROL_FLOODS = {
    "unknown_type": _frame(0xFA),
    "ping": _frame(0x6, payload=bytes(8)),
    "settings": _frame(0x4),
    "window_update": _frame(0x8, payload=(1).to_bytes(4, "big")),
    "priority": _frame(0x2, stream_id=1, payload=(0).to_bytes(4, "big") + b"\x0f"),
    "empty_data": _frame(0x0, stream_id=1),
}


@pytest.mark.parametrize("kind", CONTROL_FLOODS)
def test_a_control_frame_flood_ends_in_goaway(gateway, upstreams, kind):
    """Frames that carry no request, as fast as the client can write them (the default budget:
    1,000 in 10 s): GOAWAY ENHANCE_YOUR_CALM, one `control_frame_flood` line, and nothing upstream.
    Before: no limit at all; 546,075 unknown frames in 3 s took 27.7 s of the worker's CPU (each an
    h2 event and a log line) and stalled every other client for seconds."""
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        if kind == "empty_data":  # an open stream to send them on
            client.h2.send_headers(1, _headers("allowed.test", "/flood-data", "POST"))
            client._flush()
        try:
            for _ in range(10):
                conn.sock.sendall(CONTROL_FLOODS[kind] * 500)
        except OSError:
            pass  # closed while the flood was still being written
        seen = _events(client, lambda seen: "closed" in seen or any(
            isinstance(e, h2.events.ConnectionTerminated) for e in seen))
        goaway = [e for e in seen if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, seen
        flood = _refusals(gateway, conn.client, "control_frame_flood", 1)
    assert [(a["event"], a["decision"], a["status"]) for a in flood] == [("connection", "deny", None)], flood
    assert flood[0]["frames"] > 1000, flood
    assert not [r for r in upstreams.tls["allowed.test"].requests if r.path == "/flood-data"]
    assert "unknown HTTP/2 frame" not in gateway.log()  # dropped before mitmproxy logs each one
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as other:  # another connection is served
        other_client = H2Client(other)
        stream = other_client.send("allowed.test", "/after-flood")
        other_client.wait(stream)
        assert other_client.responses[stream]["status"] == 200


def test_a_long_download_earns_its_window_updates(gateway, upstreams):
    """A client that acknowledges every DATA frame it reads (one WINDOW_UPDATE for the stream and one
    for the connection each time) is not a flood, however long the download."""
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        for _ in range(3):
            client.send("allowed.test", f"/bytes/{2 * 1024 * 1024}")
            seen = _events(client, lambda seen: any(
                isinstance(e, (h2.events.StreamEnded, h2.events.ConnectionTerminated)) or e == "closed" for e in seen),
                timeout=30)
            assert not [e for e in seen if isinstance(e, h2.events.ConnectionTerminated) or e == "closed"], seen[-3:]
            frames = [e for e in seen if isinstance(e, h2.events.DataReceived)]
            assert sum(len(e.data) for e in frames) == 2 * 1024 * 1024 and len(frames) > 100
    assert not [a for a in gateway.audit_since_mark() if a.get("reason") == "control_frame_flood" and a.get("client") == conn.client]


def test_a_header_block_past_the_head_limit_ends_the_connection_before_it_is_decoded(gateway, upstreams):
    """HEADERS and CONTINUATION frames of 128 KiB carrying one multi-MiB value: h2 joined the whole
    block and HPACK decoded it in one ~2 s callback (every other client of the worker waited),
    then GOAWAY PROTOCOL_ERROR with no audit line. Now the frame that passes
    egress_max_head_bytes ends the connection: GOAWAY ENHANCE_YOUR_CALM, one
    `request_head_too_large` line, nothing upstream; what the client wrote after it is not read."""
    import hpack
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    block = hpack.Encoder().encode(_headers("allowed.test", "/block") + [("x-big", "v" * (1 << 20))], huffman=False)
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        piece = 16384  # the client's view of the gateway's max frame size before SETTINGS are read
        try:
            for n, at in enumerate(range(0, len(block), piece)):
                frame = HeadersFrame(1, block[at:at + piece]) if n == 0 else ContinuationFrame(1, block[at:at + piece])
                frame.flags = {"END_STREAM"} if n == 0 else set()
                if n >= 63:
                    break  # h2's own limit of 64 frames a block
                conn.sock.sendall(frame.serialize())
        except OSError:
            pass  # closed while the rest was being written
        seen = _events(client, lambda seen: "closed" in seen or any(
            isinstance(e, h2.events.ConnectionTerminated) for e in seen))
        goaway = [e for e in seen if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, seen
        lines = _refusals(gateway, conn.client, "request_head_too_large", 1)
    assert len(lines) == 1 and lines[0]["event"] == "connection" and lines[0]["status"] is None, lines
    assert not [r for r in upstreams.tls["allowed.test"].requests if r.path == "/block"]


def test_a_head_with_too_many_fields_is_refused_431_and_the_connection_goes_on(gateway, upstreams):
    """257 tiny fields (the default egress_max_header_fields is 256): 431 too_many_header_fields on
    the stream, nothing upstream; the next stream on the same connection is served."""
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as conn:
        client = H2Client(conn)
        many = client.send("allowed.test", "/many", extra=[(f"x-f{n}", "0") for n in range(257)])
        client.wait(many)
        assert client.responses[many]["status"] == 431
        assert dict(client.responses[many]["headers"])["x-egress-reason"] == "too_many_header_fields"
        enough = client.send("allowed.test", "/enough", extra=[(f"x-f{n}", "0") for n in range(90)])  # (the origin takes 100)
        client.wait(enough)
        assert client.responses[enough]["status"] == 200
        lines = _refusals(gateway, conn.client, "too_many_header_fields", 1)
    assert len(lines) == 1 and lines[0]["status"] == 431, lines
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/enough"]
