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
import os
import re
import resource
import secrets as pysecrets
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # run as a script (the origin subprocess): bench/lib next to it
    sys.path.insert(0, str(BENCH_DIR))

import report  # noqa: E402  (bench/report.py)
from lib.log import BenchError, log  # noqa: E402
from lib.names import IDLE_SOURCES  # noqa: E402
from lib.processes import Service, free_port, port_in_use, wait_for_port  # noqa: E402
from lib.procfs import memory  # noqa: E402
from lib.proxies import start_proxy  # noqa: E402
from lib.rounds import rotated  # noqa: E402
from lib.sse_client import Context, burst, open_streams, paced_run  # noqa: E402
from lib.sse_events import (  # noqa: E402
    EVENT_BYTES, LATENCY_KEYS, ORIGIN_NAME, PROTOCOLS, SECRET_ENV, SECRET_LENGTH, SMALL_PATH, h2, label,
)
from lib.sse_origin import origin_main  # noqa: E402
from lib.sse_report import _pct, summarise_latency  # noqa: E402


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


def run(setup, args, meta, tools: dict) -> dict:
    """The whole group: the origin, the latency rounds on one gateway, then a fresh gateway per rule kind for
    the memory figure. Never raises but KeyboardInterrupt: what cannot run is a note in the result (and a skip
    in `meta`, a RunMeta)."""
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
            meta.skipped["streaming"] = text.removeprefix("skipped: ")
        log(f"streaming: {text}")

    try:
        if not args.sse_origin_ip.startswith("127."):
            note("skipped: --sse-origin-ip must be in 127.0.0.0/8")
            return result
        if port_in_use(args.sse_origin_ip, 443):
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
        control_port = free_port()
        cert, key = setup.origin_cert
        origin = Service("sse-origin", setup.cpu(1) + [
            sys.executable, str(Path(__file__).resolve()), "origin", "--listen", f"{args.sse_origin_ip}:443",
            "--control", f"127.0.0.1:{control_port}", "--cert", str(cert), "--key", str(key),
            "--small", str(setup.www / SMALL_PATH.lstrip("/")), "--timeout", str(args.sse_timeout)],
            setup.workdir / "sse-origin.log", env=dict(os.environ, PYTHONUNBUFFERED="1"))
        setup.nginx["sse-origin"] = origin.start()  # stopped with the other origins if the run fails
        try:
            wait_for_port("127.0.0.1", control_port, origin.proc, timeout=20)
            wait_for_port(args.sse_origin_ip, 443, origin.proc, timeout=10)
        except BenchError as exc:
            note(f"skipped: the SSE origin did not start: {exc} {origin.tail(5)}")
            return result
        if setup.pin:
            affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {1})  # this thread is the client: CPU 1, with the origin; gateways on CPU 0
        c = Context((args.sse_origin_ip, 443), ("127.0.0.1", control_port), args.sse_timeout, setup.ca_cert)
        policy = policy_text(args.sse_origin_ip)

        def start_gateway(key: str):
            proxy = start_proxy(setup, key, tools, policy_text=policy)
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
        except BenchError as exc:
            note(f"skipped: the gateway did not start with the streaming policy: {str(exc).splitlines()[0][:300]}")
            return result
        meta.commands["gateway_sse"] = proxy.cmd
        keys = [k for k in LATENCY_KEYS if h2 is not None or not k.endswith("_h2")]
        log(f"streaming: latency, {events} paced events × {args.rounds} rounds per configuration "
                  f"({', '.join(keys)}); origin {args.sse_origin_ip}:443, gateway pid {proxy.pid}")
        asyncio.run(latency_rounds(c, keys, events, args.rounds, result))
        stop_gateway("gateway_sse")
        summarise_latency(result)
        # (b) memory: a fresh gateway per rule kind
        for kind in ("unbound", "bound"):
            key = f"gateway_sse_{kind}"
            try:
                proxy = start_gateway(key)
            except BenchError as exc:
                result["memory"][kind] = {"status": "error", "error": str(exc).splitlines()[0][:300]}
                note(f"memory {kind}: the gateway did not start: {str(exc).splitlines()[0][:300]}")
                continue
            try:
                result["memory"][kind] = asyncio.run(memory_figure(c, proxy, kind, count))
            except Exception as exc:  # noqa: BLE001 - one figure failing is a note, not a failed run
                result["memory"][kind] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                stop_gateway(key)
            m = result["memory"][kind]
            if m.get("status") == "error":
                note(f"memory {kind}: {m['error']}")
            else:
                log(f"streaming: memory {kind}: {m['opened']} streams open ({m['first_event_received']} got "
                          f"their event, origin holding {m['origin_holding']}): RSS {m['rss_idle_mib']:.1f} → "
                          f"{m['rss_open_mib']:.1f} MiB, {report.fmt(m['kib_per_stream'])} KiB per stream")
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


async def latency_rounds(c: Context, keys: list[str], events: int, rounds: int, result: dict) -> None:
    for key in keys:  # warm-up, not counted: every code path once (buffered or not, a burst completes)
        kind, proto = key.rsplit("_", 1)
        alpn = PROTOCOLS[proto][0]
        try:
            await burst(c, "unbound" if kind == "direct" else kind, alpn, None if kind == "direct" else c.proxy)
        except Exception as exc:  # noqa: BLE001 - the paced runs will say what is wrong
            log(f"streaming: warm-up {key}: {type(exc).__name__}: {exc}")
    active = list(keys)
    for rnd in range(rounds):
        for key in rotated(active, rnd):
            entry = result["latency"].setdefault(key, {"label": label(key), "rounds": []})
            res = await paced_run(c, key, events)
            res["round"] = rnd + 1
            entry["rounds"].append(res)
            s = sorted(res["samples_ms"])
            log(f"  sse {key:11s} round {rnd + 1}: {res['status']:8s} {len(s):4d} events  p50 "
                      f"{report.fmt(_pct(s, 50), 3)} ms  max {report.fmt(s[-1] if s else None, 3)} ms"
                      + (f"  ({res['error']})" if res.get("error") else "")
                      + (f"  origin saw {res.get('origin_protocol')}, authorization {res.get('origin_auth')}"
                         if rnd == 0 else ""))
            await asyncio.sleep(0.1)
        # a configuration whose first event never arrived will not stream in the next round either
        active = [k for k in active if result["latency"][k]["rounds"][-1]["status"] != "buffered"]


async def memory_figure(c: Context, proxy, kind: str, count: int) -> dict:
    warmup_error = None
    try:
        await burst(c, kind, "http/1.1", c.proxy)  # the warm-up request (completes even when buffered)
    except Exception as exc:  # noqa: BLE001 - the request was made; what went wrong is reported
        warmup_error = f"{type(exc).__name__}: {str(exc)[:200]}"
    await asyncio.sleep(1.0)
    idle = memory(proxy.pids())
    res = await open_streams(c, kind, count, IDLE_SOURCES.split(","), lambda: memory(proxy.pids()))
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
