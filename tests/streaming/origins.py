"""In-process origin servers for the streaming suite, and the side channel that paces them.

Every origin serves *routes* that a test registers just before it makes its request: a route is a
path prefix `/r/<token>` bound to a handler (a function of one `Exchange`, the origin's view of
one request). One registry (`Routes`) serves every origin, so a test does not need to know which
listener a name lands on. A handler runs in the connection's thread (HTTP/1.1) or in a thread of
its own (each HTTP/2 stream), and may block: that is how the origins are paced.

Pacing (`Lockstep`): the origin writes step N+1 only after the test acknowledged step N, i.e.
after the client has *confirmed* receiving everything up to N. A gateway that buffers the stream
therefore deadlocks, and the test fails on its bounded wait (`WAIT` seconds) with a message that
names the event that never arrived. Nothing here sleeps to synchronise.

Listeners (`Origin`): TLS with a certificate from the test PKI (HTTP/1.1 only, or h2 + HTTP/1.1 by
ALPN) or plain TCP (HTTP/1.1). HTTP/1.1 is hand-written so that framing is exact (chunked writes
of any size, read-until-close, trailers); HTTP/2 uses the `h2` library with one I/O thread per
connection (all h2 state lives there; handlers post commands to it).

`GrpcOrigin` is a real grpcio server (generic handlers, raw bytes) whose streaming methods are
paced the same way.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import os
import queue
import secrets
import select
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from tests.support.tcp_origin import start_accepting

# Every bounded wait of the suite (a client waiting for an event, the test waiting for the origin).
WAIT = float(os.environ.get("STREAMING_TEST_WAIT", "10"))
# Origins wait longer than clients, so that the client-side timeout (the one with a clear message)
# fires first; an origin that gives up just drops its connection.
ORIGIN_WAIT = 3 * WAIT

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


# -- the side channel --------------------------------------------------------------------------------


class Lockstep:
    """A counter the test raises (`ack(n)`: the client has everything up to step n) and the origin
    waits on (`wait(n)`). `close()` releases every waiter (teardown: origin threads give up)."""

    def __init__(self, label: str = ""):
        self.label = label
        self._cond = threading.Condition()
        self.acked = -1
        self.closed = False

    def ack(self, n: int) -> None:
        with self._cond:
            self.acked = max(self.acked, n)
            self._cond.notify_all()

    def wait(self, n: int, timeout: float = ORIGIN_WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.acked >= n or self.closed, timeout) and not self.closed

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Progress:
    """The other direction: the origin reports what it received (`report(piece)`) and the test
    waits until it holds a number of bytes (`wait_bytes(n)`) before it sends more. Used for
    uploads paced by the origin."""

    def __init__(self):
        self._cond = threading.Condition()
        self.received = 0
        self.pieces: list[bytes] = []

    def report(self, piece: bytes) -> None:
        with self._cond:
            self.pieces.append(piece)
            self.received += len(piece)
            self._cond.notify_all()

    def wait_bytes(self, n: int, timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.received >= n, timeout)


# -- what a handler sees -------------------------------------------------------------------------------


class Exchange:
    """One request as the origin sees it, and the means to answer it (protocol-independent)."""

    protocol = "?"

    def __init__(self, origin: "Origin", method: str, path: str, headers: list[tuple[str, str]],
                 sni: str | None):
        self.origin = origin
        self.method = method
        self.path = path
        self.headers = headers
        self.sni = sni
        self.trailers: list[tuple[str, str]] = []  # request trailers, once the body ended

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def header_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    # request body
    def body_pieces(self, timeout: float = ORIGIN_WAIT) -> Iterator[bytes]:
        raise NotImplementedError

    def read_body(self, timeout: float = ORIGIN_WAIT) -> bytes:
        return b"".join(self.body_pieces(timeout))

    # response
    def start(self, status: int, headers: list[tuple[str, str]], framing: str = "chunked") -> None:
        """Send the response head. `framing` (HTTP/1.1 only): "chunked", "close" (no length, the
        connection closes after the body), or "length" (the caller put Content-Length in `headers`)."""
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        """One write: one chunk (chunked), one send (otherwise), one DATA frame (HTTP/2)."""
        raise NotImplementedError

    def finish(self, trailers: list[tuple[str, str]] | None = None) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


@dataclass
class Route:
    path: str
    handler: Callable[[Exchange], None]
    seen: list[Exchange] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def exchange(self) -> Exchange:
        assert self.seen, f"no request reached the origin for {self.path}"
        return self.seen[0]


class Routes:
    """The registry every origin serves; `close_all()` releases every Lockstep made for the test."""

    def __init__(self):
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {}
        self._locksteps: list[Lockstep] = []

    def add(self, handler: Callable[[Exchange], None], label: str = "r") -> Route:
        token = f"{label}-{secrets.token_hex(6)}"
        route = Route(f"/r/{token}", handler)
        with self._lock:
            self._routes[token] = route
        return route

    def lockstep(self, label: str = "") -> Lockstep:
        lock = Lockstep(label)
        with self._lock:
            self._locksteps.append(lock)
        return lock

    def find(self, path: str) -> Route | None:
        parts = path.split("?", 1)[0].split("/")
        if len(parts) < 3 or parts[1] != "r":
            return None
        with self._lock:
            return self._routes.get(parts[2])

    def dispatch(self, exchange: Exchange) -> None:
        route = self.find(exchange.path)
        if route is None:
            body = f"no route for {exchange.path}\n".encode()
            exchange.start(404, [("content-type", "text/plain"), ("content-length", str(len(body)))], "length")
            exchange.write(body)
            exchange.finish()
            return
        route.seen.append(exchange)
        try:
            route.handler(exchange)
        except BaseException as exc:  # recorded for the test; the client sees a broken stream
            route.errors.append(exc)
            with contextlib.suppress(Exception):
                exchange.abort()
        finally:
            route.done.set()

    def close_all(self) -> None:
        with self._lock:
            locks, self._locksteps = self._locksteps, []
            self._routes.clear()
        for lock in locks:
            lock.close()


# -- HTTP/1.1 --------------------------------------------------------------------------------------------


class _H1Conn:
    def __init__(self, origin: "Origin", sock: socket.socket, sni: str | None):
        self.origin = origin
        self.sock = sock
        self.sni = sni
        self.buf = b""
        self.sock.settimeout(ORIGIN_WAIT)

    def fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def read_until(self, marker: bytes) -> bytes | None:
        while marker not in self.buf:
            if not self.fill():
                return None
        head, _, self.buf = self.buf.partition(marker)
        return head

    def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self.fill():
                raise ConnectionError("closed in the middle of a request body")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def run(self) -> None:
        try:
            while True:
                head = self.read_until(b"\r\n\r\n")
                if head is None:
                    return
                line, *lines = head.decode("latin-1").split("\r\n")
                method, target, version = line.split(" ", 2)
                headers = []
                for raw in lines:
                    name, _, value = raw.partition(":")
                    headers.append((name.strip(), value.strip()))
                exchange = _H1Exchange(self, method, target, headers, version)
                self.origin.routes.dispatch(exchange)
                if exchange.taken_over or not exchange.keep_alive():
                    return
                # Whatever body the handler did not read is drained before the next request.
                for _ in exchange.body_pieces():
                    pass
        except (OSError, ValueError, ConnectionError):
            return
        finally:
            if not getattr(self, "_detached", False):
                with contextlib.suppress(OSError):
                    self.sock.close()


class _H1Exchange(Exchange):
    protocol = "HTTP/1.1"

    def __init__(self, conn: _H1Conn, method: str, target: str, headers, version: str):
        super().__init__(conn.origin, method, target, headers, conn.sni)
        self.conn = conn
        self.version = version
        self.framing: str | None = None
        self.taken_over = False
        self._body_done = False
        te = (self.header("transfer-encoding") or "").lower()
        self._chunked = "chunked" in te
        self._remaining = int(self.header("content-length") or 0) if not self._chunked else 0
        self.finished = False

    def keep_alive(self) -> bool:
        if self.framing == "close" or not self.finished:
            return False
        return (self.header("connection") or "").lower() != "close"

    def body_pieces(self, timeout: float = ORIGIN_WAIT) -> Iterator[bytes]:
        self.conn.sock.settimeout(timeout)
        while not self._body_done:
            if self._chunked:
                size_line = self.conn.read_until(b"\r\n")
                if size_line is None:
                    raise ConnectionError("closed in the middle of a chunked request body")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while True:
                        line = self.conn.read_until(b"\r\n")
                        if not line:
                            break
                        name, _, value = line.decode("latin-1").partition(":")
                        self.trailers.append((name.strip(), value.strip()))
                    self._body_done = True
                    return
                data = self.conn.read_exactly(size)
                if self.conn.read_exactly(2) != b"\r\n":
                    raise ValueError("bad chunk terminator in the request body")
                yield data
            else:
                if self._remaining <= 0:
                    self._body_done = True
                    return
                if not self.conn.buf and not self.conn.fill():
                    raise ConnectionError("closed in the middle of a request body")
                data, self.conn.buf = self.conn.buf[:self._remaining], self.conn.buf[self._remaining:]
                self._remaining -= len(data)
                yield data

    def start(self, status: int, headers: list[tuple[str, str]], framing: str = "chunked") -> None:
        self.framing = framing
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if framing == "chunked":
            lines.append("Transfer-Encoding: chunked")
        elif framing == "close":
            lines.append("Connection: close")
        self.conn.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self.framing == "chunked":
            self.conn.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.conn.sock.sendall(data)

    def finish(self, trailers: list[tuple[str, str]] | None = None) -> None:
        self.finished = True
        if self.framing == "chunked":
            tail = "".join(f"{k}: {v}\r\n" for k, v in (trailers or []))
            self.conn.sock.sendall(b"0\r\n" + tail.encode("latin-1") + b"\r\n")
        elif self.framing == "close":
            _close_politely(self.conn.sock)

    def abort(self) -> None:
        self.finished = False
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.conn.sock.close()

    def takeover(self) -> tuple[socket.socket, bytes]:
        """The raw socket and what was already read past the head (for a WebSocket handler)."""
        self.taken_over = True
        leftover, self.conn.buf = self.conn.buf, b""
        return self.conn.sock, leftover


def _close_politely(sock: socket.socket) -> None:
    """Send TLS close_notify (without waiting for the peer's), then close: the end of a
    read-until-close body, which must not look like a truncation."""
    if isinstance(sock, ssl.SSLSocket):
        sock.setblocking(False)
        with contextlib.suppress(ssl.SSLError, OSError, ValueError):
            sock.unwrap()
    with contextlib.suppress(OSError):
        sock.close()


_REASONS = {200: "OK", 101: "Switching Protocols", 404: "Not Found", 500: "Internal Server Error",
            503: "Service Unavailable"}


# -- HTTP/2 ----------------------------------------------------------------------------------------------


class _H2Exchange(Exchange):
    protocol = "HTTP/2"

    def __init__(self, conn: "_H2Conn", stream_id: int, headers: list[tuple[str, str]]):
        pseudo = {k: v for k, v in headers if k.startswith(":")}
        regular = [(k, v) for k, v in headers if not k.startswith(":")]
        super().__init__(conn.origin, pseudo.get(":method", ""), pseudo.get(":path", ""), regular, conn.sni)
        self.authority = pseudo.get(":authority")
        self.conn = conn
        self.stream_id = stream_id
        self.body: queue.SimpleQueue = queue.SimpleQueue()  # bytes, then None (end) or an exception
        self.reset = False

    def body_pieces(self, timeout: float = ORIGIN_WAIT) -> Iterator[bytes]:
        while True:
            try:
                item = self.body.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no request body data for {timeout}s") from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def start(self, status: int, headers: list[tuple[str, str]], framing: str = "chunked") -> None:
        self.conn.post(("headers", self.stream_id, [(":status", str(status))] + [(k.lower(), v) for k, v in headers]))

    def write(self, data: bytes) -> None:
        if data:
            self.conn.post(("data", self.stream_id, data))

    def finish(self, trailers: list[tuple[str, str]] | None = None) -> None:
        self.conn.post(("end", self.stream_id, [(k.lower(), v) for k, v in (trailers or [])]))

    def abort(self) -> None:
        self.conn.post(("reset", self.stream_id, None))


class _H2Conn:
    """All h2 state lives in this connection's I/O thread; handler threads post commands."""

    def __init__(self, origin: "Origin", sock: socket.socket, sni: str | None):
        import h2.config
        import h2.connection

        self.origin = origin
        self.sock = sock
        self.sni = sni
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8", validate_inbound_headers=False))
        self._wake_r, self._wake_w = socket.socketpair()
        self._commands: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.exchanges: dict[int, _H2Exchange] = {}
        self.outbox: dict[int, collections.deque] = {}

    def post(self, command) -> None:
        with self._lock:
            self._commands.append(command)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def run(self) -> None:
        import h2.events
        import h2.exceptions

        try:
            self.sock.settimeout(ORIGIN_WAIT)
            self.h2.initiate_connection()
            self._flush()
            while True:
                ready = [self.sock] if (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()) else \
                    select.select([self.sock, self._wake_r], [], [], 1.0)[0]
                if self._wake_r in ready:
                    self._wake_r.recv(65536)
                if self.sock in ready:
                    data = self.sock.recv(65536)
                    if not data:
                        return
                    for event in self.h2.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            exchange = _H2Exchange(self, event.stream_id, list(event.headers))
                            self.exchanges[event.stream_id] = exchange
                            self.outbox[event.stream_id] = collections.deque()
                            threading.Thread(target=self.origin.routes.dispatch, args=(exchange,),
                                             daemon=True).start()
                        elif isinstance(event, h2.events.DataReceived):
                            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                            if event.stream_id in self.exchanges and event.data:
                                self.exchanges[event.stream_id].body.put(event.data)
                        elif isinstance(event, h2.events.TrailersReceived):
                            if event.stream_id in self.exchanges:
                                self.exchanges[event.stream_id].trailers = list(event.headers)
                        elif isinstance(event, h2.events.StreamEnded):
                            if event.stream_id in self.exchanges:
                                self.exchanges[event.stream_id].body.put(None)
                        elif isinstance(event, h2.events.StreamReset):
                            exchange = self.exchanges.get(event.stream_id)
                            if exchange is not None:
                                exchange.reset = True
                                exchange.body.put(ConnectionResetError("stream reset by the peer"))
                            self.outbox.pop(event.stream_id, None)
                        elif isinstance(event, h2.events.ConnectionTerminated):
                            return
                with self._lock:
                    commands, self._commands = list(self._commands), collections.deque()
                for kind, stream_id, payload in commands:
                    box = self.outbox.get(stream_id)
                    if box is not None:
                        box.append((kind, payload))
                self._pump()
                self._flush()
        except (OSError, ssl.SSLError, h2.exceptions.ProtocolError, ValueError):
            return
        finally:
            for exchange in self.exchanges.values():
                exchange.body.put(ConnectionError("connection closed"))
            for s in (self.sock, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    s.close()

    def _pump(self) -> None:
        import h2.exceptions

        for stream_id, box in list(self.outbox.items()):
            try:
                while box:
                    kind, payload = box[0]
                    if kind == "headers":
                        self.h2.send_headers(stream_id, payload)
                    elif kind == "data":
                        window = min(self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size)
                        if window <= 0:
                            break  # a WINDOW_UPDATE will come in and wake the loop
                        self.h2.send_data(stream_id, payload[:window])
                        if len(payload) > window:
                            box[0] = (kind, payload[window:])
                            continue
                    elif kind == "end":
                        if payload:
                            self.h2.send_headers(stream_id, payload, end_stream=True)
                        else:
                            self.h2.end_stream(stream_id)
                        box.popleft()
                        self.outbox.pop(stream_id, None)
                        break
                    elif kind == "reset":
                        self.h2.reset_stream(stream_id, 2)  # INTERNAL_ERROR
                        self.outbox.pop(stream_id, None)
                        break
                    box.popleft()
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                self.outbox.pop(stream_id, None)

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)


# -- listeners -----------------------------------------------------------------------------------------


class Origin:
    """A listener on host:port: TLS (ALPN from `alpn`) when cert/key are given, else plain HTTP/1.1.

    `inside` is an optional context-manager factory the listening socket is created in (a network
    namespace); accepted connections inherit its namespace."""

    def __init__(self, label: str, host: str, port: int, routes: Routes, cert: Path | None = None,
                 key: Path | None = None, alpn: tuple[str, ...] = ("h2", "http/1.1"),
                 inside: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.label = label
        self.host = host
        self.routes = routes
        self.connections = 0
        self.protocols: list[str] = []  # the protocol of each accepted connection, in order
        self._tls = None
        if cert is not None:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(str(cert), str(key))
            self._tls.set_alpn_protocols(list(alpn))
            self._tls.sni_callback = lambda sslsock, name, ctx: setattr(sslsock, "egress_sni", name)
        with (inside() if inside else contextlib.nullcontext()):
            self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stopped = False
        start_accepting(self._sock, self._handle, lambda: self._stopped, self._accepted, name=f"origin-{label}")

    def _accepted(self, _client: socket.socket, _addr) -> None:
        self.connections += 1

    def _handle(self, client: socket.socket) -> None:
        sni = None
        try:
            if self._tls is not None:
                client.settimeout(WAIT)
                client = self._tls.wrap_socket(client, server_side=True)
                sni = getattr(client, "egress_sni", None)
                if client.selected_alpn_protocol() == "h2":
                    self.protocols.append("HTTP/2")
                    _H2Conn(self, client, sni).run()
                    return
            self.protocols.append("HTTP/1.1")
            _H1Conn(self, client, sni).run()
        except (OSError, ssl.SSLError):
            with contextlib.suppress(OSError):
                client.close()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.close()


# -- reusable handlers ------------------------------------------------------------------------------------

# A plan is what the origin does after the response head: bytes are one write each, an int n is
# "wait until the client confirmed step n". Step 0 is the response head itself.
Plan = list  # list[bytes | int]


def plan_events(events: list[bytes], pieces: Callable[[bytes], list[bytes]] | None = None) -> Plan:
    """Each event (in `pieces(event)` writes, default one), then wait for the client to confirm it."""
    plan: Plan = [0]
    for n, event in enumerate(events, 1):
        plan += (pieces(event) if pieces else [event])
        plan.append(n)
    return plan


def plan_straddling(events: list[bytes], overlap: int) -> Plan:
    """Writes that cross event boundaries: the last `overlap` bytes of event n travel in the same
    write as the first `overlap` bytes of event n+1; the origin waits for the client to confirm
    event n after that write (so the client must get event n while part of n+1 is in flight)."""
    assert all(len(e) > 2 * overlap for e in events)
    k = overlap
    plan: Plan = [0, events[0][:-k]]
    for n in range(1, len(events)):
        plan += [events[n - 1][-k:] + events[n][:k], n, events[n][k:-k]]
    plan += [events[-1][-k:], len(events)]
    return plan


def pieces_of(size: int) -> Callable[[bytes], list[bytes]]:
    return lambda data: [data[i:i + size] for i in range(0, len(data), size)]


def paced_stream(routes: Routes, plan: Plan, *, content_type: str = "text/event-stream",
                 framing: str = "chunked", status: int = 200, headers: list[tuple[str, str]] = (),
                 trailers: list[tuple[str, str]] | None = None, length: int | None = None,
                 label: str = "s", arrived: threading.Event | None = None,
                 release: threading.Event | None = None) -> tuple[Route, Lockstep]:
    """A route that answers with the head at once (or, with `release`, once the test sets it; the
    origin sets `arrived` when the request is in), then follows `plan` (paced by the Lockstep)."""
    lock = routes.lockstep(label)

    def handler(exchange: Exchange) -> None:
        for _ in exchange.body_pieces():
            pass
        if arrived is not None:
            arrived.set()
        if release is not None and not (release.wait(ORIGIN_WAIT) and not lock.closed):
            exchange.abort()
            return
        head = [("Content-Type", content_type), ("Cache-Control", "no-cache"), *headers]
        if length is not None:
            head.append(("Content-Length", str(length)))
        exchange.start(status, head, "length" if length is not None else framing)
        for step in plan:
            if isinstance(step, int):
                if not lock.wait(step):
                    exchange.abort()
                    return
            else:
                exchange.write(step)
        exchange.finish(trailers)

    return routes.add(handler, label), lock


def plan_bytes(plan: Plan) -> bytes:
    return b"".join(step for step in plan if isinstance(step, bytes))


# -- WebSocket --------------------------------------------------------------------------------------------


def websocket_echo(routes: Routes) -> Route:
    """A WebSocket echo (wsproto) over HTTP/1.1: every text message comes back as `echo: <text>`."""

    def handler(exchange: Exchange) -> None:
        from wsproto.connection import Connection, ConnectionType
        from wsproto.events import BytesMessage, CloseConnection, TextMessage

        assert isinstance(exchange, _H1Exchange), "WebSocket over HTTP/1.1 only"
        key = exchange.header("sec-websocket-key") or ""
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        sock, leftover = exchange.takeover()
        sock.sendall((f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
        ws = Connection(ConnectionType.SERVER)
        sock.settimeout(ORIGIN_WAIT)
        pending = ""
        data = leftover
        try:
            while True:
                if not data:
                    data = sock.recv(65536)
                    if not data:
                        return
                ws.receive_data(data)
                data = b""
                out = b""
                for event in ws.events():
                    if isinstance(event, (TextMessage, BytesMessage)):
                        pending += event.data if isinstance(event, TextMessage) else event.data.decode()
                        if event.message_finished:
                            out += ws.send(TextMessage(data=f"echo: {pending}"))
                            pending = ""
                    elif isinstance(event, CloseConnection):
                        sock.sendall(out + ws.send(event.response()))
                        return
                if out:
                    sock.sendall(out)
        except (OSError, ssl.SSLError):
            return
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    return routes.add(handler, "ws")


# -- gRPC (grpcio) ----------------------------------------------------------------------------------------

GRPC_SERVICE = "streaming.Streamer"


class GrpcOrigin:
    """A grpcio server with two generic, raw-bytes methods, paced by routes:

    - `/streaming.Streamer/Watch` (server streaming): the request is a route token; the route's
      handler is called with (request, context) and yields the replies.
    - `/streaming.Streamer/Chat` (bidirectional): every request message `m` is answered with
      `reply:` + m, as soon as it arrives; `close:<code>:<details>` ends the call with that status.

    Invocation metadata of every call is recorded in `calls` (method, metadata)."""

    def __init__(self, host: str, port: int, cert: Path, key: Path,
                 inside: Callable[[], contextlib.AbstractContextManager] | None = None):
        import concurrent.futures

        import grpc

        self.handlers: dict[bytes, Callable] = {}
        self.calls: list[tuple[str, list[tuple[str, str]]]] = []
        self._lock = threading.Lock()
        handler = grpc.method_handlers_generic_handler(GRPC_SERVICE, {
            "Watch": grpc.unary_stream_rpc_method_handler(self._watch),
            "Chat": grpc.stream_stream_rpc_method_handler(self._chat),
        })
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16))
        self.server.add_generic_rpc_handlers((handler,))
        creds = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
        with (inside() if inside else contextlib.nullcontext()):
            self.port = self.server.add_secure_port(f"{host}:{port}", creds)
        if not self.port:
            raise RuntimeError(f"grpcio could not bind {host}:{port}")
        self.server.start()

    def on_watch(self, handler: Callable) -> bytes:
        token = f"watch-{secrets.token_hex(6)}".encode()
        with self._lock:
            self.handlers[token] = handler
        return token

    def _record(self, method: str, context) -> None:
        with self._lock:
            self.calls.append((method, [(k, v) for k, v in context.invocation_metadata()]))

    def _watch(self, request: bytes, context):
        self._record("Watch", context)
        handler = self.handlers.get(request)
        if handler is None:
            import grpc

            context.abort(grpc.StatusCode.NOT_FOUND, f"no handler for {request!r}")
        yield from handler(request, context)

    def _chat(self, requests, context):
        import grpc

        self._record("Chat", context)
        for message in requests:
            if message.startswith(b"close:"):
                _, code, details = message.decode().split(":", 2)
                context.set_trailing_metadata((("x-chat-end", "bye"),))
                context.abort(grpc.StatusCode[code], details)
            yield b"reply:" + message

    def stop(self) -> None:
        self.server.stop(0)
