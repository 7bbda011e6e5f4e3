"""A fast asyncio HTTPS upstream for the load tests, run as its own process.

    python -m tests.load.upstream --host 127.X.0.20 --port 443 --cert C --key K --stats FILE [--max-seconds N]

The recording upstreams in tests/support are thread-per-connection servers; the load tests hold a
thousand kept-alive upstream connections at once, so this one is a single asyncio loop in its own
process (its own GIL, its own core when the scheduler allows). It answers every HTTP/1.1 request
with 200 and a small body, keeps connections alive, and counts: TCP connections accepted, TLS
handshakes completed, requests, requests whose Host header is not the expected name, connections
open now and at most, and protocol errors seen on its side.

The counts go to the JSON file `--stats` every 0.5 s and once more at exit. The process exits by
itself after `--max-seconds` (a safety bound), on SIGTERM/SIGINT, or when its parent dies. It binds
a loopback address only.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import ssl
import sys
import time

MAX_HEAD = 64 * 1024


class Stats:
    def __init__(self) -> None:
        self.connections = 0
        self.tls_handshakes = 0
        self.requests = 0
        self.wrong_host = 0
        self.open = 0
        self.max_open = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.started = time.time()

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stats: Stats, host: str,
                 tls: ssl.SSLContext) -> None:
    stats.connections += 1
    stats.open += 1
    stats.max_open = max(stats.max_open, stats.open)
    try:
        await writer.start_tls(tls, ssl_handshake_timeout=30)  # server side: we have a connected callback
        stats.tls_handshakes += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                return  # clean close between requests
            lines = head.decode("latin-1").split("\r\n")
            method, target, _version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if length:
                await reader.readexactly(length)
            stats.requests += 1
            if headers.get("host") not in (host, f"{host}:443"):
                stats.wrong_host += 1
            body = b"" if method == "HEAD" else f"load upstream: {method} {target}\n".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Upstream: load\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError, ValueError, TimeoutError) as exc:
        stats.errors += 1
        if len(stats.error_samples) < 20:
            stats.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])
    finally:
        stats.open -= 1
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, ssl.SSLError, OSError):
            pass


def write_stats(path: str, stats: Stats) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(stats.as_dict(), f)
    os.replace(tmp, path)


async def main(args: argparse.Namespace) -> int:
    if not ipaddress.ip_address(args.host).is_loopback:
        print("load upstream: loopback addresses only", file=sys.stderr)
        return 2
    stats = Stats()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(args.cert, args.key)
    tls.set_alpn_protocols(["http/1.1"])

    def on_accept(reader, writer):
        return handle(reader, writer, stats, args.name, tls)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # TLS is started inside the handler (not start_server(ssl=...)), so that TCP connections are
    # counted even when a handshake fails.
    server = await asyncio.start_server(on_accept, args.host, args.port, backlog=4096, limit=MAX_HEAD)
    write_stats(args.stats, stats)
    print("ready", flush=True)
    parent = os.getppid()
    deadline = time.monotonic() + args.max_seconds
    while not stop.is_set() and time.monotonic() < deadline and os.getppid() == parent:
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
        write_stats(args.stats, stats)
    server.close()
    write_stats(args.stats, stats)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=443)
    parser.add_argument("--name", required=True, help="the host name requests must carry")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--max-seconds", type=float, default=900)
    sys.exit(asyncio.run(main(parser.parse_args())))
