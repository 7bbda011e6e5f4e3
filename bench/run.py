#!/usr/bin/env python3
"""Egress gateway benchmark: the gateway against bare mitmdump, on loopback, in one run.

    /tmp/venv/bin/python bench/run.py            # full run (~6-8 minutes)
    /tmp/venv/bin/python bench/run.py --quick    # smoke run (~2 minutes)

What runs (all on this machine, traffic only to 127.0.0.0/8):
- origin: nginx on ORIGIN_IP:443 (default 127.0.0.50) with a TestPKI certificate for origin.bench,
  serving a small static body and a large file;
- (a) baseline: `mitmdump` with no addon script, lazy connections, flow_detail=0, quiet, trusting the
  origin's CA; (a') the same with stream_large_bodies=1m, used for the bulk figure only, because the
  gateway streams large bodies and the bare baseline buffers them;
- (b) the gateway, `python -m gateway run`, with a policy allowing origin.bench (static_hosts to the
  origin's loopback address, allow_ip_ranges [127.0.0.0/8]).
The proxies resolve origin.bench through a private /etc/hosts, bind-mounted in a mount namespace
that only they see (`unshare --mount`): the gateway does not need it (static_hosts) but bare mitmdump
does, and both run the same way.

Rounds are interleaved (A B, then B A, ...), each figure is the median over rounds, and the ratio is
gateway/baseline. See bench/README.md for how to read the results.

This is not a test: pytest does not collect it (no test_*.py name, outside testpaths).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

ORIGIN_NAME = "origin.bench"
DENIED_NAME = "denied.bench"
SMALL_PATH = "/small.txt"
BIG_PATH = "/big.bin"
SMALL_BODY = b"hello from origin.bench: a small static body for keep-alive and new-connection rounds.\n" * 2
THROUGHPUT_TARGET = 0.95
POLICY_SCALING_TARGET = 1.5
RSS_GROWTH_TARGET_FRACTION = 0.10  # the streaming gateway's RSS may grow by at most 10% of the body
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# processes


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"process exited with {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"nothing listening on {host}:{port} after {timeout}s")


def port_in_use(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Service:
    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    stop_signal: int = signal.SIGTERM
    proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, cwd=self.cwd)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def python_pid(pid: int) -> int:
    """The proxy's Python process: the wrappers (taskset, unshare, sh) exec, so usually `pid` itself."""
    def cmdline(p: int) -> str:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    if "python" in cmdline(pid) or "mitmdump" in cmdline(pid):
        return pid
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and ("python" in cmdline(int(entry.name)) or "mitmdump" in cmdline(int(entry.name))):
                return int(entry.name)
    return pid


# --------------------------------------------------------------------------------------------
# environment set-up


@dataclass
class Setup:
    workdir: Path
    origin_ip: str
    pin: bool
    wrap_hosts: list[str]
    ca_cert: Path = Path()
    nginx: Service | None = None
    proxies: dict[str, "Proxy"] = field(default_factory=dict)

    nice: int = 0

    def cpu(self, which: int) -> list[str]:
        """Command prefix: the CPU to pin to (and the nice value) for a process of the benchmark."""
        prefix = ["nice", "-n", str(self.nice)] if self.nice else []
        return prefix + (["taskset", "-c", str(which)] if self.pin else [])


