#!/usr/bin/env python3
"""The streaming figure group of bench/run.py (issue 12): server-sent events through the gateway.

    /tmp/venv/bin/python bench/run.py --only streaming --quick

(a) **Per-event latency.** An origin of its own (this file run as `python bench/streaming.py origin`, an
asyncio TLS server on ORIGIN_IP:443 with the certificate run.py makes for origin.bench, HTTP/1.1 and
HTTP/2 by ALPN) answers `GET /{unbound,bound}/sse?mode=paced&id=ID&events=N` with SSE events of 140
bytes shaped like a model API's (`data: {"type":"content_block_delta",...}`), each stamped with the
CLOCK_MONOTONIC time it was written (`"t":` in ns). It sends them ONE AT A TIME: event N+1 only after
the client confirmed event N on a side channel (a plain TCP control connection to the origin, `ACK N`),
so what is measured is each event's latency, not throughput. The client (this process, asyncio, raw
sockets) records the time it has the whole event; latency = receive − send stamp, the same clock on the
same host. Event 0 carries the response headers' cost and is not counted. Configurations: direct (no
proxy) and through the gateway (explicit mode, CONNECT + TLS) with an unbound rule and with a rule that
injects `Authorization: Bearer ${secrets.key}` (an env secret of 108 characters), each over HTTP/1.1
and over HTTP/2 towards the client (the origin then speaks the same protocol). Extra latency of an
event = its latency − the median latency of direct over the same protocol in the same round.

(b) **Memory per open stream.** A fresh gateway per rule kind; RSS (VmRSS of all its processes) after
start-up and one warm-up request, then with N SSE responses open at once through it (HTTP/1.1, each
its own CONNECT tunnel, from four loopback source addresses), each having been sent one event by the
origin and then held open: KiB per stream = (RSS open − RSS idle) / streams open.

Every wait is bounded (--sse-timeout, 10 s): a gateway that buffers the response whole never delivers
the first event of a paced stream (the origin waits for its ACK), which is reported as "buffered: the
event never arrived", not a hang. Not a test (bench/ is not collected by pytest).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import resource
import secrets as pysecrets
import signal
import ssl
import statistics
import sys
import time
import urllib.parse
from pathlib import Path

try:  # HTTP/2 (a dependency of mitmproxy, so normally present); without it the h2 configurations are skipped
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
except ImportError:  # pragma: no cover - reported as a skip
    h2 = None

ORIGIN_NAME = "origin.bench"
SMALL_PATH = "/small.txt"
SECRET_ENV = "EGRESS_BENCH_SSE_KEY"
SECRET_LENGTH = 108
MEDIAN_TARGET_MS = 5.0
WORST_TARGET_MS = 50.0
MEMORY_TARGET_KIB = 100.0
EVENT_TEXT = b"Sure, here is "  # pads every event to 140 bytes
SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
PROTOCOLS = {"h1": ("http/1.1", "HTTP/1.1"), "h2": ("h2", "HTTP/2")}
KINDS = {"direct": "direct (no proxy)", "unbound": "gateway, unbound rule", "bound": "gateway, credential-bound rule"}
LATENCY_KEYS = ("direct_h1", "unbound_h1", "bound_h1", "direct_h2", "unbound_h2", "bound_h2")


def sse_event(seq: int) -> bytes:
    """One event, stamped with the time it is written (call it right before the write)."""
    return (b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"' + EVENT_TEXT
            + b'"},"seq":%06d,"t":%020d}\n\n' % (seq, time.monotonic_ns()))


EVENT_BYTES = len(sse_event(0))


def label(key: str) -> str:
    kind, proto = key.rsplit("_", 1)
    return f"{PROTOCOLS[proto][1]}, {KINDS[kind]}"


# --------------------------------------------------------------------------------------------
# the origin (a subprocess: `python bench/streaming.py origin ...`)


class Pacer:
    """One paced stream's side channel: the ACKs its client sends on the control connection."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.acks: asyncio.Queue[int | None] = asyncio.Queue()

    async def wait_ack(self, seq: int, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                value = await asyncio.wait_for(self.acks.get(), remaining)
            except TimeoutError:
                return False
            if value is None:  # the control connection closed: the client gave up
                return False
            if value >= seq:
                return True

    def tell(self, line: str) -> None:
        if not self.writer.is_closing():
            self.writer.write(line.encode() + b"\n")


class H1Responder:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.chunked = False

    async def head(self, status: int, headers: list[tuple[str, str]], length: int | None = None) -> None:
        self.chunked = length is None
        lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}"] + [f"{k}: {v}" for k, v in headers]
        lines.append("transfer-encoding: chunked" if self.chunked else f"content-length: {length}")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await self.writer.drain()

    async def data(self, make) -> None:
        body = make()
        self.writer.write(b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body)
        await self.writer.drain()

    async def end(self) -> None:
        if self.chunked:
            self.writer.write(b"0\r\n\r\n")
            await self.writer.drain()

    async def wait_closed(self) -> None:
        while await self.reader.read(65536):
            pass


