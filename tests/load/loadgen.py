"""The load generator: asyncio clients that talk to the gateway the way sandboxes do.

Two kinds of traffic, run at the same time against one gateway:

- **kept-alive tunnels** (`keepalive_client`): CONNECT to the allowed host, TLS inside the tunnel
  (verifying the gateway's CA), then one request every `request_interval` seconds (jittered) on the
  same connection until the hold phase ends. Every `deny_path_every`-th request asks for a path the
  policy refuses (403 `path_not_allowed`, expected, on the same kept-alive connection).
- **new connections** (`new_connection`): a steady stream of fresh CONNECT + TLS + one request +
  close; every `deny_connect_every`-th one is a CONNECT to the forbidden host instead (403
  `no_rule`, expected).

Everything is counted in `LoadStats`: what was sent, what came back (by status and reason), the
latency of every request and of every new connection's CONNECT + TLS set-up, and every error (a
reset, an early close, a TLS failure, a time-out, or a status the test did not provoke).

Bounded: a fixed number of clients, every network operation under a time-out, the hold phase
ends at a fixed time, and the caller closes every connection. Loopback only (the caller passes
the proxy address; `run_load` refuses anything else).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoadConfig:
    proxy_host: str
    proxy_port: int
    ca_file: str
    allowed_host: str
    forbidden_host: str
    allowed_path: str = "/ok/"
    forbidden_path: str = "/forbidden/"
    connections: int = 1000           # kept-alive tunnels held at once
    hold_seconds: float = 20.0        # how long all of them stay open and busy
    request_interval: float = 15.0    # seconds between two requests on one kept-alive tunnel
    deny_path_every: int = 20         # every Nth kept-alive request is to a refused path (0: never)
    new_rate: float = 5.0             # new connections per second during the hold phase
    deny_connect_every: int = 4       # every Nth new connection is a refused CONNECT (0: never)
    ramp_concurrency: int = 24        # tunnels being set up at once during the ramp
    ramp_timeout: float = 150.0       # the ramp gives up after this long
    op_timeout: float = 30.0          # any single network operation
    seed: int = 1


@dataclass
class LoadStats:
    connects_sent: int = 0
    connects_allowed: int = 0         # 200 to CONNECT
    connects_denied: int = 0          # 403 no_rule to CONNECT (provoked)
    tls_ok: int = 0
    requests_sent: int = 0
    requests_ok: int = 0              # 200 from the upstream
    requests_denied: int = 0          # 403 path_not_allowed (provoked)
    keepalive_established: int = 0
    keepalive_open: int = 0
    keepalive_open_max: int = 0
    in_flight: int = 0                # requests sent and not answered (or failed) yet
    new_started: int = 0
    new_done: int = 0
    new_allowed_done: int = 0         # new connections that went through (CONNECT, TLS, a request)
    statuses: Counter = field(default_factory=Counter)        # (what, status, reason) -> count
    errors: Counter = field(default_factory=Counter)          # kind -> count
    error_samples: list = field(default_factory=list)
    request_latencies: list = field(default_factory=list)     # seconds, every request (allowed and denied)
    hold_request_latencies: list = field(default_factory=list)  # the subset sent during the hold phase
    setup_latencies: list = field(default_factory=list)       # CONNECT + TLS of the new connections
    phases: dict = field(default_factory=dict)                # name -> time.monotonic()

    def error(self, kind: str, detail: str = "") -> None:
        self.errors[kind] += 1
        if len(self.error_samples) < 30:
            self.error_samples.append(f"{kind}: {detail}"[:400])

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


class UnexpectedStatus(Exception):
    def __init__(self, what: str, status: int, reason: str | None, head: bytes):
        super().__init__(f"{what}: {status} {reason or ''} {head[:300]!r}")
        self.status = status


def classify(exc: BaseException) -> str:
    if isinstance(exc, UnexpectedStatus):
        return f"status {exc.status}" + (" (5xx)" if exc.status >= 500 else "")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "closed early (EOF)"
    if isinstance(exc, ssl.SSLError):
        return "TLS error"
    if isinstance(exc, (BrokenPipeError, ConnectionAbortedError)):
        return "broken pipe"
    return type(exc).__name__


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1 response: {head[:200]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


class Tunnel:
    """One client connection to the gateway: CONNECT, then TLS, then HTTP/1.1 requests."""

    def __init__(self, cfg: LoadConfig, stats: LoadStats, tls: ssl.SSLContext):
        self.cfg, self.stats, self.tls = cfg, stats, tls
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _read_response(self) -> tuple[int, dict[str, str], bytes]:
        head = await self.reader.readuntil(b"\r\n\r\n")
        status, headers = _parse_head(head)
        length = int(headers.get("content-length") or 0)
        body = await self.reader.readexactly(length) if length else b""
        return status, headers, head + body

    async def connect(self, host: str, expect: int) -> None:
        """CONNECT host:443; on 200 start TLS (SNI = host, the gateway's CA verified)."""
        cfg, stats = self.cfg, self.stats
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(cfg.proxy_host, cfg.proxy_port, limit=256 * 1024), cfg.op_timeout)
        stats.connects_sent += 1
        self.writer.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        status, headers, raw = await asyncio.wait_for(self._read_response(), cfg.op_timeout)
        reason = headers.get("x-egress-reason")
        stats.statuses[("CONNECT", status, reason)] += 1
        if status == 200:
            stats.connects_allowed += 1
        elif status == 403 and reason == "no_rule":
            stats.connects_denied += 1
        if (status, reason if status != 200 else None) != (expect, None if expect == 200 else "no_rule"):
            raise UnexpectedStatus(f"CONNECT {host}", status, reason, raw)
        if status != 200:
            return
        await asyncio.wait_for(self.writer.start_tls(self.tls, server_hostname=host), cfg.op_timeout)
        stats.tls_ok += 1

    async def request(self, host: str, path: str, hold: bool = False) -> None:
        cfg, stats = self.cfg, self.stats
        denied = path.startswith(cfg.forbidden_path)
        started = time.monotonic()
        stats.requests_sent += 1
        stats.in_flight += 1
        try:
            self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: egress-load-test\r\n\r\n".encode())
            await asyncio.wait_for(self.writer.drain(), cfg.op_timeout)
            status, headers, raw = await asyncio.wait_for(self._read_response(), cfg.op_timeout)
        finally:
            stats.in_flight -= 1
        elapsed = time.monotonic() - started
        stats.request_latencies.append(elapsed)
        if hold:
            stats.hold_request_latencies.append(elapsed)
        reason = headers.get("x-egress-reason")
        stats.statuses[("GET", status, reason)] += 1
        if not denied and status == 200 and headers.get("x-upstream") == "load":
            stats.requests_ok += 1
        elif denied and status == 403 and reason == "path_not_allowed":
            stats.requests_denied += 1
        else:
            raise UnexpectedStatus(f"GET {path}", status, reason, raw)
        if headers.get("connection", "").lower() == "close":
            raise UnexpectedStatus(f"GET {path} closed the kept-alive connection", status, reason, raw)

    async def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 5)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the client's own close: not the gateway's error


