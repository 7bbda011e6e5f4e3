#!/usr/bin/env python3
"""Egress gateway benchmark: the gateway against bare mitmdump, explicit and transparent mode, in one run.

    /tmp/venv/bin/python bench/run.py            # full run (~11-13 minutes)
    /tmp/venv/bin/python bench/run.py --quick    # smoke run (~3-4 minutes)
    /tmp/venv/bin/python bench/run.py --only transparent --quick

Explicit mode (all on this machine, traffic only to 127.0.0.0/8):
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

Transparent mode (traffic only inside network namespaces created by the run, none with a route off
the machine; checked before any traffic, removed at the end, also on error or interrupt):
- the closed topology of tests/transparent/topology.py: a gateway namespace and an "internet"
  namespace joined by a veth, and two sandbox namespaces built by docker/sandbox-net.sh (GATEWAY_NS
  set), each with TCP 80/443 REDIRECTed to one transparent listener in the gateway namespace;
- origin: a second nginx, in the internet namespace, on 93.184.216.34:443 (on its lo);
- (a) `mitmdump --mode transparent@0.0.0.0:PORT_A` and (b) `python -m gateway run --mode
  transparent@0.0.0.0:PORT_B` (policy: origin.bench -> 93.184.216.34 in static_hosts), both in the
  gateway namespace; sandbox 1 is redirected to (a), sandbox 2 to (b);
- hey runs inside the sandbox (`ip netns exec`), with no proxy settings, against https://origin.bench/,
  which the sandbox resolves through /etc/netns/SANDBOX/hosts.

Rounds are interleaved (A B, then B A, ...), each figure is the median over rounds, and the ratio is
gateway/baseline. `--only` picks figure groups: explicit, transparent, bulk, decision. See
bench/README.md for how to read the results.

This is not a test: pytest does not collect it (no test_*.py name, outside testpaths).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import secrets
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
GROUPS = ("explicit", "transparent", "bulk", "decision")
# transparent mode: addresses and ports inside the namespaces this run creates (nothing else is there)
TRANSPARENT_ORIGIN_IP = "93.184.216.34"  # on lo of the run's own "internet" namespace only
TRANSPARENT_PORTS = {"baseline": 18091, "gateway": 18092}  # listeners in the run's gateway namespace
TRANSPARENT_DNS_PORTS = {"baseline": 15391, "gateway": 15392}  # nothing listens: names come from hosts files
TRANSPARENT_SANDBOX_INDEX = {"baseline": 1, "gateway": 2}  # sandbox 10.203.K.2 -> gateway side 10.203.K.1


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


def wait_listening(proc: subprocess.Popen, pid: int, port: int, timeout: float = 30.0) -> None:
    """Wait until process `pid` (in whatever network namespace it runs) has a TCP socket listening on
    `port`: read from /proc/PID/net/tcp, which shows the sockets of that process's namespace. No probe
    connection, which a transparent listener would take for a redirected one."""
    needle = f":{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"process exited with {proc.returncode} before listening on port {port}")
        try:
            lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        except OSError:
            lines = []
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[1].endswith(needle) and fields[3] == "0A":  # 0A: LISTEN
                return
        time.sleep(0.1)
    raise BenchError(f"nothing listening on port {port} after {timeout}s")


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
    origin_cert: tuple[Path, Path] | None = None  # (certificate, key) for origin.bench
    www: Path = Path()
    nginx: dict[str, Service] = field(default_factory=dict)  # explicit | transparent
    proxies: dict[str, "Proxy"] = field(default_factory=dict)
    net: "TransparentNet | None" = None

    nice: int = 0

    def cpu(self, which: int) -> list[str]:
        """Command prefix: the CPU to pin to (and the nice value) for a process of the benchmark."""
        prefix = ["nice", "-n", str(self.nice)] if self.nice else []
        return prefix + (["taskset", "-c", str(which)] if self.pin else [])


@dataclass
class Proxy:
    key: str  # baseline | baseline_stream | gateway | baseline_transparent | gateway_transparent
    label: str
    service: Service
    host: str
    port: int
    confdir: Path
    pid: int = 0
    role: str = ""  # baseline | baseline_stream | gateway: the key its results are stored under
    sandbox_ns: str | None = None  # transparent: the sandbox namespace whose traffic is redirected to it

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


def make_origin_files(setup: Setup, bulk_bytes: int) -> None:
    """The throw-away CA, a certificate for origin.bench and the document root (shared by both origins)."""
    from tests.support.pki import TestPKI  # the project's throw-away CA

    pki = TestPKI(setup.workdir / "pki")
    setup.origin_cert = pki.issue([ORIGIN_NAME], stem="origin")
    setup.ca_cert = pki.ca_cert
    www = setup.www = setup.workdir / "www"
    www.mkdir()
    (www / SMALL_PATH.lstrip("/")).write_bytes(SMALL_BODY)
    with open(www / BIG_PATH.lstrip("/"), "wb") as f:  # sparse file: zeros, no disk writes
        f.truncate(bulk_bytes)


def start_nginx(setup: Setup, name: str, listen_ip: str, tools: dict[str, str], netns: str | None = None) -> Service:
    """nginx on listen_ip:443, in the host namespace or (transparent) in namespace `netns`."""
    assert setup.origin_cert is not None
    cert, key = setup.origin_cert
    tmp = setup.workdir / f"{name}-tmp"
    tmp.mkdir()
    conf = setup.workdir / f"{name}.conf"
    error_log = setup.workdir / f"{name}-error.log"
    conf.write_text(f"""
