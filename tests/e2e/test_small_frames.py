"""Small frames a sandbox sends (addons/frame_limits.py): every unit a protocol lets a client make
as small as it likes (an HTTP/1 chunk, an HTTP/2 DATA frame, a WebSocket frame, message or ping)
takes tokens from its sandbox's bucket; the unit that finds it empty ends its connection with one
`small_frame_flood` audit line. Under the budget the bytes arrive whole, and what one read brought
goes on merged (chunks, DATA frames, a message's fragments), not piece for piece.

Each test runs a gateway whose bucket barely refills (0.001 tokens a second) with a burst of
BURST tokens, so the count where the flood is cut is known in advance. One real gateway per test,
real TLS, a real origin on this session's loopback block (.190)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import h11
import h2.errors
import h2.events
import pytest

from tests.e2e.helpers import H2Client, ScriptedUpstream, audit_for, connect_proxy, extra_static_hosts, tls_tunnel
from tests.support.tcp_origin import start_accepting

OCTET = 190
CHUNKY_OCTET = 191  # an upstream that sends an endless chunk-size line
BURST = 400
RULES = """
- id: frames
  hosts: [frames.test, allowed.test, chunky.test]
  schemes: [http, https]
"""
_WS_ACCEPT = b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # for the sample key of RFC 6455


class FrameOrigin:
    """Plain HTTP on port 80. A request is read whole (h11: chunked or not) and answered 200 with
    the body's length and sha256 in headers; a WebSocket upgrade is answered 101, and then every
    client frame is parsed and recorded (opcode, fin, payload)."""

    def __init__(self, host: str):
        self.bodies: list[bytes] = []
        self.frames: list[tuple[int, bool, bytes]] = []
        self.changed = threading.Condition()
        self.closed = threading.Event()  # a connection it accepted was closed
        self.accepted = 0
        self.partial = 0  # body bytes read of requests not finished
        self._sock = socket.create_server((host, 80))
        start_accepting(self._sock, self._handle, on_accept=self._accepted)

    def _accepted(self, _client: socket.socket, _addr) -> None:
        self.accepted += 1

    def _handle(self, client: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        body = b""
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = client.recv(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    if dict(event.headers).get(b"upgrade", b"").lower() == b"websocket":
                        client.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                       b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + _WS_ACCEPT + b"\r\n\r\n")
                        self._websocket(client, conn.trailing_data[0])
                        return
                elif isinstance(event, h11.Data):
                    body += event.data
                    with self.changed:
                        self.partial += len(event.data)
                        self.changed.notify_all()
                elif isinstance(event, h11.EndOfMessage):
                    with self.changed:
                        self.bodies.append(body)
                        self.changed.notify_all()
                    digest = hashlib.sha256(body).hexdigest().encode()
                    client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Length: %d\r\nX-Sha256: %s\r\n\r\n"
                                   % (len(body), digest))
                    conn.start_next_cycle()
                    body = b""
        except (OSError, h11.ProtocolError):
            return
        finally:
            self.closed.set()
            client.close()

    def _websocket(self, client: socket.socket, data: bytes) -> None:
        buf = bytearray(data)
        while True:
            while (frame := _parse_frame(buf)) is not None:
                with self.changed:
                    self.frames.append(frame)
                    self.changed.notify_all()
            chunk = client.recv(65536)
            if not chunk:
                return
            buf += chunk

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout)

    def stop(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _parse_frame(buf: bytearray) -> tuple[int, bool, bytes] | None:
    """One client-to-server frame off the front of `buf` (masked), or None if it is not all there."""
    if len(buf) < 2:
        return None
    fin, opcode, n, at = bool(buf[0] & 0x80), buf[0] & 0x0F, buf[1] & 0x7F, 2
    if n == 126:
        if len(buf) < 4:
            return None
        n, at = int.from_bytes(buf[2:4], "big"), 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n, at = int.from_bytes(buf[2:10], "big"), 10
    masked = buf[1] & 0x80
    key = bytes(buf[at:at + 4]) if masked else b"\0\0\0\0"
    at += 4 if masked else 0
    if len(buf) < at + n:
        return None
    payload = bytes(b ^ key[i % 4] for i, b in enumerate(buf[at:at + n]))
    del buf[:at + n]
    return opcode, fin, payload


def _ws_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """A client frame, masked with a zero key (the payload goes as it is)."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    else:
        head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return head + b"\0\0\0\0" + payload


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@pytest.fixture
def world(start_gateway, upstreams):
    origin = FrameOrigin(f"{upstreams.block}.{OCTET}")
    gateway = start_gateway(RULES, extra_static_hosts({"frames.test": f"{upstreams.block}.{OCTET}",
                                                       "chunky.test": f"{upstreams.block}.{CHUNKY_OCTET}"}), args=[
        "--set", f"egress_small_frame_burst_per_sandbox={BURST}",
        "--set", "egress_max_small_frames_per_second_per_sandbox=0.001",
    ])
    yield gateway, origin
    origin.stop()


