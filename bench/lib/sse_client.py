"""The streaming group's client (in bench/run.py's process, asyncio, raw sockets): paced streams for the
latency figure, held streams for the memory figure, through the gateway or direct."""

from __future__ import annotations

import asyncio
import collections
import json
import secrets as pysecrets
import ssl
import time
from pathlib import Path

from lib.sse_events import ORIGIN_NAME, PROTOCOLS, StreamError, h2, parse_event


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