class H2Responder:
    def __init__(self, conn, writer: asyncio.StreamWriter, stream_id: int, window: asyncio.Event):
        self.conn, self.writer, self.sid, self.window = conn, writer, stream_id, window
        self.closed = asyncio.Event()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.writer.write(out)

    async def head(self, status: int, headers: list[tuple[str, str]], length: int | None = None) -> None:
        extra = [("content-length", str(length))] if length is not None else []
        self.conn.send_headers(self.sid, [(":status", str(status))] + headers + extra)
        self._flush()
        await self.writer.drain()

    async def data(self, make) -> None:
        while self.conn.local_flow_control_window(self.sid) < EVENT_BYTES * 2 and not self.closed.is_set():
            self.window.clear()
            await asyncio.wait_for(self.window.wait(), 30)
        body = make()
        self.conn.send_data(self.sid, body)
        self._flush()
        await self.writer.drain()

    async def end(self) -> None:
        self.conn.end_stream(self.sid)
        self._flush()
        await self.writer.drain()

    async def wait_closed(self) -> None:
        await self.closed.wait()


class Origin:
    def __init__(self, secret: str, small: bytes, timeout: float):
        self.secret, self.small, self.timeout = secret, small, timeout
        self.pacers: dict[str, Pacer] = {}
        self.stats: collections.Counter[str] = collections.Counter()
        self.hold_open = 0

    async def tls_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        proto = (ssl_object.selected_alpn_protocol() if ssl_object else None) or "http/1.1"
        try:
            if proto == "h2":
                await self.serve_h2(reader, writer)
            else:
                await self.serve_h1(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError, OSError,
                TimeoutError):
            pass
        except Exception as exc:  # noqa: BLE001 - a broken stream must not stop the origin
            if h2 is None or not isinstance(exc, h2.exceptions.H2Error):
                print(f"origin: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            writer.close()

    async def serve_h1(self, reader, writer) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            if not await self.respond("http/1.1", method, target, headers, H1Responder(reader, writer)):
                return

    async def serve_h2(self, reader, writer) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        responders: dict[int, H2Responder] = {}
        tasks: set[asyncio.Task] = set()
        window = asyncio.Event()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        headers = {k.lower(): v for k, v in ev.headers}
                        r = responders[ev.stream_id] = H2Responder(conn, writer, ev.stream_id, window)
                        task = asyncio.create_task(self.respond("h2", headers.get(":method", ""),
                                                                headers.get(":path", ""), headers, r))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    elif isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamReset):
                        r = responders.pop(ev.stream_id, None)
                        if r:
                            r.closed.set()
                    elif isinstance(ev, h2.events.WindowUpdated):
                        window.set()
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        return
                out = conn.data_to_send()
                if out:
                    writer.write(out)
        finally:
            for r in responders.values():
                r.closed.set()
            window.set()
            for task in list(tasks):
                task.cancel()

    async def respond(self, proto: str, method: str, target: str, headers: dict, r) -> bool:
        """Answer one request; False when the connection should close afterwards."""
        path, _, query = target.partition("?")
        q = dict(urllib.parse.parse_qsl(query))
        if path == SMALL_PATH:
            await r.head(200, [("content-type", "text/plain")], len(self.small))
            await r.data(lambda: self.small)
            await r.end()
            return True
        m = re.fullmatch(r"/(unbound|bound)/sse", path)
        if not m or method != "GET":
            await r.head(404, [("content-type", "text/plain")], 10)
            await r.data(lambda: b"not found\n")
            await r.end()
            return True
        kind = m.group(1)
        auth = headers.get("authorization")
        auth_state = "none" if auth is None else ("ok" if auth == f"Bearer {self.secret}" else "wrong")
        self.stats[f"{kind}_{proto}_auth_{auth_state}"] += 1
        mode = q.get("mode", "burst")
        if mode == "paced":
            deadline = time.monotonic() + self.timeout
            while q.get("id") not in self.pacers and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            pacer = self.pacers.get(q.get("id", ""))
            if pacer is None:
                await r.head(409, [("content-type", "text/plain")], 9)
                await r.data(lambda: b"no pacer\n")
                await r.end()
                return True
            pacer.tell(f"START {proto} {auth_state}")
            await r.head(200, SSE_HEADERS)
            for seq in range(int(q.get("events", "200")) + 1):  # event 0 is not counted by the client
                await r.data(lambda seq=seq: sse_event(seq))
                if not await pacer.wait_ack(seq, self.timeout):
                    self.stats["paced_gave_up"] += 1
                    break
            await r.end()
            return True
        if mode == "hold":
            await r.head(200, SSE_HEADERS)
            await r.data(lambda: sse_event(0))
            self.stats["hold_sent"] += 1
            self.hold_open += 1
            try:
                await r.wait_closed()
            finally:
                self.hold_open -= 1
            return False
        await r.head(200, SSE_HEADERS)  # burst: N events at once, then the end
        for seq in range(int(q.get("events", "3"))):
            await r.data(lambda seq=seq: sse_event(seq))
        await r.end()
        return True

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pace_id = None
        try:
            while line := await reader.readline():
                cmd, _, arg = line.decode().strip().partition(" ")
                if cmd == "PACE":
                    pace_id = arg
                    self.pacers[arg] = Pacer(writer)
                    writer.write(b"OK\n")
                elif cmd == "ACK" and pace_id in self.pacers:
                    self.pacers[pace_id].acks.put_nowait(int(arg))
                elif cmd == "STATS":
                    writer.write(json.dumps({"hold_open": self.hold_open, **self.stats}).encode() + b"\n")
                elif cmd == "RESET":
                    self.stats.clear()
                    writer.write(b"OK\n")
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            pacer = self.pacers.pop(pace_id, None) if pace_id else None
            if pacer:
                pacer.acks.put_nowait(None)
            writer.close()