def _flood_line(gateway, client: str, event: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [a for a in audit_for(gateway, client, 1) if a.get("reason") == "small_frame_flood"]
        if found:
            assert len(found) == 1, found
            assert found[0]["event"] == event and found[0]["decision"] == "deny", found
            return found[0]
    raise AssertionError(f"no small_frame_flood line for {client}: {audit_for(gateway, client, 1)}")


def _post_chunked(conn, pieces: list[bytes]) -> None:
    conn.send(b"POST http://frames.test/up HTTP/1.1\r\nHost: frames.test\r\nContent-Type: application/octet-stream\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(pieces))


# -- HTTP/1 chunks --------------------------------------------------------------------------------

def test_small_chunks_under_the_budget_arrive_whole(world):
    """300 one-byte chunks cost 300 of the 400 tokens: the body arrives whole and unchanged."""
    gateway, origin = world
    pieces = [bytes([65 + i % 26]) for i in range(300)]
    conn = connect_proxy(gateway)
    _post_chunked(conn, pieces)
    response = conn.read_response()
    assert response.status == 200, response
    assert response.header("x-sha256") == hashlib.sha256(b"".join(pieces)).hexdigest()


def test_a_flood_of_one_byte_chunks_is_429_and_never_completes_upstream(world):
    gateway, origin = world
    conn = connect_proxy(gateway)
    try:
        _post_chunked(conn, [b"x"] * (3 * BURST))
    except OSError:
        pass  # closed while the flood was still being written
    response = conn.read_response()
    assert (response.status, response.egress_reason) == (429, "small_frame_flood"), response
    assert conn.closed()
    line = _flood_line(gateway, conn.client, "request")
    assert line["rule"] == "frames" and line["status"] == 429, line
    assert not origin.bodies  # the origin never had a whole request
    assert origin.accepted == 0 or origin.closed.wait(10), origin.accepted


def test_a_flood_after_the_body_started_upstream_resets_the_upstream(world):
    """The body is already streaming to the origin when the flood comes: the client gets 429 (no
    answer had started), and the upstream connection is closed with the request unfinished."""
    gateway, origin = world
    conn = connect_proxy(gateway)
    conn.send(b"POST http://frames.test/up HTTP/1.1\r\nHost: frames.test\r\nContent-Type: application/octet-stream\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n" + _chunked([b"s" * 5000])[:-5])
    assert origin.wait(lambda o: o.partial >= 5000), origin.partial
    try:
        conn.send(b"".join(b"1\r\nx\r\n" for _ in range(2 * BURST)))
    except OSError:
        pass
    response = conn.read_response()
    assert (response.status, response.egress_reason) == (429, "small_frame_flood"), response
    assert origin.closed.wait(10)
    assert not origin.bodies
    _flood_line(gateway, conn.client, "request")


@pytest.mark.parametrize("endless", [b"1;" + b"e" * 70000, b"0\r\n" + (b"X-T: " + b"v" * 1000 + b"\r\n") * 100],
                         ids=["chunk-extension", "trailer-section"])
def test_an_endless_chunk_line_or_trailer_section_is_431(world, endless):
    """h11 bounds neither a chunk-size line (its extensions) nor a trailer section; 300 MiB of one
    grew the worker by 300 MiB. Past egress_max_head_bytes: 431 chunk_line_too_large, closed (a
    section of many fields meets egress_max_header_fields first: tests/faults/test_limits_burst.py)."""
    gateway, origin = world
    conn = connect_proxy(gateway)
    conn.send(b"POST http://frames.test/up HTTP/1.1\r\nHost: frames.test\r\nTransfer-Encoding: chunked\r\n\r\n")
    try:
        for k in range(0, len(endless), 8192):
            conn.send(endless[k:k + 8192])
    except OSError:
        pass
    response = conn.read_response()
    assert (response.status, response.egress_reason) == (431, "chunk_line_too_large"), response
    assert conn.closed()
    assert not origin.bodies


@pytest.mark.parametrize("framing", [b"3\nabc\r\n0\r\n\r\n", b"3;a=b\r\n c=d\r\nabc\r\n0\r\n\r\n", b"zz\r\n"],
                         ids=["bare-lf", "folded-extension", "not-hex"])
def test_a_malformed_chunked_body_is_400_with_its_line(world, framing):
    """h11 refuses these; mitmproxy closed the connection without an answer or an audit line."""
    gateway, origin = world
    conn = connect_proxy(gateway)
    conn.send(b"POST http://frames.test/up HTTP/1.1\r\nHost: frames.test\r\nTransfer-Encoding: chunked\r\n\r\n" + framing)
    response = conn.read_response()
    assert (response.status, response.egress_reason) == (400, "malformed_request"), response
    assert conn.closed()
    assert [a for a in audit_for(gateway, conn.client, 2) if a.get("reason") == "malformed_request"]
    assert not origin.bodies


def test_an_upstreams_endless_chunk_line_is_cut_off(world, upstreams):
    """The same from an upstream (256 KiB, as for its response head): the upstream connection is
    closed and the client's response cut off, not grown without end."""
    gateway, _ = world
    upstream = ScriptedUpstream(f"{upstreams.block}.{CHUNKY_OCTET}", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"5\r\nhello\r\n1;" + b"e" * 400_000, port=80)
    try:
        conn = connect_proxy(gateway)
        conn.send(b"GET http://chunky.test/c HTTP/1.1\r\nHost: chunky.test\r\n\r\n")
        head = conn.read_until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") or head.startswith(b"HTTP/1.1 502"), head
        rest, conn.buf = bytes(conn.buf), b""
        conn.sock.settimeout(10)
        while chunk := conn.sock.recv(65536):  # until the gateway closes (a timeout fails the test)
            rest += chunk
        assert b"0\r\n\r\n" not in rest and len(rest) < 300_000, rest[:200]  # cut off, never the end
        lines = [a for a in audit_for(gateway, conn.client, 2) if a.get("reason") == "response_too_large"]
        assert lines, audit_for(gateway, conn.client, 2)
    finally:
        upstream.stop()


# -- HTTP/2 DATA frames --------------------------------------------------------------------------

def _h2_upload(gateway, frames: int, length: int | None = None):
    conn = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])
    client = H2Client(conn)
    headers = [(":method", "POST"), (":scheme", "https"), (":authority", "allowed.test"), (":path", "/h2up")]
    if length is not None:
        headers.append(("content-length", str(length)))
    sid = client.h2.get_next_available_stream_id()
    client.h2.send_headers(sid, headers)
    for k in range(frames):
        client.h2.send_data(sid, b"y", end_stream=k == frames - 1)
    return conn, client, sid


