#!/usr/bin/env python3
"""Open many CONNECT tunnels through a proxy, establish TLS through each, and keep them idle.

Used by bench/run.py for the "RSS with 1,000 idle tunnels" figure; it can also be run by hand:

    python bench/idle_tunnels.py --proxy 127.0.0.1:8080 --target origin.bench:443 --cafile CA --count 1000

Each tunnel: TCP to the proxy (from one of --sources, round robin, so that no single client address
holds every connection), `CONNECT target`, a 200, a TLS handshake with the name of the target verified
against --cafile (the proxy's CA when it intercepts, the origin's when it passes TLS through), one
`GET --path` answered 200 — so an intercepting proxy has its upstream connection open too — and then
nothing: the connection stays open and idle. With no --proxy, the same straight to --connect (HOST:PORT).
With --sse the request is answered by a server-sent-events stream that stays open: the tunnel counts as
open once the first whole event (up to its blank line) has arrived, and then holds the stream.

Prints one JSON line when every tunnel is open (or failed): {"open": N, "failed": M, "seconds": S,
"errors": {...}}, then holds the tunnels until its standard input closes (or SIGTERM/SIGINT), closes them
and exits 0. Not a test (bench/ is not collected by pytest).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import signal
import ssl
import sys
import time


def get_request(args) -> bytes:
    """GET --path on --target, as sent through the tunnel."""
    host, port = args.target.rsplit(":", 1)
    authority = host if port == "443" else f"{host}:{port}"  # RFC 9110: a port other than the default is named
    return f"GET {args.path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


async def get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, sse: bool = False) -> None:
    """Send `request` and read its answer, which must be a 200 (its body by content-length; with
    `sse`, an event stream's first event, the stream then held open)."""
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if lines[0].split()[1:2] != ["200"]:
        raise ConnectionError(f"GET answered {lines[0][:60]!r}")
    if sse:
        await first_event(reader, lines[1:])
        return
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)


async def first_event(reader: asyncio.StreamReader, header_lines: list[str]) -> None:
    """Read an SSE response's first whole event (chunked or read-until-close framing alike: the event's
    blank line is in the bytes either way), so the stream is known to run end to end, unbuffered."""
    fields = {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    if not fields.get("content-type", "").startswith("text/event-stream"):
        raise ConnectionError(f"not an event stream: {fields.get('content-type')!r}")
    event = await reader.readuntil(b"\n\n")
    if b"data:" not in event:
        raise ConnectionError(f"not an event: {event[:60]!r}")


async def open_tunnel(args, source: str | None, ctx: ssl.SSLContext):
    host, port = args.target.rsplit(":", 1)
    if args.proxy:
        p_host, p_port = args.proxy.rsplit(":", 1)
    else:
        p_host, p_port = (args.connect or args.target).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(p_host, int(p_port),
                                                   local_addr=(source, 0) if source else None)
    try:
        if args.proxy:
            writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0].split()
            if len(status) < 2 or status[1] != b"200":
                raise ConnectionError(f"CONNECT answered {head.split(b'\r\n', 1)[0][:60]!r}")
        await writer.start_tls(ctx, server_hostname=host)
        await get(reader, writer, get_request(args), args.sse)
        return reader, writer
    except BaseException:
        writer.close()
        raise


async def main_async(args) -> int:
    ctx = ssl.create_default_context(cafile=args.cafile)
    ctx.set_alpn_protocols(["http/1.1"])
    sources = args.sources.split(",") if args.sources else [None]
    semaphore = asyncio.Semaphore(args.concurrency)
    tunnels = []
    errors: collections.Counter[str] = collections.Counter()

    async def one(i: int) -> None:
        async with semaphore:
            try:
                tunnels.append(await asyncio.wait_for(open_tunnel(args, sources[i % len(sources)], ctx),
                                                      args.timeout))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(args.count)))
    print(json.dumps({"open": len(tunnels), "failed": sum(errors.values()),
                      "seconds": round(time.monotonic() - started, 3),
                      "errors": dict(errors.most_common(5))}), flush=True)

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    # hold until stdin closes (the benchmark closes it when it has read the proxy's memory)
    stdin_closed = loop.run_in_executor(None, sys.stdin.buffer.read)
    waiter = asyncio.ensure_future(done.wait())
    await asyncio.wait([stdin_closed, waiter], return_when=asyncio.FIRST_COMPLETED)
    still_open = sum(1 for _, w in tunnels if not w.is_closing() and not w.transport.is_closing())
    for _, writer in tunnels:
        writer.close()
    print(json.dumps({"still_open_at_end": still_open}), flush=True)
    waiter.cancel()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proxy", help="HOST:PORT of the proxy (CONNECT); none: connect straight to --connect")
    p.add_argument("--connect", help="HOST:PORT to connect to without a proxy (default: --target)")
    p.add_argument("--target", required=True, help="HOST:PORT named in CONNECT and used as TLS server name")
    p.add_argument("--cafile", required=True, help="CA that the TLS certificate seen through the tunnel must chain to")
    p.add_argument("--path", default="/small.txt", help="the one request sent on each tunnel")
    p.add_argument("--sse", action="store_true", help="the request opens an event stream: wait for its first "
                   "event, then hold it open")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32, help="tunnels being opened at once")
    p.add_argument("--sources", default="", help="comma-separated local addresses to connect from, round robin")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to open one tunnel")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.count + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.count * 2 + 100), hard))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