user root;
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {setup.workdir}/{name}.pid;
error_log {error_log} warn;
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
        listen {listen_ip}:443 ssl backlog=4096;
        server_name {ORIGIN_NAME};
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_session_cache shared:SSL:10m;
        root {setup.www};
        location / {{ try_files $uri =404; }}
    }}
}}
""")
    in_ns = ["ip", "netns", "exec", netns] if netns else []
    if not netns and port_in_use(listen_ip, 443):
        raise BenchError(f"{listen_ip}:443 is already in use: pick another --origin-ip in 127.0.0.0/8")
    nginx = Service(name, setup.cpu(1) + in_ns + [tools["nginx"], "-p", str(setup.workdir), "-e", str(error_log),
                                                 "-c", str(conf)],
                    setup.workdir / f"{name}.out", stop_signal=signal.SIGTERM)
    setup.nginx[name] = nginx.start()
    if netns:
        wait_listening(nginx.proc, nginx.pid, 443)
    else:
        wait_for_port(listen_ip, 443, nginx.proc)
    # direct sanity check, without any proxy (transparent: from the gateway namespace, over the veth)
    sanity_ns = ["ip", "netns", "exec", setup.net.topology.gw] if netns and setup.net else []
    out = subprocess.run(sanity_ns + ["curl", "-sS", "--fail", "--max-time", "10", "--cacert", str(setup.ca_cert),
                                      "--resolve", f"{ORIGIN_NAME}:443:{listen_ip}", f"https://{ORIGIN_NAME}{SMALL_PATH}"],
                         capture_output=True, env=clean_env())
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"origin sanity check ({name}) failed: {out.stderr.decode(errors='replace')}\n{nginx.tail()}")
    return nginx


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for clients: no proxy variables (explicit mode passes the proxy with -x)."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy"}}
    env.update(extra)
    return env


# --------------------------------------------------------------------------------------------
# transparent mode: the closed namespace topology of tests/transparent


@dataclass
class TransparentNet:
    """Gateway + internet namespaces (tests/transparent/topology.py's Topology, with names of its own:
    egb<tag>g, egb<tag>i) and one sandbox per proxy built by docker/sandbox-net.sh with GATEWAY_NS."""

    topology: object
    sandboxes: dict[str, object] = field(default_factory=dict)  # role -> Sandbox

    @classmethod
    def new(cls) -> "TransparentNet":
        """Names only; `build` creates the namespaces (keep the object first, so that a half-built
        network is still destroyed)."""
        from tests.transparent.topology import Topology

        topology = Topology(None)  # its PKI is only for the tests' upstreams: not used here
        # Names distinct from the tests' (egt...), so that a stray namespace is recognisably the benchmark's.
        topology.tag = f"{os.getpid() % 10000}{secrets.token_hex(2)}"
        topology.gw, topology.inet = f"egb{topology.tag}g", f"egb{topology.tag}i"
        topology.gw_if, topology.in_if = f"bg{topology.tag}", f"bi{topology.tag}"
        return cls(topology)

    def build(self) -> None:
        self.topology.create()  # checks that no namespace has a route off the machine
        self.topology.add_address(TRANSPARENT_ORIGIN_IP)  # on the internet namespace's lo, routed from the gateway ns
        self.topology.check_closed()

    def add_sandbox(self, role: str):
        from tests.transparent.topology import ETC_NETNS, Sandbox

        t = self.topology
        index = TRANSPARENT_SANDBOX_INDEX[role]
        sandbox = Sandbox(role, f"egb{t.tag}s{index}", f"bh{t.tag}{index}"[:15], index, TRANSPARENT_PORTS[role],
                          TRANSPARENT_DNS_PORTS[role], t.gw)
        t.sandboxes[role] = self.sandboxes[role] = sandbox
        sandbox.up()  # docker/sandbox-net.sh up, with GATEWAY_NS
        # The sandbox resolves the origin through its own hosts file (`ip netns exec` bind-mounts it);
        # the gateway's DNS mode is not what is measured.
        (ETC_NETNS / sandbox.ns / "hosts").write_text(
            f"127.0.0.1 localhost\n{TRANSPARENT_ORIGIN_IP} {ORIGIN_NAME}\n")
        t.check_closed()
        return sandbox

    def destroy(self) -> list[str]:
        """Remove everything; returns whatever of ours is still present (should be empty)."""
        self.topology.destroy()
        return self.topology.leftovers()


def transparent_unavailable() -> str | None:
    from tests.transparent.topology import unavailable_reason

    return unavailable_reason()


def gateway_policy_text(origin_ip: str, transparent: bool = False) -> str:
    network = "" if transparent else "  allow_ip_ranges: [127.0.0.0/8]\n"
    return f"""version: 1