async def origin_main(args) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    origin = Origin(os.environ.get(SECRET_ENV, ""), Path(args.small).read_bytes(), args.timeout)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.cert, args.key)
    ctx.set_alpn_protocols(["h2", "http/1.1"] if h2 is not None else ["http/1.1"])
    host, port = args.listen.rsplit(":", 1)
    c_host, c_port = args.control.rsplit(":", 1)
    tls = await asyncio.start_server(origin.tls_connection, host, int(port), ssl=ctx, backlog=4096,
                                     ssl_handshake_timeout=30)
    control = await asyncio.start_server(origin.control, c_host, int(c_port), backlog=256)
    print(json.dumps({"ready": True, "h2": h2 is not None}), flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    tls.close()
    control.close()
    return 0


# --------------------------------------------------------------------------------------------
# the client (in bench/run.py's process)


class StreamError(Exception):
    pass


def client_context(cafile: Path, alpn: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cafile))
    ctx.set_alpn_protocols([alpn])
    return ctx


async def open_connection(address: tuple[str, int], proxy: tuple[str, int] | None, ctx: ssl.SSLContext,
                          alpn: str, source: str | None = None):
    """TCP (through `proxy`: CONNECT origin.bench:443 first), then TLS for origin.bench with ALPN `alpn`."""
    reader, writer = await asyncio.open_connection(*(proxy or address), local_addr=(source, 0) if source else None)
    try:
        if proxy:
            writer.write(f"CONNECT {ORIGIN_NAME}:443 HTTP/1.1\r\nHost: {ORIGIN_NAME}:443\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0]
            if status.split()[1:2] != [b"200"]:
                raise StreamError(f"CONNECT answered {status[:60]!r}")
        await writer.start_tls(ctx, server_hostname=ORIGIN_NAME)
        got = writer.get_extra_info("ssl_object").selected_alpn_protocol() or "http/1.1"
        if got != alpn:
            raise StreamError(f"ALPN {got!r}, not {alpn!r}")
        return reader, writer
    except BaseException:
        writer.close()
        raise


class H1Stream:
    """One GET on an HTTP/1.1 connection; `next_event` returns an event and when its last byte was read."""

    def __init__(self, reader, writer):
        self.r, self.w = reader, writer
        self.buf = b""
        self.head: str | None = None
        self.mode = "close"
        self.remaining = 0
        self.eof = False
        self.last_read_ns = 0

    def send(self, path: str) -> None:
        self.w.write(f"GET {path} HTTP/1.1\r\nHost: {ORIGIN_NAME}\r\nAccept: text/event-stream\r\n\r\n".encode())

    async def _read_head(self) -> None:
        raw = (await self.r.readuntil(b"\r\n\r\n")).decode("latin-1")
        lines = raw.split("\r\n")
        self.head = lines[0]
        if lines[0].split()[1:2] != ["200"]:
            raise StreamError(f"answered {lines[0][:80]!r}")
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self.mode = "chunked"
            elif name == "content-length" and self.mode != "chunked":
                self.mode, self.remaining = "length", int(value)

    async def _read_body(self) -> None:
        if self.mode == "chunked":
            size = int((await self.r.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                self.eof = True
                return
            self.buf += (await self.r.readexactly(size + 2))[:-2]
        else:
            data = await self.r.read(min(65536, self.remaining) if self.mode == "length" else 65536)
            if not data:
                self.eof = True
            self.buf += data
            if self.mode == "length":
                self.remaining -= len(data)
                self.eof = self.eof or self.remaining <= 0
        self.last_read_ns = time.monotonic_ns()

    async def next_event(self) -> tuple[bytes, int]:
        if self.head is None:
            await self._read_head()
        while b"\n\n" not in self.buf:
            if self.eof:
                raise StreamError("the response ended before the next event was complete"
                                  + (" (a last-chunk, 0 bytes, in the chunked body)" if self.mode == "chunked" else ""))
            await self._read_body()
        event, _, self.buf = self.buf.partition(b"\n\n")
        return event, self.last_read_ns

    def close(self) -> None:
        self.w.close()


class H2Stream(H1Stream):
    """The same over HTTP/2 (one stream on the connection)."""

    def __init__(self, reader, writer):
        super().__init__(reader, writer)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.sid = 0

    def send(self, path: str) -> None:
        self.sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(self.sid, [(":method", "GET"), (":scheme", "https"), (":authority", ORIGIN_NAME),
                                          (":path", path), ("accept", "text/event-stream")], end_stream=True)
        self.w.write(self.conn.data_to_send())

    async def _read_head(self) -> None:
        while self.head is None:
            if self.eof:
                raise StreamError("the connection ended before the response headers")
            await self._read_body()

    async def _read_body(self) -> None:
        data = await self.r.read(65536)
        self.last_read_ns = time.monotonic_ns()
        if not data:
            self.eof = True
            return
        for ev in self.conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == self.sid:
                status = dict(ev.headers).get(":status")
                self.head = f"HTTP/2 {status}"
                if status != "200":
                    raise StreamError(f"answered {status}")
            elif isinstance(ev, h2.events.DataReceived):
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                if ev.stream_id == self.sid:
                    self.buf += ev.data
            elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and ev.stream_id == self.sid:
                self.eof = True
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.eof = True
        out = self.conn.data_to_send()
        if out:
            self.w.write(out)


_EVENT_RE = re.compile(rb'^data: \{.*"seq":(\d+),"t":(\d+)\}$', re.S)


def parse_event(event: bytes) -> tuple[int, int]:
    m = _EVENT_RE.match(event)
    if not m:
        raise StreamError(f"not an event of the origin: {event[:80]!r}")
    return int(m.group(1)), int(m.group(2))


async def control_connection(control: tuple[str, int], timeout: float):
    return await asyncio.wait_for(asyncio.open_connection(*control), timeout)


async def control_stats(control: tuple[str, int], timeout: float) -> dict:
    reader, writer = await control_connection(control, timeout)
    try:
        writer.write(b"STATS\n")
        return json.loads(await asyncio.wait_for(reader.readline(), timeout))
    finally:
        writer.close()


async def paced_run(c: "Context", key: str, events: int) -> dict:
    """One stream of `events` paced events (plus the uncounted event 0) for configuration `key`."""
    kind, proto = key.rsplit("_", 1)
    alpn = PROTOCOLS[proto][0]
    timeout = c.timeout
    ctl_r, ctl_w = await control_connection(c.control, timeout)
    pace_id = pysecrets.token_hex(8)
    out: dict = {"status": "ok", "samples_ms": [], "events_received": 0}
    stream = None
    try:
        ctl_w.write(f"PACE {pace_id}\n".encode())
        await ctl_w.drain()
        if (await asyncio.wait_for(ctl_r.readline(), timeout)).strip() != b"OK":
            raise StreamError("the origin's control channel did not answer")
        proxy = None if kind == "direct" else c.proxy
        ctx = c.ctx[(alpn, proxy is None)]
        reader, writer = await asyncio.wait_for(open_connection(c.origin, proxy, ctx, alpn), timeout)
        stream = (H2Stream if proto == "h2" else H1Stream)(reader, writer)
        stream.send(f"/{'unbound' if kind == 'direct' else kind}/sse?mode=paced&id={pace_id}&events={events}")
        for seq in range(events + 1):
            try:
                event, received = await asyncio.wait_for(stream.next_event(), timeout)
            except TimeoutError:
                out["status"] = "buffered" if seq == 0 else "stalled"
                out["headers_arrived"] = stream.head is not None
                break
            got, sent = parse_event(event)
            if got != seq:
                raise StreamError(f"event {got} arrived where {seq} was expected")
            if seq:
                out["samples_ms"].append((received - sent) / 1e6)
            out["events_received"] = seq
            ctl_w.write(b"ACK %d\n" % seq)
            await ctl_w.drain()
    except (StreamError, ConnectionError, OSError, ssl.SSLError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError, TimeoutError) as exc:
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if stream is not None:
            stream.close()
        # what the origin saw of this request: "START <protocol> <authorization: none|ok|wrong>"
        try:
            while line := await asyncio.wait_for(ctl_r.readline(), 1.0):
                if line.startswith(b"START "):
                    _, seen_proto, auth = line.decode().split()
                    out["origin_protocol"], out["origin_auth"] = seen_proto, auth
                    break
        except (TimeoutError, ConnectionError, ValueError):
            pass
        ctl_w.close()
    return out


async def burst(c: "Context", kind: str, alpn: str, proxy, events: int = 3) -> None:
    """A warm-up request: `events` events at once, then the end of the response (buffered or not)."""
    ctx = c.ctx[(alpn, proxy is None)]
    reader, writer = await asyncio.wait_for(open_connection(c.origin, proxy, ctx, alpn), c.timeout)
    stream = (H2Stream if alpn == "h2" else H1Stream)(reader, writer)
    try:
        stream.send(f"/{kind}/sse?mode=burst&events={events}")
        for _ in range(events):
            parse_event((await asyncio.wait_for(stream.next_event(), c.timeout))[0])
    finally:
        stream.close()


async def open_streams(c: "Context", kind: str, count: int, sources: list[str], measure) -> dict:
    """`count` held SSE streams through the gateway (HTTP/1.1), then the gateway's memory with them open."""
    ctx = c.ctx[("http/1.1", False)]
    semaphore = asyncio.Semaphore(32)
    streams: list[H1Stream] = []
    errors: collections.Counter[str] = collections.Counter()

    async def one(i: int) -> None:
        async with semaphore:
            try:
                reader, writer = await asyncio.wait_for(
                    open_connection(c.origin, c.proxy, ctx, "http/1.1", sources[i % len(sources)]), 30)
                stream = H1Stream(reader, writer)
                stream.send(f"/{kind}/sse?mode=hold")
                await writer.drain()
                streams.append(stream)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1

    async def first_event(stream: H1Stream) -> bool:
        try:
            parse_event((await asyncio.wait_for(stream.next_event(), c.timeout))[0])
            return True
        except Exception:  # noqa: BLE001 - a stream whose event did not come is counted
            return False

    started = time.monotonic()
    try:
        tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
        _, pending = await asyncio.wait(tasks, timeout=30 + count * 0.1)  # bounded however the gateway behaves
        for task in pending:
            task.cancel()
        if pending:
            errors[f"not opened within {30 + count * 0.1:.0f} s"] += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
        opened_s = time.monotonic() - started
        got = await asyncio.gather(*(first_event(s) for s in streams))  # concurrently: ≤ timeout in all
        deadline = time.monotonic() + c.timeout
        stats = await control_stats(c.control, c.timeout)
        while stats.get("hold_open", 0) < len(streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            stats = await control_stats(c.control, c.timeout)
        await asyncio.sleep(1.0)  # let the gateway settle
        with_streams = measure()
        await asyncio.sleep(0.5)
        again = measure()
        if again["rss_kib"] > with_streams["rss_kib"]:
            with_streams = again
        still = sum(1 for s in streams if not s.w.is_closing())
    finally:
        for s in streams:
            s.close()
    return {"requested": count, "opened": len(streams), "failed": sum(errors.values()),
            "errors": dict(errors.most_common(5)), "first_event_received": sum(got), "origin_holding": stats.get(
                "hold_open"), "still_open": still, "open_s": round(opened_s, 1), "with_streams": with_streams}


class Context:
    def __init__(self, origin: tuple[str, int], control: tuple[str, int], timeout: float, origin_ca: Path):
        self.origin, self.control, self.timeout = origin, control, timeout
        self.proxy: tuple[str, int] | None = None
        self.origin_ca = origin_ca
        self.ctx: dict[tuple[str, bool], ssl.SSLContext] = {}

    def set_proxy(self, proxy: tuple[str, int], proxy_ca: Path) -> None:
        self.proxy = proxy
        for alpn in ("http/1.1", "h2"):
            self.ctx[(alpn, True)] = client_context(self.origin_ca, alpn)
            self.ctx[(alpn, False)] = client_context(proxy_ca, alpn)


# --------------------------------------------------------------------------------------------
# the group, called by bench/run.py


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sse-events", type=int, help="streaming: paced events per stream and round (default 200, "
                   "quick 50)")
    p.add_argument("--sse-streams", type=int, help="streaming: SSE streams held open for the memory figure "
                   "(default 1000, quick 300)")
    p.add_argument("--sse-timeout", type=float, default=10.0,
                   help="streaming: seconds to wait for any one event before calling the stream buffered")
    p.add_argument("--sse-origin-ip", default="127.0.0.51",
                   help="streaming: loopback address of the SSE origin (port 443; not --origin-ip, nginx's)")


def policy_text(origin_ip: str) -> str:
    return f"""version: 1
network:
  deny_ip_ranges: default
  allow_ip_ranges: [127.0.0.0/8]
resolver:
  static_hosts:
    {ORIGIN_NAME}: [{origin_ip}]
secrets:
  key: {{env: {SECRET_ENV}}}
rules:
  - id: sse-unbound
    hosts: [{ORIGIN_NAME}]
    methods: [GET, HEAD]
    paths: ["{SMALL_PATH}", "/unbound/**"]
  - id: sse-bound
    hosts: [{ORIGIN_NAME}]
    methods: [GET]
    paths: ["/bound/**"]
    inject:
      - header: Authorization
        value: "Bearer ${{secrets.key}}"
"""


def run(bench, setup, args, meta: dict, tools: dict) -> dict:
    """The whole group: the origin, the latency rounds on one gateway, then a fresh gateway per rule kind for
    the memory figure. `bench` is bench/run.py's module (its helpers). Never raises but KeyboardInterrupt:
    what cannot run is a note in the result."""
    events = args.sse_events or (50 if args.quick else 200)
    count = args.sse_streams or (300 if args.quick else 1000)
    result: dict = {"params": {"events": events, "rounds": args.rounds, "streams": count, "timeout_s": args.sse_timeout,
                               "event_bytes": EVENT_BYTES, "secret_chars": SECRET_LENGTH,
                               "origin": f"{args.sse_origin_ip}:443", "pinned": setup.pin},
                    "notes": [], "latency": {}, "memory": {}}
    started = time.monotonic()
    secret = ("sk-bench-" + pysecrets.token_urlsafe(SECRET_LENGTH))[:SECRET_LENGTH]
    previous_env = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = secret  # the gateway reads it at start (start_proxy passes os.environ on)
    affinity = None
    origin = None
    started_keys: list[str] = []

    def note(text: str) -> None:
        result["notes"].append(text)
        if text.startswith("skipped"):
            meta["skipped"]["streaming"] = text.removeprefix("skipped: ")
        bench.log(f"streaming: {text}")

    try:
        if not args.sse_origin_ip.startswith("127."):
            note("skipped: --sse-origin-ip must be in 127.0.0.0/8")
            return result
        if bench.port_in_use(args.sse_origin_ip, 443):
            note(f"skipped: {args.sse_origin_ip}:443 is in use (pick another --sse-origin-ip)")
            return result
        if setup.origin_cert is None:
            note("skipped: no origin certificate")
            return result
        if h2 is None:
            note("HTTP/2 configurations skipped: the h2 package is not importable")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 3 * count + 200  # the gateway (started from here) holds two descriptors per stream, we one
        if soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
            if hard < need:
                note(f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors {count} streams need")
        control_port = bench.free_port()
        cert, key = setup.origin_cert
        origin = bench.Service("sse-origin", setup.cpu(1) + [
            sys.executable, str(Path(__file__).resolve()), "origin", "--listen", f"{args.sse_origin_ip}:443",
            "--control", f"127.0.0.1:{control_port}", "--cert", str(cert), "--key", str(key),
            "--small", str(setup.www / SMALL_PATH.lstrip("/")), "--timeout", str(args.sse_timeout)],
            setup.workdir / "sse-origin.log", env=dict(os.environ, PYTHONUNBUFFERED="1"))
        setup.nginx["sse-origin"] = origin.start()  # stopped with the other origins if the run fails
        try:
            bench.wait_for_port("127.0.0.1", control_port, origin.proc, timeout=20)
            bench.wait_for_port(args.sse_origin_ip, 443, origin.proc, timeout=10)
        except bench.BenchError as exc:
            note(f"skipped: the SSE origin did not start: {exc} {origin.tail(5)}")
            return result
        if setup.pin:
            affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {1})  # this thread is the client: CPU 1, with the origin; gateways on CPU 0
        c = Context((args.sse_origin_ip, 443), ("127.0.0.1", control_port), args.sse_timeout, setup.ca_cert)
        policy = policy_text(args.sse_origin_ip)

        def start_gateway(key: str):
            proxy = bench.start_proxy(setup, key, tools, policy_text=policy)
            setup.proxies[key] = proxy
            started_keys.append(key)
            c.set_proxy((proxy.host, proxy.port), proxy.client_ca)
            return proxy

        def stop_gateway(key: str) -> None:
            proxy = setup.proxies.pop(key, None)
            if proxy is not None and proxy.service is not None:
                log_lines = [ln for ln in proxy.service.tail(200).splitlines()
                             if re.search(r"error|exception|traceback", ln, re.I)]
                if log_lines:
                    note(f"{key} logged {len(log_lines)} error lines, e.g. {log_lines[-1][:200]!r}")
                proxy.service.stop()

        # (a) latency: one gateway for every round
        try:
            proxy = start_gateway("gateway_sse")
        except bench.BenchError as exc:
            note(f"skipped: the gateway did not start with the streaming policy: {str(exc).splitlines()[0][:300]}")
            return result
        meta["commands"]["gateway_sse"] = proxy.cmd
        keys = [k for k in LATENCY_KEYS if h2 is not None or not k.endswith("_h2")]
        bench.log(f"streaming: latency, {events} paced events × {args.rounds} rounds per configuration "
                  f"({', '.join(keys)}); origin {args.sse_origin_ip}:443, gateway pid {proxy.pid}")
        asyncio.run(latency_rounds(bench, c, keys, events, args.rounds, result))
        stop_gateway("gateway_sse")
        summarise_latency(result)
        # (b) memory: a fresh gateway per rule kind
        for kind in ("unbound", "bound"):
            key = f"gateway_sse_{kind}"
            try:
                proxy = start_gateway(key)
            except bench.BenchError as exc:
                result["memory"][kind] = {"status": "error", "error": str(exc).splitlines()[0][:300]}
                note(f"memory {kind}: the gateway did not start: {str(exc).splitlines()[0][:300]}")
                continue
            try:
                result["memory"][kind] = asyncio.run(memory_figure(bench, c, proxy, kind, count))
            except Exception as exc:  # noqa: BLE001 - one figure failing is a note, not a failed run
                result["memory"][kind] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                stop_gateway(key)
            m = result["memory"][kind]
            if m.get("status") == "error":
                note(f"memory {kind}: {m['error']}")
            else:
                bench.log(f"streaming: memory {kind}: {m['opened']} streams open ({m['first_event_received']} got "
                          f"their event, origin holding {m['origin_holding']}): RSS {m['rss_idle_mib']:.1f} → "
                          f"{m['rss_open_mib']:.1f} MiB, {bench.fmtn(m['kib_per_stream'])} KiB per stream")
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - the group must not fail the run
        note(f"stopped by an error: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        for key in started_keys:
            proxy = setup.proxies.pop(key, None)
            if proxy is not None and proxy.service is not None:
                proxy.service.stop()
        if origin is not None:
            origin.stop()
            setup.nginx.pop("sse-origin", None)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        if previous_env is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = previous_env
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        if not result["latency"].get("direct_h1", {}).get("summary"):
            summarise_latency(result)
    return result


async def latency_rounds(bench, c: Context, keys: list[str], events: int, rounds: int, result: dict) -> None:
    for key in keys:  # warm-up, not counted: every code path once (buffered or not, a burst completes)
        kind, proto = key.rsplit("_", 1)
        alpn = PROTOCOLS[proto][0]
        try:
            await burst(c, "unbound" if kind == "direct" else kind, alpn, None if kind == "direct" else c.proxy)
        except Exception as exc:  # noqa: BLE001 - the paced runs will say what is wrong
            bench.log(f"streaming: warm-up {key}: {type(exc).__name__}: {exc}")
    active = list(keys)
    for rnd in range(rounds):
        for key in bench.rotated(active, rnd):
            entry = result["latency"].setdefault(key, {"label": label(key), "rounds": []})
            res = await paced_run(c, key, events)
            res["round"] = rnd + 1
            entry["rounds"].append(res)
            s = sorted(res["samples_ms"])
            bench.log(f"  sse {key:11s} round {rnd + 1}: {res['status']:8s} {len(s):4d} events  p50 "
                      f"{bench.fmtn(_pct(s, 50), 3)} ms  max {bench.fmtn(s[-1] if s else None, 3)} ms"
                      + (f"  ({res['error']})" if res.get("error") else "")
                      + (f"  origin saw {res.get('origin_protocol')}, authorization {res.get('origin_auth')}"
                         if rnd == 0 else ""))
            await asyncio.sleep(0.1)
        # a configuration whose first event never arrived will not stream in the next round either
        active = [k for k in active if result["latency"][k]["rounds"][-1]["status"] != "buffered"]


async def memory_figure(bench, c: Context, proxy, kind: str, count: int) -> dict:
    warmup_error = None
    try:
        await burst(c, kind, "http/1.1", c.proxy)  # the warm-up request (completes even when buffered)
    except Exception as exc:  # noqa: BLE001 - the request was made; what went wrong is reported
        warmup_error = f"{type(exc).__name__}: {str(exc)[:200]}"
    await asyncio.sleep(1.0)
    idle = bench.memory(proxy.pids())
    res = await open_streams(c, kind, count, bench.IDLE_SOURCES.split(","), lambda: bench.memory(proxy.pids()))
    open_ = res.pop("with_streams")
    n = res["opened"]
    res.update({
        "status": "ok" if res["first_event_received"] == n and n else ("buffered" if n else "error"),
        "rss_idle_mib": idle["rss_kib"] / 1024, "rss_open_mib": open_["rss_kib"] / 1024,
        "pss_idle_mib": idle["pss_kib"] / 1024 if idle["pss_kib"] is not None else None,
        "pss_open_mib": open_["pss_kib"] / 1024 if open_["pss_kib"] is not None else None,
        "kib_per_stream": (open_["rss_kib"] - idle["rss_kib"]) / n if n else None,
        "processes": open_["processes"], "warmup_error": warmup_error,
    })
    if not n:
        res["error"] = f"no stream opened: {res['errors']}"
    return res


# --------------------------------------------------------------------------------------------
# summary, targets, markdown


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarise_latency(result: dict) -> None:
    lat = result["latency"]
    for key, entry in lat.items():
        kind, proto = key.rsplit("_", 1)
        rounds = entry["rounds"]
        samples = sorted(s for r in rounds for s in r["samples_ms"])
        statuses = [r["status"] for r in rounds]
        summary = {"events": len(samples), "rounds": len(rounds), "p50_ms": _pct(samples, 50),
                   "p99_ms": _pct(samples, 99), "max_ms": samples[-1] if samples else None,
                   "status": "ok" if statuses and all(s == "ok" for s in statuses) else
                   next((s for s in statuses if s != "ok"), "not run"),
                   "origin_protocol": next((r.get("origin_protocol") for r in rounds if r.get("origin_protocol")), None),
                   "origin_auth": next((r.get("origin_auth") for r in rounds if r.get("origin_auth")), None),
                   "headers_arrived": next((r.get("headers_arrived") for r in rounds if "headers_arrived" in r), None),
                   "error": next((r["error"] for r in rounds if r.get("error")), None)}
        if kind != "direct":
            direct = {r["round"]: r for r in lat.get(f"direct_{proto}", {}).get("rounds", [])}
            extra, paired = [], []
            for r in rounds:
                base = direct.get(r["round"])
                if not r["samples_ms"] or not base or not base["samples_ms"]:
                    continue
                b = statistics.median(base["samples_ms"])
                extra += [s - b for s in r["samples_ms"]]
                paired.append(statistics.median(r["samples_ms"]) - b)
            extra.sort()
            summary.update({"extra_median_ms": _pct(extra, 50), "extra_p99_ms": _pct(extra, 99),
                            "extra_worst_ms": extra[-1] if extra else None, "extra_round_medians_ms": paired})
            summary["met"] = (None if summary["extra_median_ms"] is None and summary["status"] in ("not run", "error")
                              else summary["extra_median_ms"] is not None and summary["status"] == "ok"
                              and summary["extra_median_ms"] <= MEDIAN_TARGET_MS
                              and summary["extra_worst_ms"] <= WORST_TARGET_MS)
            expected = "ok" if kind == "bound" else "none"
            if summary["origin_auth"] not in (None, expected):
                summary["warning"] = f"the origin saw authorization {summary['origin_auth']!r}, expected {expected!r}"
        entry["summary"] = summary


def why_not(summary: dict, timeout: float) -> str:
    status = summary.get("status")
    if status == "buffered":
        return (f"buffered: the event never arrived (waited {timeout:g} s; the response headers "
                f"{'did' if summary.get('headers_arrived') else 'did not arrive either'})")
    if status == "stalled":
        return f"stalled: an event did not arrive within {timeout:g} s after {summary['events']} had"
    if status == "error":
        return f"error: {summary.get('error')}"
    return status or "not run"


def targets(result: dict) -> list[dict]:
    found = []
    timeout = result["params"]["timeout_s"]
    for key in LATENCY_KEYS:
        entry = result["latency"].get(key)
        if not entry or key.startswith("direct"):
            continue
        s = entry["summary"]
        note = (f"worst {s['extra_worst_ms']:.2f} ms, p99 {s['extra_p99_ms']:.2f} ms over {s['events']} events"
                if s.get("extra_worst_ms") is not None else "")
        if s["status"] != "ok":
            note = (note + "; " if note else "") + why_not(s, timeout)
        found.append({"target": f"SSE extra latency per event, {label(key)}: median (ms)",
                      "value": s.get("extra_median_ms"),
                      "required": f"median ≤ {MEDIAN_TARGET_MS:g}, worst ≤ {WORST_TARGET_MS:g}", "met": s["met"],
                      "note": note})
    for kind, m in result["memory"].items():
        value = m.get("kib_per_stream")
        note = (f"{m.get('opened')} streams, {m.get('first_event_received')} received their event"
                if m.get("status") != "error" else m.get("error", ""))
        if m.get("status") == "buffered":
            note += " (buffered: the open streams' events never arrived; memory of the streams held open anyway)"
        found.append({"target": f"gateway RSS per open SSE stream, HTTP/1.1, {KINDS[kind]} (KiB)", "value": value,
                      "required": f"≤ {MEMORY_TARGET_KIB:g}", "met": None if value is None else value <= MEMORY_TARGET_KIB,
                      "note": note})
    return found


def _f(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown(result: dict) -> list[str]:
    p = result["params"]
    L = ["## Streaming (SSE): extra latency per event, memory per open stream", "",
         f"Origin: this run's own asyncio TLS server on {p['origin']} (HTTP/1.1 and HTTP/2 by ALPN) sending events of "
         f"{p['event_bytes']} bytes shaped like a model API's (`data: {{\"type\":\"content_block_delta\",...}}`), one "
         "at a time: event N+1 only after the client confirmed event N on a side channel, each stamped with its "
         "CLOCK_MONOTONIC send time; the client (the benchmark's process) notes when it has the whole event. "
         f"{p['events']} events per stream and round (event 0, which carries the response headers, not counted), "
         f"{p['rounds']} rounds in a rotating order. Extra = an event's latency through the gateway − the median "
         "latency of direct over the same protocol in the same round; median and worst over every event. The gateway "
         f"runs on CPU 0, origin and client on CPU 1{'' if p['pinned'] else ' (pinning off: anywhere)'}. Bound rule: "
         f"`Authorization: Bearer ${{secrets.key}}`, an env secret of {p['secret_chars']} characters. Every wait "
         f"ends after {p['timeout_s']:g} s. ms.", ""]
    if result["latency"]:
        L += ["| configuration | events | p50 | p99 | max | extra median | extra p99 | extra worst | target | |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for key in LATENCY_KEYS:
        entry = result["latency"].get(key)
        if not entry:
            continue
        s = entry["summary"]
        if key.startswith("direct"):
            met, tail = "", "" if s["status"] == "ok" else why_not(s, p["timeout_s"])
        else:
            met = "n/a" if s["met"] is None else ("met" if s["met"] else "**missed**")
            tail = "; ".join(x for x in (why_not(s, p["timeout_s"]) if s["status"] != "ok" else "",
                                         f"origin saw {s['origin_protocol']}" if s.get("origin_protocol") else "",
                                         s.get("warning", "")) if x)
        L.append(f"| {label(key)} | {s['events']} | {_f(s['p50_ms'], 3)} | {_f(s['p99_ms'], 3)} | {_f(s['max_ms'], 3)} | "
                 f"{_f(s.get('extra_median_ms'))} | {_f(s.get('extra_p99_ms'))} | {_f(s.get('extra_worst_ms'))} | "
                 f"{met} | {tail} |")
    if result["latency"]:
        L.append("")
    if result["memory"]:
        L += [f"Memory: a fresh gateway per rule kind; RSS (all its processes) after start-up and one warm-up request, "
              f"then with {p['streams']:,} SSE responses open through it at once (HTTP/1.1, one CONNECT tunnel each, "
              "from four loopback source addresses), each sent one event by the origin and held open. KiB per stream "
              "= (RSS open − RSS idle) / streams open.", "",
              "| configuration | streams open | got their event | origin holding | RSS idle, MiB | RSS open, MiB | "
              f"KiB per stream | target ≤ {MEMORY_TARGET_KIB:g} | |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for kind, m in result["memory"].items():
            if m.get("status") == "error":
                L.append(f"| HTTP/1.1, {KINDS[kind]} | | | | | | | n/a | {m.get('error', '')} |")
                continue
            v = m["kib_per_stream"]
            L.append(f"| HTTP/1.1, {KINDS[kind]} | {m['opened']} | {m['first_event_received']} | {m['origin_holding']} | "
                     f"{_f(m['rss_idle_mib'], 1)} | {_f(m['rss_open_mib'], 1)} | {_f(v, 1)} | "
                     f"{'n/a' if v is None else 'met' if v <= MEMORY_TARGET_KIB else '**missed**'} | "
                     + ("buffered: the events never arrived" if m["status"] == "buffered" else "")
                     + (f"; {m['failed']} failed: {m['errors']}" if m.get("failed") else "")
                     + (f"; the warm-up request failed: {m['warmup_error']}" if m.get("warmup_error") else "") + " |")
        L.append("")
    for text in result["notes"]:
        L.append(f"- {text}")
    if result["notes"]:
        L.append("")
    return L


def main() -> int:
    p = argparse.ArgumentParser(description="the SSE origin of bench/run.py's streaming group")
    sub = p.add_subparsers(dest="command", required=True)
    o = sub.add_parser("origin", help="serve SSE on --listen (TLS) with a control channel on --control")
    o.add_argument("--listen", required=True, help="IP:PORT for TLS (HTTP/1.1 and HTTP/2)")
    o.add_argument("--control", required=True, help="IP:PORT of the plain-TCP side channel")
    o.add_argument("--cert", required=True)
    o.add_argument("--key", required=True)
    o.add_argument("--small", required=True, help="file served at /small.txt (run.py's sanity check)")
    o.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an ACK")
    args = p.parse_args()
    return asyncio.run(origin_main(args))


if __name__ == "__main__":
    sys.exit(main())
