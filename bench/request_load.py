#!/usr/bin/env python3
"""Load a proxy for a fixed time: keep-alive HTTPS requests over open tunnels, or new tunnels.

Used by bench/cpu_per_request.py; it can also be run by hand:

    python bench/request_load.py --proxy 127.0.0.1:37001 --target origin.bench:37000 --cafile CA keepalive
    python bench/request_load.py --proxy 127.0.0.1:37001 --target origin.bench:37000 --cafile CA newconn

- keepalive: --concurrency tunnels are opened first (CONNECT, TLS through the tunnel, one GET: their
  set-up is not part of the figure), then one line `{"ready": true}` is printed and the load waits for
  one line on standard input; then each tunnel sends GET after GET, one at a time, for --seconds.
- newconn: --concurrency loops each open a tunnel (CONNECT, TLS, one GET answered), close it and open
  the next, for --seconds, right away.

Prints one JSON line at the end: {"done": requests or tunnels completed, "failed": N, "seconds": S,
"errors": {...}}. Not a test (bench/ is not collected by pytest).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import ssl
import sys
import time

from idle_tunnels import get, get_request, open_tunnel


async def keepalive(args, ctx: ssl.SSLContext, errors: collections.Counter) -> int:
    request = get_request(args)
    tunnels = await asyncio.gather(*(open_tunnel(args, args.sources[i % len(args.sources)], ctx)
                                     for i in range(args.concurrency)))
    print(json.dumps({"ready": True}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    deadline = time.monotonic() + args.seconds
    done = 0

    async def loop(reader, writer) -> None:
        nonlocal done
        try:
            while time.monotonic() < deadline:
                await get(reader, writer, request)
                done += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
        finally:
            writer.close()

    await asyncio.gather(*(loop(r, w) for r, w in tunnels))
    return done


async def newconn(args, ctx: ssl.SSLContext, errors: collections.Counter) -> int:
    deadline = time.monotonic() + args.seconds
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            try:
                _, writer = await asyncio.wait_for(open_tunnel(args, args.sources[i % len(args.sources)], ctx), 30)
                writer.close()
                done += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1

    await asyncio.gather(*(loop(i) for i in range(args.concurrency)))
    return done


async def main_async(args) -> int:
    ctx = ssl.create_default_context(cafile=args.cafile)
    ctx.set_alpn_protocols(["http/1.1"])
    errors: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    done = await (keepalive if args.kind == "keepalive" else newconn)(args, ctx, errors)
    print(json.dumps({"done": done, "failed": sum(errors.values()), "seconds": round(time.monotonic() - started, 3),
                      "errors": dict(errors.most_common(5))}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proxy", required=True, help="HOST:PORT of the proxy (CONNECT)")
    p.add_argument("--target", required=True, help="HOST:PORT named in CONNECT and used as TLS server name")
    p.add_argument("--cafile", required=True, help="the proxy's CA")
    p.add_argument("--path", default="/small.txt")
    p.add_argument("--concurrency", type=int, default=16, help="tunnels (keepalive) or opening loops (newconn)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--sources", default="127.0.0.201,127.0.0.202,127.0.0.203,127.0.0.204,127.0.0.205,127.0.0.206,"
                   "127.0.0.207,127.0.0.208", help="local addresses to connect from, round robin: each is a sandbox "
                   "of its own to the gateway's per-sandbox rates (200 requests/s and 50 new connections/s)")
    p.add_argument("kind", choices=("keepalive", "newconn"))
    args = p.parse_args()
    args.connect, args.sse = None, False  # (what idle_tunnels.open_tunnel reads that this load does not set)
    args.sources = args.sources.split(",")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