def client_tls_context(ca_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def keepalive_client(index: int, cfg: LoadConfig, stats: LoadStats, tls: ssl.SSLContext,
                           ramp: asyncio.Semaphore, hold_start: asyncio.Event, release: asyncio.Event, rng: random.Random) -> None:
    tunnel = Tunnel(cfg, stats, tls)
    counted = False
    try:
        async with ramp:
            await tunnel.connect(cfg.allowed_host, 200)
            await tunnel.request(cfg.allowed_host, f"{cfg.allowed_path}{index}/first")  # opens the upstream side
        stats.keepalive_established += 1
        stats.keepalive_open += 1
        stats.keepalive_open_max = max(stats.keepalive_open_max, stats.keepalive_open)
        counted = True
        await hold_start.wait()
        end = stats.phases["hold_end_at"]
        # spread the tunnels evenly over one interval, then a steady, jittered rhythm
        next_at = time.monotonic() + rng.uniform(0, cfg.request_interval)
        n = 0
        while True:
            now = time.monotonic()
            if next_at >= end:
                break
            await asyncio.sleep(max(0.0, next_at - now))  # pacing, not synchronisation: the request rate
            n += 1
            if cfg.deny_path_every and (index + n) % cfg.deny_path_every == 0:
                path = f"{cfg.forbidden_path}{index}/{n}"
            else:
                path = f"{cfg.allowed_path}{index}/{n}"
            await tunnel.request(cfg.allowed_host, path, hold=True)
            next_at += cfg.request_interval * rng.uniform(0.8, 1.2)
        await release.wait()  # all tunnels stay open until the caller has measured the peak
    except Exception as exc:  # noqa: BLE001 - every failure is counted, none may escape
        stats.error(classify(exc), f"keep-alive #{index}: {type(exc).__name__}: {exc}")
    finally:
        if counted:
            stats.keepalive_open -= 1
        await tunnel.close()


async def new_connection(index: int, cfg: LoadConfig, stats: LoadStats, tls: ssl.SSLContext) -> None:
    stats.new_started += 1
    tunnel = Tunnel(cfg, stats, tls)
    denied = bool(cfg.deny_connect_every) and index % cfg.deny_connect_every == cfg.deny_connect_every - 1
    try:
        started = time.monotonic()
        if denied:
            await tunnel.connect(cfg.forbidden_host, 403)
            stats.setup_latencies.append(time.monotonic() - started)
        else:
            await tunnel.connect(cfg.allowed_host, 200)
            stats.setup_latencies.append(time.monotonic() - started)
            await tunnel.request(cfg.allowed_host, f"{cfg.allowed_path}new/{index}", hold=True)
            stats.new_allowed_done += 1
        stats.new_done += 1
    except Exception as exc:  # noqa: BLE001
        stats.error(classify(exc), f"new #{index} ({'denied' if denied else 'allowed'}): {type(exc).__name__}: {exc}")
    finally:
        await tunnel.close()


async def run_load(cfg: LoadConfig, stats: LoadStats, on_phase=None) -> None:
    """Ramp up `cfg.connections` kept-alive tunnels, hold them for `cfg.hold_seconds` with the
    stream of new connections alongside, then close everything.

    `on_phase(name)` (a coroutine function, optional) runs at "ramped" (all tunnels up, before the
    hold phase), "held" (hold phase over, every tunnel still open) and "closed"; the caller samples
    the gateway there."""
    if not ipaddress.ip_address(cfg.proxy_host).is_loopback:
        raise ValueError("the load generator talks to loopback addresses only")
    rng = random.Random(cfg.seed)
    tls = client_tls_context(cfg.ca_file)
    ramp = asyncio.Semaphore(cfg.ramp_concurrency)
    hold_start, release = asyncio.Event(), asyncio.Event()

    async def phase(name: str) -> None:
        stats.phases[name] = time.monotonic()
        if on_phase is not None:
            await on_phase(name)

    await phase("ramp_start")
    clients = [asyncio.create_task(keepalive_client(i, cfg, stats, tls, ramp, hold_start, release,
                                                    random.Random(rng.random())))
               for i in range(cfg.connections)]
    deadline = time.monotonic() + cfg.ramp_timeout
    while (stats.keepalive_established + stats.error_count < cfg.connections) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # polling, not synchronisation: this loop's own counters, re-read each turn
    await phase("ramped")

    stats.phases["hold_end_at"] = time.monotonic() + cfg.hold_seconds
    hold_start.set()
    await phase("hold_start")
    news: list[asyncio.Task] = []
    total_new = int(cfg.hold_seconds * cfg.new_rate)
    begin = time.monotonic()
    for i in range(total_new):
        await asyncio.sleep(max(0.0, begin + i / cfg.new_rate - time.monotonic()))  # pacing, not synchronisation
        news.append(asyncio.create_task(new_connection(i, cfg, stats, tls)))
    await asyncio.sleep(max(0.0, stats.phases["hold_end_at"] - time.monotonic()))  # not synchronisation: the hold phase
    # the last requests of the hold phase and the last new connections finish (each under op_timeout)
    await asyncio.wait(news, timeout=cfg.op_timeout + 5) if news else None
    while stats.in_flight and time.monotonic() < stats.phases["hold_end_at"] + cfg.op_timeout + 5:
        await asyncio.sleep(0.05)  # polling, not synchronisation: this loop's own counter, re-read each turn
    await phase("held")

    release.set()
    done, pending = await asyncio.wait(clients, timeout=cfg.op_timeout + 10)
    for task in pending:
        task.cancel()
        stats.error("client did not finish", "cancelled")
    for task in news:
        if not task.done():
            task.cancel()
            stats.error("new connection did not finish", "cancelled")
    await asyncio.gather(*clients, *news, return_exceptions=True)
    await phase("closed")


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


async def open_tunnels(cfg: LoadConfig, stats: LoadStats, count: int, label: str,
                       concurrency: int | None = None) -> list[Tunnel]:
    """`count` tunnels to the allowed host, each with one request done (so its upstream side is
    open too). Failures are counted in `stats`; the tunnels that made it are returned, open."""
    tls = client_tls_context(cfg.ca_file)
    gate = asyncio.Semaphore(concurrency or cfg.ramp_concurrency)

    async def one(i: int) -> Tunnel | None:
        tunnel = Tunnel(cfg, stats, tls)
        try:
            async with gate:
                await tunnel.connect(cfg.allowed_host, 200)
                await tunnel.request(cfg.allowed_host, f"{cfg.allowed_path}{label}/{i}")
            return tunnel
        except Exception as exc:  # noqa: BLE001
            stats.error(classify(exc), f"{label} #{i}: {type(exc).__name__}: {exc}")
            await tunnel.close()
            return None

    return [t for t in await asyncio.gather(*(one(i) for i in range(count))) if t is not None]


async def deny_connects(cfg: LoadConfig, stats: LoadStats, count: int) -> None:
    """`count` CONNECTs to the forbidden host, each expecting 403 no_rule."""
    tls = client_tls_context(cfg.ca_file)
    for i in range(count):
        tunnel = Tunnel(cfg, stats, tls)
        try:
            await tunnel.connect(cfg.forbidden_host, 403)
        except Exception as exc:  # noqa: BLE001
            stats.error(classify(exc), f"denied #{i}: {type(exc).__name__}: {exc}")
        finally:
            await tunnel.close()


async def close_all(tunnels: list[Tunnel]) -> None:
    await asyncio.gather(*(t.close() for t in tunnels))


async def keep_busy(tunnel: Tunnel, interval: float, stop: asyncio.Event, label: str) -> None:
    """Requests on one open tunnel every `interval` s (jittered) until `stop` is set."""
    cfg, stats = tunnel.cfg, tunnel.stats
    rng = random.Random(label)
    n = 0
    try:
        await asyncio.sleep(rng.uniform(0, interval))  # pacing, not synchronisation: spread the clients' starts
        while not stop.is_set():
            n += 1
            await tunnel.request(cfg.allowed_host, f"{cfg.allowed_path}{label}/{n}")
            try:
                await asyncio.wait_for(stop.wait(), interval * rng.uniform(0.8, 1.2))
            except asyncio.TimeoutError:
                pass
    except Exception as exc:  # noqa: BLE001
        stats.error(classify(exc), f"{label}: {type(exc).__name__}: {exc}")


async def refused_at_once(cfg: LoadConfig, wait: float = 5.0) -> str:
    """Open a TCP connection to the gateway and read: "closed" when the gateway closes it without a
    byte (EOF or reset) within `wait` s, else "data: ..." or "open" (still open after `wait` s)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(cfg.proxy_host, cfg.proxy_port), cfg.op_timeout)
    try:
        data = await asyncio.wait_for(reader.read(100), wait)
        return "closed" if data == b"" else f"data: {data!r}"
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    except asyncio.TimeoutError:
        return "open"
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 2)
        except (OSError, asyncio.TimeoutError):
            pass