network:
  deny_ip_ranges: default
{network}resolver:
  static_hosts:
    {ORIGIN_NAME}: [{origin_ip}]
rules:
  - id: bench-origin
    hosts: [{ORIGIN_NAME}]
    methods: [GET, HEAD]
"""


def start_proxy(setup: Setup, key: str, tools: dict[str, str], gateway_audit: bool) -> Proxy:
    """key: baseline | baseline_stream | gateway (explicit, on loopback) or baseline_transparent |
    gateway_transparent (in the gateway namespace, fed by that role's sandbox)."""
    transparent = key.endswith("_transparent")
    role = key.removesuffix("_transparent")
    if transparent:
        assert setup.net is not None
        port = TRANSPARENT_PORTS[role]
        mode = f"transparent@0.0.0.0:{port}"
        host = "0.0.0.0"
        wrap = ["ip", "netns", "exec", setup.net.topology.gw]
        origin_ip = TRANSPARENT_ORIGIN_IP
    else:
        port = free_port()
        mode = f"regular@127.0.0.1:{port}"
        host = "127.0.0.1"
        wrap = setup.wrap_hosts
        origin_ip = setup.origin_ip
    confdir = setup.workdir / f"confdir-{key}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if role == "gateway":
        policy = setup.workdir / f"{key}-policy.yaml"
        policy.write_text(gateway_policy_text(origin_ip, transparent))
        cmd = [sys.executable, "-m", "gateway", "run", "-q", "--policy", str(policy),
               "--mode", mode, "--confdir", str(confdir),
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if gateway_audit:
            cmd += ["--audit-log", str(setup.workdir / f"{key}-audit.jsonl")]
        env["PYTHONPATH"] = str(PROJECT_ROOT)
        label = "gateway (b)"
    else:
        cmd = [tools["mitmdump"], "-q", "--mode", mode,
               "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy", "--set", "flow_detail=0",
               "--set", "termlog_verbosity=warn",
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if role == "baseline_stream":
            cmd += ["--set", "stream_large_bodies=1m"]
            label = "mitmdump+stream (a')"
        else:
            label = "mitmdump (a)"
    if transparent:
        label += " transparent"
    service = Service(key, setup.cpu(0) + wrap + cmd, setup.workdir / f"{key}.log", env=env, cwd=PROJECT_ROOT)
    service.start()
    proxy = Proxy(key, label, service, host, port, confdir, role=role,
                  sandbox_ns=setup.net.sandboxes[role].ns if transparent else None)
    try:
        if transparent:
            wait_listening(service.proc, service.pid, port)
        else:
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


def client_prefix(proxy: Proxy) -> list[str]:
    """Transparent: run the client inside the proxy's sandbox (it has no proxy settings at all)."""
    return ["ip", "netns", "exec", proxy.sandbox_ns] if proxy.sandbox_ns else []


def client_proxy_args(proxy: Proxy) -> list[str]:
    return [] if proxy.sandbox_ns else ["-x", proxy.url]


def sanity_check(setup: Setup, proxy: Proxy) -> None:
    """A real request through the proxy, with the proxy's CA verified (so it was intercepted, not passed
    through: the origin's certificate is not signed by that CA); the gateway must also refuse."""
    out = subprocess.run(client_prefix(proxy) + ["curl", "-sS", "--fail", "--max-time", "15"]
                         + client_proxy_args(proxy) + ["--cacert", str(proxy.ca), f"https://{ORIGIN_NAME}{SMALL_PATH}"],
                         capture_output=True, env=clean_env())
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"request through {proxy.key} failed: {out.stderr.decode(errors='replace')}")
    if proxy.role != "gateway":
        return
    if proxy.sandbox_ns:
        # transparent: the sandbox dials the origin's own address with a refused SNI: 403 after the handshake
        out = subprocess.run(client_prefix(proxy) + [
            "curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(proxy.ca),
            "--resolve", f"{DENIED_NAME}:443:{TRANSPARENT_ORIGIN_IP}", f"https://{DENIED_NAME}/"],
            capture_output=True, text=True, env=clean_env())
        if out.stdout.strip() != "403":
            raise BenchError(f"the transparent gateway did not refuse {DENIED_NAME} (answered {out.stdout.strip()!r})")
    else:
        out = subprocess.run(["curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_connect}",
                              "-x", proxy.url, "--cacert", str(proxy.ca), f"https://{DENIED_NAME}/"],
                             capture_output=True, text=True, env=clean_env())
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
    cmd = setup.cpu(1) + client_prefix(proxy) + ["hey", "-z", f"{duration:g}s", "-c", str(concurrency), "-t", "20"]
    cmd += client_proxy_args(proxy)
    if setup.pin:
        cmd += ["-cpus", "1"]
    if not keepalive:
        cmd += ["-disable-keepalive"]
    cmd.append(f"https://{ORIGIN_NAME}{SMALL_PATH}")
    # hey skips certificate verification (InsecureSkipVerify); SSL_CERT_FILE is set anyway so that a
    # build that verifies would trust the proxy's CA (Go reads it on Linux).
    env = clean_env(SSL_CERT_FILE=str(proxy.ca))
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
    groups = meta.get("groups", list(GROUPS))
    bulk_text = f"bulk body {meta['bulk_mb']} MB, " if "bulk" in groups else ""
    L.append(f"Mode: **{meta['mode']}** ({', '.join(groups)}) — {meta['rounds_done']} "
             f"interleaved rounds, hey -c {meta['concurrency']}, {meta['duration']:g} s per run, {bulk_text}"
             f"CPU pinning: "
             f"{'proxy on CPU 0, nginx/hey/curl on CPU 1' if meta.get('pinned') else 'off'}"
             f"{'; nice ' + str(meta['nice']) if meta.get('nice') else ''}"
             f"{'; gateway with --audit-log' if meta.get('gateway_audit_log') else ''}.")
    L.append(f"Commit {meta['commit']}{' (+ uncommitted changes)' if meta['dirty'] else ''}; mitmproxy {meta['mitmproxy']}; "
             f"{meta.get('nginx', 'nginx n/a')}; Python {meta['python']}; {meta['cpus']} CPUs; load average at start {meta['loadavg_start']}.")
    if meta.get("transparent_topology"):
        t = meta["transparent_topology"]
        L.append(f"Transparent: hey in a sandbox namespace (no proxy settings) → docker/sandbox-net.sh's iptables "
                 f"REDIRECT → the proxy's transparent listener in namespace {t['gateway_ns']} → veth → nginx on "
                 f"{t['origin']} in namespace {t['internet_ns']}; one sandbox per proxy "
                 f"({'; '.join(f'{r}: {v}' for r, v in t['sandboxes'].items())}).")
    if meta.get("loadavg_rounds"):
        L.append(f"Load average (1/5/15 min) at the start of each round: {' | '.join(meta['loadavg_rounds'])}.")
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
    row("(5) transparent keep-alive HTTPS req/s", "transparent_keepalive", "rps", tp, ok)
    row("(5) transparent keep-alive p50 latency, ms", "transparent_keepalive", "p50_ms")
    row("(5) transparent keep-alive p99 latency, ms", "transparent_keepalive", "p99_ms")
    row("(5) transparent proxy CPU per request, µs", "transparent_keepalive", "cpu_us_per_req", digits=0)
    row("(6) transparent new TLS connections/s", "transparent_newconn", "rps", tp, ok)
    row("(6) transparent new-connection p50 latency, ms", "transparent_newconn", "p50_ms")
    row("(6) transparent new-connection p99 latency, ms", "transparent_newconn", "p99_ms")
    row("(6) transparent proxy CPU per connection, µs", "transparent_newconn", "cpu_us_per_req", digits=0)
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
                                 ("transparent_keepalive", "rps", "transparent keep-alive req/s"),
                                 ("transparent_newconn", "rps", "transparent new connections/s"),
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
                                 ("transparent_keepalive", "rps", "req/s"), ("transparent_newconn", "rps", "conn/s"),
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
                   help="short run: 3 rounds of 3 s, 20,000-rule policy instead of 100,000 (~3-4 min)")
    p.add_argument("--only", action="append", metavar="GROUP[,GROUP]",
                   help=f"run only these figure groups, of {', '.join(GROUPS)} (repeatable or comma-separated; "
                        "default: all; transparent is skipped with a warning when namespaces are unavailable)")
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
    p.add_argument("--skip-proxy", action="store_true", help="only the policy decision figure (4): --only decision")
    p.add_argument("--skip-policy", action="store_true", help="skip the policy decision figure (4)")
    p.add_argument("--max-minutes", type=float,
                   help="stop starting new rounds after this many minutes (default 14, quick 5)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temporary directory (logs, configs)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="where to write latest.md / latest.json")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {"rounds": (3, 5), "duration": (3.0, 10.0), "rules": (20000, 100000), "policy_number": (20000, 20000),
                "policy_repeats": (5, 9), "max_minutes": (5.0, 14.0)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.rounds < 1 or args.duration <= 0 or args.rules < 11 or args.policy_repeats < 1:
        p.error("--rounds, --duration and --policy-repeats must be positive and --rules above 10")
    if not args.origin_ip.startswith("127."):
        p.error("--origin-ip must be in 127.0.0.0/8: this benchmark sends traffic to loopback only")
    args.only_given = bool(args.only)
    groups = [g.strip() for item in (args.only or [",".join(GROUPS)]) for g in item.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"--only: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if args.skip_proxy:
        groups = [g for g in groups if g == "decision"]
    if args.skip_policy:
        groups = [g for g in groups if g != "decision"]
    if not groups:
        p.error("nothing to run (check --only, --skip-proxy and --skip-policy)")
    args.groups = [g for g in GROUPS if g in groups]
    return args


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_figure(setup: Setup, meta: dict, rnd: int, figure: str, pair: list[Proxy], duration: float,
               concurrency: int, keepalive: bool) -> dict:
    results = {}
    for proxy in pair:
        res = run_hey(setup, proxy, duration, concurrency, keepalive)
        if res["failure_fraction"] > 0.001:
            meta["warnings"].append(
                f"round {rnd + 1} {figure} {proxy.key}: {res['non_200']} non-200 and "
                f"{res['errors']} errors ({res['failure_fraction']:.2%})")
        results[proxy.role] = res
        log(f"  {figure:21s} {proxy.key:20s} {res['rps']:8.1f}/s  p50 {fmt(res['p50_ms'])} ms  "
            f"p99 {fmt(res['p99_ms'])} ms  cpu {fmt(res.get('cpu_us_per_req'), 0)} µs/req")
        time.sleep(0.5)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    import mitmproxy.version

    commit, dirty = git_info()
    groups = list(args.groups)
    meta: dict = {
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "groups": groups,
        "rounds": args.rounds, "rounds_done": 0, "duration": args.duration, "concurrency": args.concurrency,
        "bulk_mb": args.bulk_mb, "commit": commit, "dirty": dirty, "mitmproxy": mitmproxy.version.VERSION,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_start": loadavg(), "loadavg_rounds": [], "warnings": [],
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
    explicit = "explicit" in groups or "bulk" in groups
    try:
        if "transparent" in groups:
            reason = transparent_unavailable()
            if reason:
                if args.only_given:
                    raise BenchError(f"transparent mode cannot run here: {reason}")
                meta["warnings"].append(f"transparent figures skipped: {reason}")
                log(f"transparent figures skipped: {reason}")
                groups.remove("transparent")
                meta["groups"] = groups
        proxy_groups = [g for g in groups if g != "decision"]
        if proxy_groups:
            pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
            tools = check_tools(need_unshare=explicit)
            meta["nginx"] = subprocess.run([tools["nginx"], "-v"], capture_output=True, text=True).stderr.strip()
            setup = Setup(workdir, args.origin_ip, pin, hosts_wrapper(workdir, args.origin_ip) if explicit else [],
                          nice=args.nice)
            meta["pinned"] = pin
            bulk_bytes = args.bulk_mb * 1_000_000
            log(f"work directory {workdir}")
            make_origin_files(setup, bulk_bytes if "bulk" in groups else 0)
            keys: list[str] = []
            if explicit:
                log(f"explicit: origin https://{ORIGIN_NAME} on {args.origin_ip}:443 (nginx)")
                start_nginx(setup, "nginx", args.origin_ip, tools)
                keys += ["baseline", "gateway"] + (["baseline_stream"]
                                                   if "bulk" in groups and not args.no_stream_baseline else [])
            if "transparent" in groups:
                setup.net = TransparentNet.new()
                setup.net.build()
                for role in ("baseline", "gateway"):
                    setup.net.add_sandbox(role)
                t = setup.net.topology
                meta["transparent_topology"] = {
                    "gateway_ns": t.gw, "internet_ns": t.inet,
                    "sandboxes": {r: f"{sb.ns} {sb.address} -> :{sb.proxy_port}" for r, sb in setup.net.sandboxes.items()},
                    "origin": f"{TRANSPARENT_ORIGIN_IP}:443",
                }
                log(f"transparent: namespaces gateway {t.gw}, internet {t.inet}, sandboxes "
                    f"{', '.join(sb.ns for sb in setup.net.sandboxes.values())}; origin https://{ORIGIN_NAME} on "
                    f"{TRANSPARENT_ORIGIN_IP}:443 (nginx in {t.inet})")
                start_nginx(setup, "nginx-transparent", TRANSPARENT_ORIGIN_IP, tools, netns=t.inet)
                keys += ["baseline_transparent", "gateway_transparent"]
            for key in keys:
                setup.proxies[key] = start_proxy(setup, key, tools, args.gateway_audit_log)
                proxy = setup.proxies[key]
                where = f"sandbox {proxy.sandbox_ns} -> :{proxy.port}" if proxy.sandbox_ns else proxy.url
                log(f"{key}: {where} (pid {proxy.pid})")

            # (figure, keep-alive?, baseline key, gateway key)
            figures: list[tuple[str, bool, str, str]] = []
            if "explicit" in groups:
                figures += [("keepalive", True, "baseline", "gateway"), ("newconn", False, "baseline", "gateway")]
            if "transparent" in groups:
                figures += [("transparent_keepalive", True, "baseline_transparent", "gateway_transparent"),
                            ("transparent_newconn", False, "baseline_transparent", "gateway_transparent")]

            if figures:
                log("warm-up (not counted)")
                for key in dict.fromkeys(k for f in figures for k in f[2:]):
                    run_hey(setup, setup.proxies[key], min(2.0, args.duration), args.concurrency, True)
                    run_hey(setup, setup.proxies[key], min(2.0, args.duration), args.concurrency, False)

            bulk_keys = [k for k in ("baseline", "gateway", "baseline_stream") if k in keys] if "bulk" in groups else []
            for rnd in range(args.rounds):
                if time.monotonic() > deadline:
                    meta["warnings"].append(f"time limit reached: stopped after {rnd} rounds")
                    break
                meta["loadavg_rounds"].append(loadavg())
                log(f"round {rnd + 1}/{args.rounds}: order {'a → b' if rnd % 2 == 0 else 'b → a'}; "
                    f"load average {meta['loadavg_rounds'][-1]}")
                for figure, keepalive, a_key, b_key in figures:
                    pair = [setup.proxies[a_key], setup.proxies[b_key]]
                    if rnd % 2:
                        pair.reverse()
                    raw.setdefault(figure, []).append(
                        run_figure(setup, meta, rnd, figure, pair, args.duration, args.concurrency, keepalive))
                if bulk_keys:
                    order = [setup.proxies[k] for k in bulk_keys]
                    shift = rnd % len(order)
                    order = order[shift:] + order[:shift]
                    if rnd % 2:
                        order.reverse()
                    results = {}
                    for proxy in order:
                        res = run_bulk(setup, proxy, bulk_bytes)
                        results[proxy.role] = res
                        log(f"  bulk                  {proxy.key:20s} {res['mb_per_s']:8.1f} MB/s  RSS "
                            f"{res['rss_before_mib']:.0f} → peak {res['rss_peak_mib']:.0f} MiB "
                            f"(after {res['rss_after_mib']:.0f})")
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
    except (BenchError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log(f"ERROR: {exc}")
        meta["warnings"].append(f"error: {exc}".splitlines()[0])
        failed = True
    finally:
        # Clean-up must not be cut short by a second Ctrl-C or SIGTERM: ignore both until it is done.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if setup is not None:
                for proxy in setup.proxies.values():
                    proxy.service.stop()
                for nginx in setup.nginx.values():
                    nginx.stop()
                if setup.net is not None:
                    leftovers = setup.net.destroy()
                    if leftovers:
                        meta["warnings"].append(f"not cleaned up: {leftovers}")
                        log(f"WARNING: not cleaned up: {leftovers}")
                    else:
                        log("transparent: namespaces and /etc/netns entries removed")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    if "decision" in groups and not failed:
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
    meta["loadavg_end"] = loadavg()
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
