"""hey runs: throughput (what hey prints) and latency at a set rate (every request, -o csv), with the
CPU used meanwhile by the proxy, by hey and by nginx."""

from __future__ import annotations

import re
import resource
import subprocess
import time

from lib.log import BenchError
from lib.names import ORIGIN_NAME, SMALL_PATH
from lib.processes import clean_env
from lib.procfs import cpu_by_pid, cpu_delta, process_tree
from lib.proxies import client_prefix, client_proxy_args
from lib.session import Proxy, Setup

_HEY_FLOAT = r"([0-9.]+)"


def parse_hey(text: str) -> dict:
    def grab(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None

    statuses = {int(code): int(n) for code, n in re.findall(r"^\s*\[(\d{3})\]\s+(\d+) responses", text, re.M)}
    err_section = text.split("Error distribution:", 1)[1] if "Error distribution:" in text else ""
    errors = sum(int(n) for n in re.findall(r"^\s*\[(\d+)\]\s", err_section, re.M))
    total = grab(rf"Total:\s+{_HEY_FLOAT} secs")
    ok = statuses.get(200, 0)
    return {
        "total_s": total,
        "hey_rps": grab(rf"Requests/sec:\s+{_HEY_FLOAT}"),
        "ok": ok,
        "non_200": sum(n for c, n in statuses.items() if c != 200),
        "errors": errors,
        "rps": ok / total if total else None,  # 200s only: hey's own figure counts any status
        "p50_ms": (grab(rf"50% in {_HEY_FLOAT} secs") or 0) * 1000 or None,
        "p99_ms": (grab(rf"99% in {_HEY_FLOAT} secs") or 0) * 1000 or None,
    }


def parse_hey_csv(text: str) -> tuple[list[float], int]:
    """hey -o csv: one line per completed request (errors are not listed): latency in ms, and the
    number of non-200 answers."""
    samples, non_200 = [], 0
    for line in text.splitlines()[1:]:
        fields = line.split(",")
        if len(fields) < 7:
            continue
        try:
            seconds, status = float(fields[0]), int(fields[6])
        except ValueError:
            continue
        if status == 200:
            samples.append(seconds * 1000)
        else:
            non_200 += 1
    return samples, non_200


def run_hey(setup: Setup, proxy: Proxy, duration: float, concurrency: int, keepalive: bool,
            rate: float | None = None) -> dict:
    """One hey run against `proxy`. With `rate` (requests/s in total), a latency run: hey's rate limit
    (-q per worker) and every request's latency (-o csv). Also measures the CPU used meanwhile by the
    proxy (all its processes), by hey and by nginx."""
    cmd = setup.cpu(1) + client_prefix(setup, proxy) + ["hey", "-z", f"{duration:g}s", "-c", str(concurrency),
                                                        "-t", "20"]
    cmd += client_proxy_args(proxy)
    if setup.pin:
        cmd += ["-cpus", "1"]
    if not keepalive:
        cmd += ["-disable-keepalive"]
    if rate:
        cmd += ["-q", f"{rate / concurrency:g}", "-o", "csv"]
    cmd.append(f"https://{ORIGIN_NAME}{SMALL_PATH}")
    # hey skips certificate verification (InsecureSkipVerify); SSL_CERT_FILE is set anyway so that a
    # build that verifies would trust the CA the configuration presents (Go reads it on Linux).
    env = clean_env(SSL_CERT_FILE=str(proxy.client_ca))
    nginx = setup.nginx.get(proxy.nginx)
    nginx_pids = process_tree(nginx.pid) if nginx is not None else []
    proxy_pids = proxy.pids()
    p0, n0 = cpu_by_pid(proxy_pids), cpu_by_pid(nginx_pids)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration + 90)
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p1, n1 = cpu_by_pid(proxy.pids() if proxy.service else []), cpu_by_pid(nginx_pids)
    if out.returncode != 0:
        raise BenchError(f"hey failed ({out.returncode}): {out.stderr[-2000:]}")
    if rate:
        samples, non_200 = parse_hey_csv(out.stdout)
        result = {"ok": len(samples), "non_200": non_200, "errors": None, "rps": len(samples) / duration,
                  "samples_ms": [round(s, 2) for s in samples], "rate": rate, "concurrency": concurrency,
                  "expected": int(rate * duration)}
        # hey stops at -z: the last tick or two may not complete; more missing than that is reported
        short = max(0, result["expected"] - len(samples) - non_200 - max(2, result["expected"] // 50))
        result["missing"] = short
        result["failure_fraction"] = (short + non_200) / result["expected"] if result["expected"] else 0.0
    else:
        result = parse_hey(out.stdout)
        if result["rps"] is None:
            raise BenchError(f"could not parse hey output:\n{out.stdout[-2000:]}")
        attempts = result["ok"] + result["non_200"] + result["errors"]
        result["failure_fraction"] = (result["non_200"] + result["errors"]) / attempts if attempts else 1.0
    result["wall_s"] = wall
    result["hey_cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    result["nginx_cpu_s"] = cpu_delta(n0, n1)
    if proxy.service is not None:
        result["proxy_cpu_s"] = cpu_delta(p0, p1)
        result["cpu_by_pid"] = {str(p): round(c - p0.get(p, 0.0), 3) for p, c in p1.items()}
        if result["ok"]:
            result["cpu_us_per_req"] = result["proxy_cpu_s"] / result["ok"] * 1e6
    if result["ok"]:
        result["nginx_cpu_us_per_req"] = result["nginx_cpu_s"] / result["ok"] * 1e6
    # the load generator's side: hey and nginx, both on CPU 1 when pinned
    result["loadgen_cpu_fraction"] = (result["hey_cpu_s"] + result["nginx_cpu_s"]) / wall if wall else None
    return result