def test_small_data_frames_under_the_budget_arrive_whole(world, upstreams):
    """150 one-byte DATA frames cost 300 of the 400 tokens (two each)."""
    gateway, _ = world
    conn, client, sid = _h2_upload(gateway, 150, length=150)
    client.responses[sid] = {"status": None, "headers": [], "body": b"", "trailers": [], "done": False, "reset": False}
    client._flush()
    client.wait(sid)
    assert client.responses[sid]["status"] == 200, client.responses
    received = [r for r in upstreams.tls["allowed.test"].requests if r.path == "/h2up"]
    assert received and received[-1].body == b"y" * 150


def test_a_flood_of_one_byte_data_frames_ends_in_goaway(world, upstreams):
    gateway, _ = world
    conn, client, sid = _h2_upload(gateway, 2 * BURST)
    try:
        client._flush()
    except OSError:
        pass
    terminated = None
    deadline = time.monotonic() + 10
    while terminated is None and time.monotonic() < deadline:
        try:
            data = conn.sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        for event in client.h2.receive_data(data):
            if isinstance(event, h2.events.ConnectionTerminated):
                terminated = event
    assert terminated is not None and terminated.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, terminated
    line = _flood_line(gateway, conn.client, "connection")
    assert line["status"] is None and line["frames"] == BURST // 2 + 1, line
    assert not [r for r in upstreams.tls["allowed.test"].requests if r.path == "/h2up"]


# -- WebSockets ----------------------------------------------------------------------------------

