"""Streaming clients for the suite: HTTP/1.1 on a raw socket (the chunked framing is read and
checked byte by byte) and HTTP/2 with the `h2` library, both reading *incrementally* with bounded
waits, plus the collector that turns body bytes into events and fails with a clear message when
an event does not arrive.

A client is given a connected socket (a CONNECT tunnel wrapped in TLS, a plain connection to the
explicit proxy, or a socket opened inside a sandbox namespace for transparent mode), so the same
code serves every mode.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Callable

from tests.e2e.helpers import tunnel
from tests.support.gateway import GatewayProcess

from .origins import WAIT

_SIZE_LINE = re.compile(rb"^[0-9a-fA-F]+$")


def recv_by(sock, deadline: float) -> bytes | None:
    """One read bounded by `deadline` (time.monotonic(); TimeoutError past it): the bytes, b"" at a
    clean end (FIN, close_notify), None at an abrupt one (TLS EOF without close_notify, a reset)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    sock.settimeout(remaining)
    try:
        return sock.recv(65536)
    except (socket.timeout, TimeoutError):
        raise TimeoutError from None
    except (ssl.SSLEOFError, ConnectionResetError):
        return None

class Buffered:
    """A socket with a read buffer and deadline-bounded reads."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.eof = False
        self.eof_kind = ""  # "clean" (FIN / close_notify) or "abrupt" (TLS EOF without close_notify, reset)

    def fill(self, deadline: float) -> bool:
        """Read more; False at end of stream; TimeoutError past the deadline."""
        if self.eof:
            return False
        data = recv_by(self.sock, deadline)
        if data is None:
            self.eof, self.eof_kind = True, "abrupt"
            return False
        if not data:
            self.eof, self.eof_kind = True, "clean"
            return False
        self.buf += data
        return True

    def read_until(self, marker: bytes, deadline: float) -> bytes | None:
        while marker not in self.buf:
            if not self.fill(deadline):
                return None
        head, _, self.buf = self.buf.partition(marker)
        return head

    def read_exactly(self, n: int, deadline: float) -> bytes | None:
        while len(self.buf) < n:
            if not self.fill(deadline):
                return None
        data, self.buf = self.buf[:n], self.buf[n:]
        return data


class StreamBroken(AssertionError):
    pass


# -- HTTP/1.1 -------------------------------------------------------------------------------------------


@dataclass
class H1Client:
    """One HTTP/1.1 request on a socket, its response read incrementally.

    `chunks` keeps the data of every chunk exactly as framed (chunked responses), `framing` says
    how the body is delimited towards the client ("chunked", "length", "close")."""

    sock: socket.socket
    conn: Buffered = field(init=False)
    status: int | None = None
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    framing: str | None = None
    chunks: list[bytes] = field(default_factory=list)
    trailers: list[tuple[str, str]] = field(default_factory=list)
    ended: bool = False
    raw_terminator: bytes = b""
    _remaining: int = 0

    def __post_init__(self):
        self.conn = Buffered(self.sock)

    def send_request(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes | None = None) -> None:
        lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers)]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_chunk(self, data: bytes) -> None:
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if data else b"0\r\n\r\n")

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def read_head(self, what: str = "the response headers", timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                head = self.conn.read_until(b"\r\n\r\n", deadline)
            except TimeoutError:
                raise AssertionError(f"{what} never reached the client within {timeout:g}s: the gateway held "
                                     f"the response back (got {self.conn.buf[:200]!r})") from None
            if head is None:
                raise StreamBroken(f"the connection closed before {what} ({self.conn.eof_kind}): {self.conn.buf[:300]!r}")
            status_line, *lines = head.decode("latin-1").split("\r\n")
            version, status, *reason = status_line.split(" ", 2)
            assert version in ("HTTP/1.1", "HTTP/1.0"), status_line
            self.status, self.reason = int(status), (reason[0] if reason else "")
            self.headers = []
            for line in lines:
                name, _, value = line.partition(":")
                self.headers.append((name.strip(), value.strip()))
            if 100 <= self.status < 200 and self.status != 101:
                continue  # 100 Continue and friends: the real head follows
            break
        te = (self.header("transfer-encoding") or "").lower()
        if "chunked" in te:
            self.framing = "chunked"
        elif self.header("content-length") is not None:
            self.framing, self._remaining = "length", int(self.header("content-length"))
            self.ended = self._remaining == 0
        else:
            self.framing = "close"

    def read_some(self, deadline: float) -> bytes | None:
        """The next body bytes as they arrive (one whole chunk when chunked); None at the end of the
        body. Raises TimeoutError past the deadline and StreamBroken on a framing error."""
        if self.ended:
            return None
        conn = self.conn
        if self.framing == "chunked":
            line = conn.read_until(b"\r\n", deadline)
            if line is None:
                raise StreamBroken(f"the connection closed ({conn.eof_kind}) inside a chunked body, after "
                                   f"{len(self.chunks)} chunks and before the last-chunk")
            if not _SIZE_LINE.match(line):
                raise StreamBroken(f"bad chunk-size line {line[:80]!r} after {len(self.chunks)} chunks")
            size = int(line, 16)
            if size == 0:
                raw = b"0\r\n"
                while True:
                    tline = conn.read_until(b"\r\n", deadline)
                    if tline is None:
                        raise StreamBroken("the connection closed inside the trailer section")
                    raw += tline + b"\r\n"
                    if not tline:
                        break
                    name, _, value = tline.decode("latin-1").partition(":")
                    self.trailers.append((name.strip(), value.strip()))
                self.raw_terminator = raw
                self.ended = True
                return None
            data = conn.read_exactly(size + 2, deadline)
            if data is None:
                raise StreamBroken(f"the connection closed ({conn.eof_kind}) inside chunk {len(self.chunks) + 1}")
            if data[-2:] != b"\r\n":
                raise StreamBroken(f"chunk {len(self.chunks) + 1} is not followed by CRLF: {data[-10:]!r}")
            self.chunks.append(data[:-2])
            return data[:-2]
        if self.framing == "length":
            if self._remaining <= 0:
                self.ended = True
                return None
            if not conn.buf and not conn.fill(deadline):
                raise StreamBroken(f"the connection closed with {self._remaining} bytes of Content-Length missing")
            data, conn.buf = conn.buf[:self._remaining], conn.buf[self._remaining:]
            self._remaining -= len(data)
            if self._remaining == 0:
                self.ended = True
            return data
        # read until close
        if not conn.buf and not conn.fill(deadline):
            self.ended = True
            return None
        data, conn.buf = conn.buf, b""
        return data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- HTTP/2 ---------------------------------------------------------------------------------------------


@dataclass
class H2Response:
    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)  # unread DATA payloads
    frames: list[bytes] = field(default_factory=list)  # every DATA payload, in order
    trailers: list[tuple[str, str]] | None = None
    ended: bool = False
    reset: int | None = None

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


class H2Client:
    """An HTTP/2 client connection (h2) over a TLS socket that negotiated h2; reads incrementally."""

    def __init__(self, sock: ssl.SSLSocket):
        import h2.config
        import h2.connection

        assert sock.selected_alpn_protocol() == "h2", f"ALPN is {sock.selected_alpn_protocol()!r}, not h2"
        self.sock = sock
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(1 << 24)
        self._flush()
        self.responses: dict[int, H2Response] = {}
        self.closed = False

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, authority: str, path: str, method: str = "GET", headers: list[tuple[str, str]] = (),
                body: bytes | None = b"", end_stream: bool = True, scheme: str = "https") -> int:
        """Open a stream. With end_stream=False the body follows through send_data()."""
        sid = self.h2.get_next_available_stream_id()
        pseudo = [(":method", method), (":scheme", scheme), (":authority", authority), (":path", path)]
        no_body = end_stream and not body
        self.h2.send_headers(sid, pseudo + [(k.lower(), v) for k, v in headers], end_stream=no_body)
        self.responses[sid] = H2Response()
        if body and end_stream:
            self.h2.send_data(sid, body, end_stream=True)
        self._flush()
        return sid

    def send_data(self, sid: int, data: bytes, end_stream: bool = False, deadline: float | None = None) -> None:
        deadline = deadline or time.monotonic() + WAIT
        while data:
            window = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if window <= 0:
                self.pump(deadline)
                continue
            self.h2.send_data(sid, data[:window])
            data = data[window:]
        if end_stream:
            self.h2.end_stream(sid)
        self._flush()

    def end_stream(self, sid: int) -> None:
        self.h2.end_stream(sid)
        self._flush()

    def pump(self, deadline: float) -> None:
        """Read once (bounded by the deadline) and dispatch the events."""
        import h2.events

        if self.closed:
            raise StreamBroken("the HTTP/2 connection is closed")
        data = recv_by(self.sock, deadline)
        if not data:
            self.closed = True
            raise StreamBroken(f"the HTTP/2 connection closed; streams: {self.responses}")
        for event in self.h2.receive_data(data):
            sid = getattr(event, "stream_id", None)
            response = self.responses.get(sid)
            if isinstance(event, h2.events.ResponseReceived) and response is not None:
                response.headers = [(k, v) for k, v in event.headers if not k.startswith(":")]
                response.status = int(dict(event.headers)[":status"])
            elif isinstance(event, h2.events.InformationalResponseReceived):
                pass
            elif isinstance(event, h2.events.DataReceived) and response is not None:
                self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                if event.data:
                    response.data.append(event.data)
                    response.frames.append(event.data)
            elif isinstance(event, h2.events.TrailersReceived) and response is not None:
                response.trailers = [(k, v) for k, v in event.headers]
            elif isinstance(event, h2.events.StreamEnded) and response is not None:
                response.ended = True
            elif isinstance(event, h2.events.StreamReset) and response is not None:
                response.ended, response.reset = True, event.error_code
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True
                for r in self.responses.values():
                    if not r.ended:
                        r.ended, r.reset = True, -1
        self._flush()

    def read_head(self, sid: int, what: str = "the response headers", timeout: float = WAIT) -> H2Response:
        deadline = time.monotonic() + timeout
        response = self.responses[sid]
        while response.status is None:
            if response.ended:
                raise StreamBroken(f"stream {sid} ended (reset {response.reset}) before {what}")
            try:
                self.pump(deadline)
            except TimeoutError:
                raise AssertionError(f"{what} never reached the client within {timeout:g}s: the gateway held "
                                     "the response back") from None
        return response

    def read_some(self, sid: int, deadline: float) -> bytes | None:
        response = self.responses[sid]
        while not response.data:
            if response.ended:
                if response.reset is not None:
                    raise StreamBroken(f"stream {sid} was reset (error code {response.reset})")
                return None
            self.pump(deadline)
        return response.data.pop(0)

    def wait_end(self, sid: int, timeout: float = WAIT) -> H2Response:
        deadline = time.monotonic() + timeout
        response = self.responses[sid]
        while not response.ended:
            try:
                self.pump(deadline)
            except TimeoutError:
                raise AssertionError(f"stream {sid} did not end within {timeout:g}s") from None
        return response

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- events ---------------------------------------------------------------------------------------------


def sse_split(body: bytes) -> list[bytes]:
    """Complete SSE events (each with its blank-line terminator)."""
    parts = body.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]]


def ndjson_split(body: bytes) -> list[bytes]:
    parts = body.split(b"\n")
    return [p + b"\n" for p in parts[:-1]]


def grpc_split(body: bytes) -> list[bytes]:
    """Complete length-prefixed gRPC messages (flag byte, 4-byte length, payload)."""
    out, i = [], 0
    while len(body) - i >= 5:
        n = int.from_bytes(body[i + 1:i + 5], "big")
        if len(body) - i - 5 < n:
            break
        out.append(body[i:i + 5 + n])
        i += 5 + n
    return out


class Events:
    """Turns a client's incremental body into events and waits for them, one at a time."""

    def __init__(self, read_some: Callable[[float], bytes | None], split: Callable[[bytes], list[bytes]] = sse_split,
                 what: str = "event", note: Callable[[], str] | None = None):
        self.read_some = read_some
        self.note = note
        self.split = split
        self.what = what
        self.body = b""
        self.ended = False

    def expect(self, n: int, expected: bytes | None = None, timeout: float = WAIT) -> bytes:
        """Wait until event n (1-based) has arrived whole; check it against `expected`."""
        deadline = time.monotonic() + timeout
        while len(self.split(self.body)) < n:
            if self.ended:
                raise AssertionError(
                    f"{self.what} {n} never reached the client: the body ended after "
                    f"{len(self.split(self.body))} {self.what}s ({len(self.body)} bytes) - the gateway cut the "
                    f"stream short; last bytes {self.body[-120:]!r}{self._note()}")
            try:
                data = self.read_some(deadline)
            except TimeoutError:
                raise AssertionError(
                    f"{self.what} {n} never reached the client within {timeout:g}s: the gateway buffered the "
                    f"stream (the client has {len(self.split(self.body))} {self.what}s, {len(self.body)} bytes; "
                    f"last bytes {self.body[-120:]!r})") from None
            if data is None:
                self.ended = True
            else:
                self.body += data
        event = self.split(self.body)[n - 1]
        if expected is not None:
            assert event == expected, f"{self.what} {n} differs:\n got      {event!r}\n expected {expected!r}"
        return event

    def _note(self) -> str:
        return f" ({self.note()})" if self.note else ""

    def expect_end(self, timeout: float = WAIT) -> bytes:
        """Wait for the end of the body; returns the whole body."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            try:
                data = self.read_some(deadline)
            except TimeoutError:
                raise AssertionError(f"the body did not end within {timeout:g}s after the origin finished "
                                     f"({len(self.body)} bytes so far)") from None
            if data is None:
                self.ended = True
            else:
                self.body += data
        return self.body


def follow(events: Events, expected: list[bytes], lock) -> bytes:
    """The lockstep loop: wait for each event, check it, tell the origin; then the end of the body."""
    for n, event in enumerate(expected, 1):
        events.expect(n, event)
        lock.ack(n)
    body = events.expect_end()
    assert body == b"".join(expected), f"the body differs from what the origin sent:\n{body!r}\n{b''.join(expected)!r}"
    return body


# -- connections ----------------------------------------------------------------------------------------


def tls_context(ca, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(alpn)
    return ctx


def connect_tunnel(gateway: GatewayProcess, host: str, alpn: list[str], port: int = 443,
                   timeout: float = WAIT) -> ssl.SSLSocket:
    """CONNECT host:port through the explicit proxy, then TLS (verifying the gateway's CA and name)."""
    conn, answer = tunnel(gateway, f"{host}:{port}", timeout=timeout)
    assert answer.status == 200, f"CONNECT {host}:{port} answered {answer.status}: {answer.body[:300]!r}"
    tls = tls_context(gateway.ca_cert, alpn).wrap_socket(conn.sock, server_hostname=host)
    return tls


def connect_proxy(gateway: GatewayProcess, timeout: float = WAIT) -> socket.socket:
    return socket.create_connection((gateway.host, gateway.port), timeout=timeout)


def ws_key() -> str:
    import base64
    import os

    return base64.b64encode(os.urandom(16)).decode()


class Fetch:
    """One request with a raw HTTP/1.1 ("h1") or HTTP/2 ("h2") client on `sock`, read incrementally."""

    def __init__(self, sock: socket.socket, protocol: str, host: str, path: str,
                 headers: list[tuple[str, str]] = (), method: str = "GET", body: bytes | None = None,
                 absolute: bool = False):
        self.protocol = protocol
        self.host = host
        if protocol == "h1":
            self.h1 = H1Client(sock)
            target = f"http://{host}{path}" if absolute else path
            self.h1.send_request(method, target, [("Host", host), *headers], body)
        else:
            self.h2 = H2Client(sock)
            self.sid = self.h2.request(host, path, method, list(headers), body or b"")
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []

    def read_head(self, what: str = "the response headers", timeout: float = WAIT) -> "Fetch":
        if self.protocol == "h1":
            self.h1.read_head(what, timeout)
            self.status, self.headers = self.h1.status, self.h1.headers
        else:
            response = self.h2.read_head(self.sid, what, timeout)
            self.status, self.headers = response.status, response.headers
        return self

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def read_some(self, deadline: float) -> bytes | None:
        if self.protocol == "h1":
            return self.h1.read_some(deadline)
        return self.h2.read_some(self.sid, deadline)

    @property
    def trailers(self) -> list[tuple[str, str]] | None:
        if self.protocol == "h1":
            return self.h1.trailers
        return self.h2.responses[self.sid].trailers

    def framing_note(self) -> str:
        if self.protocol == "h1":
            if self.h1.framing == "chunked":
                return (f"chunked: {len(self.h1.chunks)} chunks then the last-chunk {self.h1.raw_terminator!r} - "
                        "a premature 0\\r\\n\\r\\n")
            return f"{self.h1.framing}-delimited, connection end: {self.h1.conn.eof_kind or 'open'}"
        response = self.h2.responses[self.sid]
        return f"HTTP/2: {len(response.frames)} DATA frames, END_STREAM seen, reset={response.reset}"

    def events(self, split=sse_split, what: str = "event") -> Events:
        return Events(self.read_some, split, what, note=self.framing_note)

    def close(self) -> None:
        (self.h1 if self.protocol == "h1" else self.h2).close()


def paced_fetch(routes, open_socket: Callable[[], socket.socket], client: str, host: str, events: list[bytes], *,
                framing: str = "chunked", content_type: str = "text/event-stream", length: bool = False,
                split=sse_split, absolute: bool = False, expected: list[bytes] | None = None, plan=None):
    """One paced stream end to end: the origin sends the head and waits for the client to have it,
    then each event (as `plan` says) and waits for the client to confirm it. Returns (fetch, route)
    after the body ended and was checked; the fetch's framing records stay for further checks."""
    from .origins import paced_stream, plan_bytes, plan_events

    plan = plan if plan is not None else plan_events(events)
    route, lock = paced_stream(routes, plan, content_type=content_type, framing=framing,
                               length=len(plan_bytes(plan)) if length else None)
    fetch = Fetch(open_socket(), client, host, route.path, absolute=absolute)
    try:
        fetch.read_head("the response headers (sent before any event)")
        assert fetch.status == 200, (fetch.status, fetch.headers)
        assert (fetch.header("content-type") or "").startswith(content_type), fetch.headers
        lock.ack(0)
        follow(fetch.events(split), expected or events, lock)
    finally:
        fetch.close()
    return fetch, route
