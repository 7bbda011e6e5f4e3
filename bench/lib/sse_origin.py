"""The streaming group's origin (a subprocess: `python bench/streaming.py origin ...`): an asyncio TLS server
speaking HTTP/1.1 and HTTP/2, sending paced events one at a time, each after the client's ACK on a side
channel, or holding streams open for the memory figure."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import resource
import signal
import ssl
import sys
import time
import urllib.parse
from pathlib import Path

from lib.sse_events import EVENT_BYTES, SECRET_ENV, SMALL_PATH, SSE_HEADERS, h2, sse_event


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