def _websocket(gateway):
    conn = connect_proxy(gateway)
    conn.send(b"GET http://frames.test/ws HTTP/1.1\r\nHost: frames.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    assert conn.read_response(head_only=True).status == 101
    return conn


def _close_code(conn) -> int | None:
    """The code of the close frame the gateway sent (frames before it are skipped)."""
    data = b""
    try:
        while chunk := conn.sock.recv(65536):
            data += chunk
    except OSError:
        pass
    at = 0
    while at + 2 <= len(data):
        opcode, n = data[at] & 0x0F, data[at + 1] & 0x7F
        head = 2 + (2 if n == 126 else 8 if n == 127 else 0)
        if n >= 126:
            n = int.from_bytes(data[at + 2:at + head], "big")
        if opcode == 8:
            return int.from_bytes(data[at + head:at + head + 2], "big")
        at += head + n
    return None


def test_a_message_in_many_small_fragments_goes_on_as_one_frame(world):
    """300 one-byte fragments and one more (340 tokens): the origin gets the message whole, in one
    frame (the gateway sent it fragment for fragment before)."""
    gateway, origin = world
    conn = _websocket(gateway)
    conn.send(_ws_frame(1, b"a", fin=False) + b"".join(_ws_frame(0, b"b", fin=False) for _ in range(299))
              + _ws_frame(0, b"c", fin=True))
    assert origin.wait(lambda o: o.frames, 10), origin.frames
    assert origin.frames == [(1, True, b"a" + b"b" * 299 + b"c")]


@pytest.mark.parametrize("fragment", [300, 500, 1])
def test_a_text_message_goes_on_whole_and_never_split_inside_a_character(world, fragment):
    """27,000 bytes of "€" (three bytes each) in fragments of `fragment` bytes (500 and 1 split
    characters across fragments, which RFC 6455 allows): the origin gets the same text, and every
    frame it gets holds whole characters (mitmproxy decodes each fragment it sends on its own, and a
    cut inside a character came out as U+FFFD)."""
    gateway, origin = world
    conn = _websocket(gateway)
    text = ("€" * 9000).encode()
    pieces = [text[i:i + fragment] for i in range(0, len(text), fragment)] if fragment > 1 else [text[:100], text[100:]]
    frames = [_ws_frame(1 if k == 0 else 0, p, fin=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    conn.send(b"".join(frames))
    assert origin.wait(lambda o: o.frames and o.frames[-1][1], 10), origin.frames[-1:]
    assert b"".join(f[2] for f in origin.frames) == text
    for _, _, payload in origin.frames:
        payload.decode("utf-8")  # whole characters in every frame


def test_a_ping_flood_closes_both_sides_with_1008(world):
    gateway, origin = world
    conn = _websocket(gateway)
    try:
        conn.send(_ws_frame(9, b"p") * 200)  # ten tokens each: cut at the 41st
    except OSError:
        pass
    assert _close_code(conn) == 1008
    line = _flood_line(gateway, conn.client, "websocket")
    assert line["status"] is None and line["rule"] == "frames" and line["frames"] == BURST // 10 + 1, line
    assert origin.wait(lambda o: any(f[0] == 8 for f in o.frames), 10), origin.frames[-3:]
    assert [f for f in origin.frames if f[0] == 9] == [(9, True, b"p")] * (BURST // 10)


def test_a_flood_of_small_messages_closes_both_sides_with_1008(world):
    """Each small message costs forty tokens (its hooks and its own relay): ten go on, the
    eleventh ends the WebSocket."""
    gateway, origin = world
    conn = _websocket(gateway)
    try:
        conn.send(b"".join(_ws_frame(1, b"%d" % k) for k in range(40)))
    except OSError:
        pass
    assert _close_code(conn) == 1008
    _flood_line(gateway, conn.client, "websocket")
    assert origin.wait(lambda o: any(f[0] == 8 for f in o.frames), 10)
    assert [f[2] for f in origin.frames if f[0] == 1] == [b"%d" % k for k in range(BURST // 40)]


def test_a_large_message_is_not_metered(world):
    """A message of egress_small_frame_bytes or more costs nothing: 20 of them go on."""
    gateway, origin = world
    conn = _websocket(gateway)
    conn.send(b"".join(_ws_frame(2, bytes([k]) * 5000) for k in range(20)))
    assert origin.wait(lambda o: len(o.frames) >= 20, 10), len(origin.frames)
    messages, current = [], b""
    for opcode, fin, payload in origin.frames:
        current += payload
        if fin:
            messages.append(current)
            current = b""
    assert messages == [bytes([k]) * 5000 for k in range(20)]
    assert not [a for a in gateway.audit() if a.get("reason") == "small_frame_flood"]