@dataclass
class Proxy:
    key: str  # baseline | baseline_stream | gateway
    label: str
    service: Service
    host: str
    port: int
    confdir: Path
    pid: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ca(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"


def check_tools(need_unshare: bool) -> dict[str, str]:
    found = {}
    for tool in ("nginx", "hey", "curl") + (("unshare",) if need_unshare else ()):
        path = shutil.which(tool) or (f"/usr/sbin/{tool}" if Path(f"/usr/sbin/{tool}").exists() else None)
        if not path:
            hint = " (apt-get update && apt-get install -y nginx hey)" if tool in ("nginx", "hey") else ""
            raise BenchError(f"{tool} not found{hint}")
        found[tool] = path
    mitmdump = Path(sys.executable).parent / "mitmdump"
    found["mitmdump"] = str(mitmdump) if mitmdump.exists() else (shutil.which("mitmdump") or "")
    if not found["mitmdump"]:
        raise BenchError("mitmdump not found next to this Python nor on PATH")
    return found


def hosts_wrapper(workdir: Path, origin_ip: str) -> list[str]:
    """A command prefix under which origin.bench resolves to the origin (for bare mitmdump)."""
    try:
        current = socket.gethostbyname(ORIGIN_NAME)
    except OSError:
        current = None
    if current == origin_ip:
        return []
    hosts = workdir / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{origin_ip} {ORIGIN_NAME}\n")
    prefix = ["unshare", "--mount", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    probe = subprocess.run(prefix + ["getent", "hosts", ORIGIN_NAME], capture_output=True, text=True)
    if probe.returncode != 0 or origin_ip not in probe.stdout:
        raise BenchError(
            f"cannot make {ORIGIN_NAME} resolve for the baseline proxy: `unshare --mount` failed "
            f"({probe.stderr.strip() or probe.returncode}); run as root, or add '{origin_ip} {ORIGIN_NAME}' to /etc/hosts"
        )
    return prefix


def make_origin(setup: Setup, bulk_bytes: int, tools: dict[str, str]) -> None:
    from tests.support.pki import TestPKI  # the project's throw-away CA

    pki = TestPKI(setup.workdir / "pki")
    cert, key = pki.issue([ORIGIN_NAME], stem="origin")
    setup.ca_cert = pki.ca_cert
    www = setup.workdir / "www"
    www.mkdir()
    (www / SMALL_PATH.lstrip("/")).write_bytes(SMALL_BODY)
    with open(www / BIG_PATH.lstrip("/"), "wb") as f:  # sparse file: zeros, no disk writes
        f.truncate(bulk_bytes)
    tmp = setup.workdir / "nginx-tmp"
    tmp.mkdir()
    conf = setup.workdir / "nginx.conf"
    conf.write_text(f"""
user root;
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {setup.workdir}/nginx.pid;
error_log {setup.workdir}/nginx-error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    open_file_cache max=100 inactive=300s;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ text/plain txt; application/octet-stream bin; }}
    default_type application/octet-stream;
    server {{
        listen {setup.origin_ip}:443 ssl backlog=4096;
        server_name {ORIGIN_NAME};
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_session_cache shared:SSL:10m;
        root {www};
        location / {{ try_files $uri =404; }}
    }}
}}
""")
    if port_in_use(setup.origin_ip, 443):
        raise BenchError(f"{setup.origin_ip}:443 is already in use: pick another --origin-ip in 127.0.0.0/8")
    nginx = Service("nginx", setup.cpu(1) + [tools["nginx"], "-p", str(setup.workdir), "-e",
                                            str(setup.workdir / "nginx-error.log"), "-c", str(conf)],
                    setup.workdir / "nginx.out", stop_signal=signal.SIGTERM)
    setup.nginx = nginx.start()
    wait_for_port(setup.origin_ip, 443, nginx.proc)
    # direct sanity check, without any proxy
    out = subprocess.run(["curl", "-sS", "--fail", "--max-time", "10", "--cacert", str(setup.ca_cert), "--resolve",
                          f"{ORIGIN_NAME}:443:{setup.origin_ip}", f"https://{ORIGIN_NAME}{SMALL_PATH}"],
                         capture_output=True)
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"origin sanity check failed: {out.stderr.decode(errors='replace')}\n{nginx.tail()}")


def gateway_policy_text(origin_ip: str) -> str:
    return f"""version: 1
network:
  deny_ip_ranges: default
  allow_ip_ranges: [127.0.0.0/8]
resolver:
  static_hosts:
    {ORIGIN_NAME}: [{origin_ip}]
rules:
  - id: bench-origin
    hosts: [{ORIGIN_NAME}]
    methods: [GET, HEAD]
"""


def start_proxy(setup: Setup, key: str, tools: dict[str, str], gateway_audit: bool) -> Proxy:
    port = free_port()
    confdir = setup.workdir / f"confdir-{key}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if key == "gateway":
        policy = setup.workdir / "gateway-policy.yaml"
        policy.write_text(gateway_policy_text(setup.origin_ip))
        cmd = [sys.executable, "-m", "gateway", "run", "-q", "--policy", str(policy),
               "--mode", f"regular@127.0.0.1:{port}", "--confdir", str(confdir),
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if gateway_audit:
            cmd += ["--audit-log", str(setup.workdir / "gateway-audit.jsonl")]
        env["PYTHONPATH"] = str(PROJECT_ROOT)
        label = "gateway (b)"
    else:
        cmd = [tools["mitmdump"], "-q", "--mode", f"regular@127.0.0.1:{port}",
               "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy", "--set", "flow_detail=0",
               "--set", "termlog_verbosity=warn",
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if key == "baseline_stream":
            cmd += ["--set", "stream_large_bodies=1m"]
            label = "mitmdump+stream (a')"
        else:
            label = "mitmdump (a)"
    service = Service(key, setup.cpu(0) + setup.wrap_hosts + cmd, setup.workdir / f"{key}.log", env=env,
                      cwd=PROJECT_ROOT)
    service.start()
    proxy = Proxy(key, label, service, "127.0.0.1", port, confdir)
    try:
        wait_for_port(proxy.host, port, service.proc)
        deadline = time.monotonic() + 15
        while not proxy.ca.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy.pid = python_pid(service.pid)
        sanity_check(setup, proxy)
    except Exception as exc:
        service.stop()
        raise BenchError(f"{key} did not start: {exc}\n{service.tail()}") from None
    return proxy


def sanity_check(setup: Setup, proxy: Proxy) -> None:
    """A real request through the proxy, with the proxy's CA verified; the gateway must also refuse."""
    out = subprocess.run(["curl", "-sS", "--fail", "--max-time", "15", "-x", proxy.url, "--cacert", str(proxy.ca),
                          f"https://{ORIGIN_NAME}{SMALL_PATH}"], capture_output=True)
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"request through {proxy.key} failed: {out.stderr.decode(errors='replace')}")
    if proxy.key == "gateway":
        out = subprocess.run(["curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_connect}",
                              "-x", proxy.url, "--cacert", str(proxy.ca), f"https://{DENIED_NAME}/"],
                             capture_output=True, text=True)
        if out.stdout.strip() != "403":
            raise BenchError(f"the gateway did not refuse {DENIED_NAME} (CONNECT answered {out.stdout.strip()!r})")


# --------------------------------------------------------------------------------------------
# measurements

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


def run_hey(setup: Setup, proxy: Proxy, duration: float, concurrency: int, keepalive: bool) -> dict:
    cmd = setup.cpu(1) + ["hey", "-z", f"{duration:g}s", "-c", str(concurrency), "-t", "20", "-x", proxy.url]
    if setup.pin:
        cmd += ["-cpus", "1"]
    if not keepalive:
        cmd += ["-disable-keepalive"]
    cmd.append(f"https://{ORIGIN_NAME}{SMALL_PATH}")
    # hey skips certificate verification (InsecureSkipVerify); SSL_CERT_FILE is set anyway so that a
    # build that verifies would trust the proxy's CA (Go reads it on Linux).
    env = dict(os.environ, SSL_CERT_FILE=str(proxy.ca))
    cpu0 = cpu_seconds(proxy.pid)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration + 90)
    cpu1 = cpu_seconds(proxy.pid)
    if out.returncode != 0:
        raise BenchError(f"hey failed ({out.returncode}): {out.stderr[-2000:]}")
    result = parse_hey(out.stdout)
    attempts = result["ok"] + result["non_200"] + result["errors"]
    result["failure_fraction"] = (result["non_200"] + result["errors"]) / attempts if attempts else 1.0
    if cpu0 is not None and cpu1 is not None and result["ok"]:
        result["proxy_cpu_s"] = cpu1 - cpu0
        result["cpu_us_per_req"] = (cpu1 - cpu0) / result["ok"] * 1e6
    if result["rps"] is None:
        raise BenchError(f"could not parse hey output:\n{out.stdout[-2000:]}")
    return result


def run_bulk(setup: Setup, proxy: Proxy, bulk_bytes: int) -> dict:
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            value = rss_kib(proxy.pid)
            if value is not None:
                samples.append(value)
            stop.wait(0.05)

    before = [v for v in (rss_kib(proxy.pid) for _ in range(3)) if v is not None]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = cpu_seconds(proxy.pid)
    cmd = setup.cpu(1) + ["curl", "-sS", "--fail", "--max-time", "180", "-x", proxy.url, "--cacert", str(proxy.ca),
                          "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{time_total}",
                          f"https://{ORIGIN_NAME}{BIG_PATH}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    finally:
        stop.set()
        sampler.join()
    cpu1 = cpu_seconds(proxy.pid)
    time.sleep(0.5)
    after = rss_kib(proxy.pid)
    if out.returncode != 0:
        raise BenchError(f"bulk download through {proxy.key} failed: {out.stderr.strip()}")
    code, size, seconds = out.stdout.split()
    size_i, seconds_f = int(size), float(seconds)
    if code != "200" or size_i != bulk_bytes:
        raise BenchError(f"bulk download through {proxy.key}: status {code}, {size_i} of {bulk_bytes} bytes")
    rss_before = before[-1] if before else 0
    peak = max(samples + before) if samples or before else 0
    return {
        "mb_per_s": size_i / seconds_f / 1e6,
        "seconds": seconds_f,
        "rss_before_mib": rss_before / 1024,
        "rss_peak_mib": peak / 1024,
        "rss_growth_mib": (peak - rss_before) / 1024,
        "rss_after_mib": (after or 0) / 1024,
        "rss_samples": len(samples),
        "cpu_ms_per_mb": (cpu1 - cpu0) * 1000 / (size_i / 1e6) if cpu0 is not None and cpu1 is not None else None,
    }


# --------------------------------------------------------------------------------------------
# policy decision cost


def policy_yaml(rule_count: int, origin_ip: str) -> str:
    """A policy with `rule_count` rules, one host each; the bench origin's rule comes last."""
    lines = [
        "version: 1",
        "network:",
        "  deny_ip_ranges: default",
        "  allow_ip_ranges: [127.0.0.0/8]",
        "resolver:",
        "  static_hosts:",
        f"    {ORIGIN_NAME}: [{origin_ip}]",
        "rules:",
    ]
    for i in range(rule_count - 1):
        # nine exact names for one wildcard; the wildcards share suffixes with nothing we look up
        host = f'"*.svc{i}.example.net"' if i % 10 == 0 else f"host{i}.zone{i % 97}.example.com"
        lines.append(f"  - id: r{i}\n    hosts:\n      - {host}")
    lines.append(f"  - id: bench-origin\n    hosts: [{ORIGIN_NAME}]\n    methods: [GET, HEAD]")
    return "\n".join(lines) + "\n"


def bench_policy(rule_counts: list[int], number: int, repeats: int, origin_ip: str, deadline: float) -> dict:
    from gateway.engine import Engine, RequestFacts
    from gateway.hostnames import canonical_host
    from gateway.policy import compile_policy

    engines = {}
    compile_s = {}
    for n in rule_counts:
        text = policy_yaml(n, origin_ip)
        t0 = time.perf_counter()
        policy = compile_policy(text, f"<bench {n} rules>")
        compile_s[n] = time.perf_counter() - t0
        if len(policy.rules) != n:
            raise BenchError(f"policy with {n} rules compiled to {len(policy.rules)}")
        engines[n] = Engine.build(policy)
        log(f"policy with {n} rules: compiled in {compile_s[n]:.2f}s")

    cases = {
        "match": RequestFacts(host=canonical_host(ORIGIN_NAME), port=443, scheme="https", method="GET",
                              target=SMALL_PATH),
        "no_match": RequestFacts(host=canonical_host("nomatch.example.org"), port=443, scheme="https", method="GET",
                                 target=SMALL_PATH),
    }
    for n, engine in engines.items():
        if not engine.check_request(cases["match"]).allowed or engine.check_request(cases["no_match"]).allowed:
            raise BenchError(f"policy with {n} rules decided wrongly")

    samples: dict[str, dict[int, list[float]]] = {c: {n: [] for n in rule_counts} for c in cases}
    for r in range(repeats):
        if time.monotonic() > deadline and r >= 1:
            log("time limit reached: fewer policy repeats")
            break
        order = rule_counts if r % 2 == 0 else list(reversed(rule_counts))
        for case, facts in cases.items():
            for n in order:
                timer = timeit.Timer(lambda e=engines[n], f=facts: e.check_request(f))
                samples[case][n].append(timer.timeit(number) / number * 1e9)
    small, large = min(rule_counts), max(rule_counts)
    result: dict = {"rule_counts": rule_counts, "number": number, "compile_s": compile_s, "cases": {}}
    for case in cases:
        med = {n: statistics.median(samples[case][n]) for n in rule_counts}
        result["cases"][case] = {
            "ns_median": med,
            "ns_min": {n: min(samples[case][n]) for n in rule_counts},
            "ns_samples": samples[case],
            "ratio_large_small": med[large] / med[small],
        }
    return result


# --------------------------------------------------------------------------------------------
# report


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 10000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def summarise(raw: dict) -> dict:
    """Medians per proxy and figure, ratios of medians, and the range of per-round paired ratios."""
    summary: dict = {}
    for figure, per_round in raw.items():
        proxies = sorted({p for rnd in per_round for p in rnd})
        metrics = sorted({m for rnd in per_round for res in rnd.values() for m in res
                          if isinstance(res[m], (int, float)) or res[m] is None})
        fig: dict = {}
        for metric in metrics:
            entry: dict = {}
            for p in proxies:
                entry[p] = median([rnd[p].get(metric) for rnd in per_round if p in rnd])
            paired = [rnd["gateway"][metric] / rnd["baseline"][metric] for rnd in per_round
                      if rnd.get("gateway", {}).get(metric) is not None and rnd.get("baseline", {}).get(metric)]
            entry["paired_ratio_min"] = min(paired) if paired else None
            entry["paired_ratio_max"] = max(paired) if paired else None
            entry["paired_ratio_median"] = median(paired)
            fig[metric] = entry
        summary[figure] = fig
    return summary


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_markdown(meta: dict, summary: dict, raw: dict, policy: dict | None) -> str:
    L: list[str] = []
    L.append(f"# Egress gateway benchmark — {meta['started']}")
    L.append("")
    L.append(f"Mode: **{meta['mode']}** — {meta['rounds_done']} interleaved rounds, hey -c {meta['concurrency']}, "
             f"{meta['duration']:g} s per run, bulk body {meta['bulk_mb']} MB, CPU pinning: "
             f"{'proxy on CPU 0, nginx/hey/curl on CPU 1' if meta['pinned'] else 'off'}"
             f"{'; nice ' + str(meta['nice']) if meta.get('nice') else ''}"
             f"{'; gateway with --audit-log' if meta.get('gateway_audit_log') else ''}.")
    L.append(f"Commit {meta['commit']}{' (+ uncommitted changes)' if meta['dirty'] else ''}; mitmproxy {meta['mitmproxy']}; "
             f"{meta['nginx']}; Python {meta['python']}; {meta['cpus']} CPUs; load average at start {meta['loadavg_start']}.")
    L.append("")
    L.append("Medians over rounds. b/a = gateway (b) / baseline (a), ratio of the medians (the target is checked on "
             "it); 'paired' = median and range of the per-round ratios (each round runs a and b back to back, order "
             "alternating). Throughput: higher is better; latency, CPU and memory: lower is better. p99 is n/a when "
             "a run has fewer than 100 requests.")
    L.append("")
    L.append("| figure | mitmdump (a) | gateway (b) | b/a | paired b/a: median (min–max) | target | met |")
    L.append("|---|---:|---:|---:|---:|---|---|")

    def row(name: str, figure: str, metric: str, target: str = "", check=None, digits: int = 1) -> None:
        entry = summary.get(figure, {}).get(metric)
        if not entry:
            return
        a, b = entry.get("baseline"), entry.get("gateway")
        r = ratio(b, a)
        paired = (f"{fmt(entry['paired_ratio_median'], 2)} ({fmt(entry['paired_ratio_min'], 2)}–"
                  f"{fmt(entry['paired_ratio_max'], 2)})" if entry.get("paired_ratio_min") is not None else "")
        met = "" if check is None or r is None else ("yes" if check(r) else "**NO**")
        L.append(f"| {name} | {fmt(a, digits)} | {fmt(b, digits)} | {fmt(r, 2)} | {paired} | {target} | {met} |")

    tp = f"b/a ≥ {THROUGHPUT_TARGET}"
    ok = lambda r: r >= THROUGHPUT_TARGET  # noqa: E731
    row("(1) keep-alive HTTPS req/s", "keepalive", "rps", tp, ok)
    row("(1) keep-alive p50 latency, ms", "keepalive", "p50_ms")
    row("(1) keep-alive p99 latency, ms", "keepalive", "p99_ms")
    row("(1) proxy CPU per request, µs", "keepalive", "cpu_us_per_req", digits=0)
    row("(2) new TLS connections/s", "newconn", "rps", tp, ok)
    row("(2) new-connection p50 latency, ms", "newconn", "p50_ms")
    row("(2) new-connection p99 latency, ms", "newconn", "p99_ms")
    row("(2) proxy CPU per connection, µs", "newconn", "cpu_us_per_req", digits=0)
    row(f"(3) bulk {meta['bulk_mb']} MB download, MB/s", "bulk", "mb_per_s", tp, ok)
    row("(3) proxy CPU per MB, ms", "bulk", "cpu_ms_per_mb")
    row("(3) proxy RSS before download, MiB", "bulk", "rss_before_mib")
    row("(3) proxy RSS peak during download, MiB", "bulk", "rss_peak_mib")
    row("(3) RSS growth (peak − before), MiB", "bulk", "rss_growth_mib")
    L.append("")

    bulk = summary.get("bulk", {})
    if bulk.get("mb_per_s", {}).get("baseline_stream") is not None:
        s = bulk["mb_per_s"]["baseline_stream"]
        g = bulk["mb_per_s"].get("gateway")
        growth_s = bulk.get("rss_growth_mib", {}).get("baseline_stream")
        r = ratio(g, s)
        paired = [rnd["gateway"]["mb_per_s"] / rnd["baseline_stream"]["mb_per_s"] for rnd in raw.get("bulk", [])
                  if "gateway" in rnd and "baseline_stream" in rnd]
        L.append(f"Like-for-like bulk: mitmdump with `stream_large_bodies=1m` (a') — the gateway forces that option, "
                 f"bare mitmdump buffers whole bodies — did {fmt(s)} MB/s (RSS growth {fmt(growth_s)} MiB); "
                 f"gateway/(a') = {fmt(r, 2)}{'' if r is None else (' (≥ 0.95)' if r >= THROUGHPUT_TARGET else ' (**< 0.95**)')}"
                 f"{f', paired median {fmt(median(paired), 2)}' if paired else ''}; proxy CPU per MB gateway/(a') = "
                 f"{fmt(ratio(bulk.get('cpu_ms_per_mb', {}).get('gateway'), bulk.get('cpu_ms_per_mb', {}).get('baseline_stream')), 2)}.")
        L.append("")
    growth = bulk.get("rss_growth_mib", {}).get("gateway")
    if growth is not None:
        limit = meta["bulk_mb"] * 1e6 / 2**20 * RSS_GROWTH_TARGET_FRACTION
        L.append(f"Gateway memory during the bulk download: peak − before = {fmt(growth)} MiB "
                 f"(target ≤ {limit:.0f} MiB, 10% of the body): **{'flat' if growth <= limit else 'NOT flat'}**.")
        L.append("")

    if policy:
        small, large = min(policy["rule_counts"]), max(policy["rule_counts"])
        L.append(f"(4) One policy decision, `Engine.check_request`, ns/decision (median of "
                 f"{len(next(iter(policy['cases'].values()))['ns_samples'][small])} timeit repeats × {policy['number']:,}):")
        L.append("")
        L.append(f"| host | {small} rules | {large:,} rules | {large:,}/{small} | target | met |")
        L.append("|---|---:|---:|---:|---|---|")
        for case, label in (("match", f"matches ({ORIGIN_NAME})"), ("no_match", "matches nothing")):
            c = policy["cases"][case]
            r = c["ratio_large_small"]
            L.append(f"| {label} | {fmt(c['ns_median'][small], 0)} | {fmt(c['ns_median'][large], 0)} | {r:.2f} | "
                     f"≤ {POLICY_SCALING_TARGET} | {'yes' if r <= POLICY_SCALING_TARGET else '**NO**'} |")
        L.append("")
        L.append(f"Compiling the policies (`compile_policy` on generated YAML): {small} rules "
                 f"{policy['compile_s'][small]:.2f} s, {large:,} rules {policy['compile_s'][large]:.1f} s.")
        L.append("")

    spreads = []
    for figure, metric, name in (("keepalive", "rps", "keep-alive req/s"), ("newconn", "rps", "new connections/s"),
                                 ("bulk", "mb_per_s", "bulk MB/s")):
        values = [rnd["baseline"][metric] for rnd in raw.get(figure, []) if rnd.get("baseline", {}).get(metric)]
        if len(values) >= 2:
            spreads.append(f"{name} {fmt(min(values))}–{fmt(max(values))} "
                           f"(±{(max(values) - min(values)) / 2 / statistics.median(values):.0%} of the median)")
    if spreads:
        L.append("Noise: the baseline alone varied across rounds by " + "; ".join(spreads) + ". A b/a ratio closer "
                 "to 1 than that spread is within the noise of this machine.")
        L.append("")

    if meta.get("warnings"):
        L.append("Warnings:")
        L.extend(f"- {w}" for w in meta["warnings"])
        L.append("")

    if not raw:
        return "\n".join(L) + "\n"
    L.append("<details><summary>Per-round values</summary>")
    L.append("")
    for figure, metric, unit in (("keepalive", "rps", "req/s"), ("newconn", "rps", "conn/s"),
                                 ("bulk", "mb_per_s", "MB/s"), ("bulk", "rss_peak_mib", "MiB peak RSS")):
        if figure not in raw:
            continue
        parts = []
        for i, rnd in enumerate(raw[figure]):
            parts.append(f"r{i + 1}: " + ", ".join(f"{k}={fmt(v.get(metric))}" for k, v in rnd.items()))
        L.append(f"- {figure} {unit}: " + "; ".join(parts))
    L.append("")
    L.append("</details>")
    return "\n".join(L) + "\n"


def git_info() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except OSError:
        return "unknown", False


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short run: 3 rounds of 3 s, 20,000-rule policy instead of 100,000 (~2 min)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 3)")
    p.add_argument("--duration", type=float, help="seconds per hey run (default 10, quick 3)")
    p.add_argument("--concurrency", type=int, default=32, help="hey -c")
    p.add_argument("--bulk-mb", type=int, default=200, help="size of the bulk body, MB (10^6 bytes)")
    p.add_argument("--rules", type=int, help="size of the large policy (default 100000, quick 20000)")
    p.add_argument("--policy-number", type=int, help="check_request calls per timeit repeat (default 20000)")
    p.add_argument("--policy-repeats", type=int, help="timeit repeats per case (default 9, quick 5)")
    p.add_argument("--origin-ip", default="127.0.0.50", help="loopback address for the nginx origin (port 443)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs with taskset")
    p.add_argument("--nice", type=int, default=0,
                   help="run the benchmark's processes at this nice value (e.g. -10, as root) so that other "
                        "work on a shared machine disturbs them less")
    p.add_argument("--no-stream-baseline", action="store_true",
                   help="skip (a'), mitmdump with stream_large_bodies=1m, in the bulk figure")
    p.add_argument("--gateway-audit-log", action="store_true", help="run the gateway with --audit-log to a file")
    p.add_argument("--skip-proxy", action="store_true", help="only the policy decision figure (4)")
    p.add_argument("--skip-policy", action="store_true", help="skip the policy decision figure (4)")
    p.add_argument("--max-minutes", type=float, help="stop starting new rounds after this many minutes (default 9, quick 3.5)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temporary directory (logs, configs)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="where to write latest.md / latest.json")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {"rounds": (3, 5), "duration": (3.0, 10.0), "rules": (20000, 100000), "policy_number": (20000, 20000),
                "policy_repeats": (5, 9), "max_minutes": (3.5, 9.0)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.rounds < 1 or args.duration <= 0 or args.rules < 11 or args.policy_repeats < 1:
        p.error("--rounds, --duration and --policy-repeats must be positive and --rules above 10")
    if not args.origin_ip.startswith("127."):
        p.error("--origin-ip must be in 127.0.0.0/8: this benchmark sends traffic to loopback only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    import mitmproxy.version

    commit, dirty = git_info()
    meta: dict = {
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "rounds": args.rounds, "rounds_done": 0, "duration": args.duration, "concurrency": args.concurrency,
        "bulk_mb": args.bulk_mb, "commit": commit, "dirty": dirty, "mitmproxy": mitmproxy.version.VERSION,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()), "warnings": [],
        "gateway_audit_log": args.gateway_audit_log, "nice": args.nice,
    }
    raw: dict[str, list[dict]] = {}
    policy_result = None

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="egress-bench-"))
    setup: Setup | None = None
    failed = False
    try:
        if not args.skip_proxy:
            pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
            tools = check_tools(need_unshare=True)
            meta["nginx"] = subprocess.run([tools["nginx"], "-v"], capture_output=True, text=True).stderr.strip()
            setup = Setup(workdir, args.origin_ip, pin, hosts_wrapper(workdir, args.origin_ip), nice=args.nice)
            meta["pinned"] = pin
            bulk_bytes = args.bulk_mb * 1_000_000
            log(f"work directory {workdir}; origin https://{ORIGIN_NAME} on {args.origin_ip}:443 (nginx)")
            make_origin(setup, bulk_bytes, tools)
            keys = ["baseline", "gateway"] + ([] if args.no_stream_baseline else ["baseline_stream"])
            for key in keys:
                setup.proxies[key] = start_proxy(setup, key, tools, args.gateway_audit_log)
                log(f"{key}: {setup.proxies[key].url} (pid {setup.proxies[key].pid})")
            base, gw = setup.proxies["baseline"], setup.proxies["gateway"]

            log("warm-up (not counted)")
            for proxy in (base, gw):
                run_hey(setup, proxy, min(2.0, args.duration), args.concurrency, True)
                run_hey(setup, proxy, min(2.0, args.duration), args.concurrency, False)

            for rnd in range(args.rounds):
                if time.monotonic() > deadline:
                    meta["warnings"].append(f"time limit reached: stopped after {rnd} rounds")
                    break
                pair = [base, gw] if rnd % 2 == 0 else [gw, base]
                log(f"round {rnd + 1}/{args.rounds}: order {' → '.join(p.key for p in pair)}")
                for figure, keepalive in (("keepalive", True), ("newconn", False)):
                    results = {}
                    for proxy in pair:
                        res = run_hey(setup, proxy, args.duration, args.concurrency, keepalive)
                        if res["failure_fraction"] > 0.001:
                            meta["warnings"].append(
                                f"round {rnd + 1} {figure} {proxy.key}: {res['non_200']} non-200 and "
                                f"{res['errors']} errors ({res['failure_fraction']:.2%})")
                        results[proxy.key] = res
                        log(f"  {figure:9s} {proxy.key:15s} {res['rps']:8.1f}/s  p50 {fmt(res['p50_ms'])} ms  "
                            f"p99 {fmt(res['p99_ms'])} ms  cpu {fmt(res.get('cpu_us_per_req'), 0)} µs/req")
                        time.sleep(0.5)
                    raw.setdefault(figure, []).append(results)
                order = [setup.proxies[k] for k in keys]
                shift = rnd % len(order)
                order = order[shift:] + order[:shift]
                if rnd % 2:
                    order.reverse()
                results = {}
                for proxy in order:
                    res = run_bulk(setup, proxy, bulk_bytes)
                    results[proxy.key] = res
                    log(f"  bulk      {proxy.key:15s} {res['mb_per_s']:8.1f} MB/s  RSS {res['rss_before_mib']:.0f} → "
                        f"peak {res['rss_peak_mib']:.0f} MiB (after {res['rss_after_mib']:.0f})")
                    time.sleep(0.5)
                raw.setdefault("bulk", []).append(results)
                meta["rounds_done"] = rnd + 1
            for proxy in setup.proxies.values():
                if proxy.service.proc.poll() is not None:
                    meta["warnings"].append(f"{proxy.key} exited during the run ({proxy.service.proc.returncode})")
                problems = [ln for ln in proxy.service.tail(200).splitlines()
                            if re.search(r"error|exception|traceback", ln, re.I)]
                if problems:
                    meta["warnings"].append(f"{proxy.key} logged {len(problems)} error lines, e.g. {problems[-1][:200]!r}")
        else:
            meta["nginx"] = "n/a"
            meta["pinned"] = False
    except KeyboardInterrupt:
        meta["warnings"].append("interrupted")
        failed = True
    except BenchError as exc:
        log(f"ERROR: {exc}")
        meta["warnings"].append(f"error: {exc}".splitlines()[0])
        failed = True
    finally:
        if setup is not None:
            for proxy in setup.proxies.values():
                proxy.service.stop()
            if setup.nginx is not None:
                setup.nginx.stop()

    if not args.skip_policy and not failed:
        try:
            # the proxies are stopped: the policy timing has the machine to itself
            if args.nice:
                os.nice(args.nice)
            log(f"policy decision cost: 10 and {args.rules:,} rules")
            policy_result = bench_policy([10, args.rules], args.policy_number, args.policy_repeats, args.origin_ip,
                                         deadline)
        except KeyboardInterrupt:
            meta["warnings"].append("interrupted during the policy figure")
            failed = True

    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    args.results.mkdir(parents=True, exist_ok=True)
    try:
        summary = summarise(raw)
        markdown = build_markdown(meta, summary, raw, policy_result)
    except Exception:
        dump = args.results / "crashed-raw.json"
        dump.write_text(json.dumps({"meta": meta, "raw": raw, "policy": policy_result}, indent=2, default=str))
        log(f"report failed; raw figures saved to {dump}")
        raise
    markdown += f"\nTotal time {meta['elapsed_s']:.0f} s; load average at end {meta['loadavg_end']}.\n"
    print(markdown)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    document = {"meta": meta, "summary": summary, "raw": raw, "policy": policy_result}
    for name in ("latest", stamp):
        (args.results / f"{name}.md").write_text(markdown)
        (args.results / f"{name}.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    log(f"results: {args.results / 'latest.md'} and latest.json (also {stamp}.*)")
    if args.keep_workdir or failed:
        log(f"work directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
