#!/usr/bin/env python3
"""Egress gateway benchmark: the gateway side by side with direct access, bare mitmdump and squid, in one run.

    /tmp/venv/bin/python bench/run.py            # everything (~17 minutes)
    /tmp/venv/bin/python bench/run.py --quick    # smoke run (~5 minutes)
    /tmp/venv/bin/python bench/run.py --only configs,scaling --quick
    /tmp/venv/bin/python bench/run.py --profile  # where the gateway's time goes (py-spy), no rounds

Configurations (explicit mode, all on this machine, traffic only to 127.0.0.0/8), started once and kept
up for the whole run:
- direct: hey straight to the nginx origin over TLS (no proxy);
- mitmdump: bare mitmdump intercepting (no addon script, lazy connections, flow_detail=0);
- mitmdump passthrough: the same with ignore_hosts=.* (mitmproxy relays the TLS unread);
- gateway: `python -m gateway run --workers 1`, intercepting, its checks on;
- gateway N workers: `--workers N`, N = the number of CPUs (a supervisor and N processes on one port);
- gateway passthrough: one worker with a policy rule `inspect: false` (SNI checked, TLS relayed unread);
- squid: a plain CONNECT proxy (no caching, no ssl-bump), generated minimal squid.conf.
Every proxy gets a fresh process before every round but the first (--same-processes: not).
Figures: keep-alive HTTPS req/s through a CONNECT tunnel, new TLS connections/s (CONNECT + handshake per
request), latency at a fixed moderate rate (added to direct), proxy CPU per request (all its processes),
RSS (all processes) with 1,000 idle tunnels, the N-worker scaling (each worker held to a CPU quota),
plus transparent mode, bulk streaming and the policy decision cost. Rounds are interleaved (the order
rotates and reverses between rounds); every figure is a median over rounds, every ratio is taken
within this run. See bench/README.md.

This is not a test: pytest does not collect it (no test_*.py name, outside testpaths).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import secrets
import select
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
for _path in (str(PROJECT_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import report  # noqa: E402  (bench/report.py)
import streaming  # noqa: E402  (bench/streaming.py: the streaming group)
from cpuquota import CpuQuota  # noqa: E402

ORIGIN_NAME = "origin.bench"
DENIED_NAME = "denied.bench"
SMALL_PATH = "/small.txt"
BIG_PATH = "/big.bin"
SMALL_BODY = b"hello from origin.bench: a small static body for keep-alive and new-connection rounds.\n" * 2
CLK_TCK = os.sysconf("SC_CLK_TCK")
GROUPS = ("configs", "idle", "scaling", "transparent", "bulk", "decision", "streaming")
GROUP_ALIASES = {"explicit": "configs"}  # the name of the first two figures' group before configurations
# Explicit-mode configurations, in report order.
CONFIGS = ("direct", "mitmdump", "mitmdump_passthrough", "gateway", "gateway_workers", "gateway_passthrough", "squid")
# transparent mode: addresses and ports inside the namespaces this run creates (nothing else is there)
TRANSPARENT_ORIGIN_IP = "93.184.216.34"  # on lo of the run's own "internet" namespace only
TRANSPARENT_PORTS = {"mitmdump": 18091, "gateway": 18092}  # listeners in the run's gateway namespace
TRANSPARENT_DNS_PORTS = {"mitmdump": 15391, "gateway": 15392}  # nothing listens: names come from hosts files
TRANSPARENT_SANDBOX_INDEX = {"mitmdump": 1, "gateway": 2}  # sandbox 10.203.K.2 -> gateway side 10.203.K.1
IDLE_SOURCES = "127.0.0.201,127.0.0.202,127.0.0.203,127.0.0.204"  # the idle client spreads over these


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


def wait_listening(proc: subprocess.Popen, pid: int, port: int, timeout: float = 30.0, address: str | None = None) -> None:
    """Wait until process `pid` (in whatever network namespace it runs) has a TCP socket listening on
    `port` (and IPv4 `address`, if given): read from /proc/PID/net/tcp, which shows the sockets of that
    process's namespace. No probe connection, which a transparent listener would take for a
    redirected one. Give the address when the same port may listen in the host namespace: until the
    wrapper (`ip netns exec`) has switched namespaces, /proc/PID/net/tcp shows the host's sockets."""
    needle = (socket.inet_aton(address)[::-1].hex().upper() if address else "") + f":{port:04X}"
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
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _status_field(pid: int, name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_kib(pid: int) -> int | None:
    return _status_field(pid, "VmRSS")


def pss_kib(pid: int) -> int | None:
    """Proportional set size: shared pages divided among the processes sharing them."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (a multi-process proxy: supervisor and workers)."""
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if Path(f"/proc/{p}").exists():
            out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_by_pid(pids: list[int]) -> dict[int, float]:
    return {p: c for p in pids if (c := cpu_seconds(p)) is not None}


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(c - before.get(p, 0.0) for p, c in after.items())


def python_pid(pid: int) -> int:
    """The proxy's own process: the wrappers (taskset, unshare, sh, ip netns exec) exec, so usually
    `pid` itself; otherwise the first descendant that runs the proxy."""
    def ours(p: int) -> bool:
        line = cmdline(p)
        return any(word in line for word in ("python", "mitmdump", "squid"))

    if ours(pid):
        return pid
    children = _children_map()
    for child in children.get(pid, ()):
        if ours(child):
            return child
    return pid


def set_affinity(pids: list[int], cpus: set[int]) -> dict[int, set[int]]:
    """Pin every thread of the processes to `cpus`; returns the previous affinity of each thread."""
    previous = {}
    for pid in pids:
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                previous[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
    return previous


def restore_affinity(previous: dict[int, set[int]]) -> None:
    for tid, cpus in previous.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


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
    nginx: dict[str, Service] = field(default_factory=dict)  # nginx | nginx-transparent
    proxies: dict[str, "Proxy"] = field(default_factory=dict)
    net: "TransparentNet | None" = None
    quota: CpuQuota | None = None
    gateway_audit: bool = False
    features: dict = field(default_factory=dict)
    extra_dirs: list[Path] = field(default_factory=list)  # removed at the end, like the work directory
    scaling_pin: bool = False  # scaling figure: every gateway process on CPU 0 (else on every CPU)
    nice: int = 0

    def cpu(self, which: int | None) -> list[str]:
        """Command prefix: the CPU to pin to (None: any) and the nice value, for a process of the benchmark."""
        prefix = ["nice", "-n", str(self.nice)] if self.nice else []
        return prefix + (["taskset", "-c", str(which)] if self.pin and which is not None else [])


@dataclass
class Proxy:
    """One configuration under test. `service` is None for direct (no proxy)."""

    key: str
    label: str
    service: Service | None
    host: str
    port: int
    client_ca: Path  # what a client verifies: the proxy's CA when it intercepts, the origin's otherwise
    intercepts: bool
    pid: int = 0
    workers: int = 1
    nginx: str = "nginx"
    sandbox_ns: str | None = None  # transparent: the sandbox namespace whose traffic is redirected to it
    cmd: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def pids(self) -> list[int]:
        return process_tree(self.pid) if self.service is not None else []

    def worker_pids(self) -> list[int]:
        """The processes that serve connections: the supervisor's children, or the one process."""
        tree = self.pids()
        workers = [p for p in tree if p != self.pid]
        return workers or tree


def check_tools(origin_tools: bool = True) -> dict[str, str]:
    found = {}
    for tool in ("nginx", "hey", "curl", "unshare", "squid"):
        path = shutil.which(tool) or (f"/usr/sbin/{tool}" if Path(f"/usr/sbin/{tool}").exists() else None)
        if not path:
            if tool == "squid" or (tool in ("nginx", "hey") and not origin_tools):
                continue  # optional: that configuration is skipped with a note; streaming needs neither
            hint = " (apt-get update && apt-get install -y nginx hey squid)" if tool in ("nginx", "hey") else ""
            raise BenchError(f"{tool} not found{hint}")
        found[tool] = path
    mitmdump = Path(sys.executable).parent / "mitmdump"
    found["mitmdump"] = str(mitmdump) if mitmdump.exists() else (shutil.which("mitmdump") or "")
    if not found["mitmdump"]:
        raise BenchError("mitmdump not found next to this Python nor on PATH")
    return found


def hosts_wrapper(workdir: Path, origin_ip: str) -> list[str]:
    """A command prefix under which origin.bench resolves to the origin (bare mitmdump, direct hey)."""
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
        wait_listening(nginx.proc, nginx.pid, 443, address=listen_ip)
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
    """Gateway + internet namespaces (tests/support/topology.py's Topology, with names of its own:
    egb<tag>g, egb<tag>i) and one sandbox per proxy built by docker/sandbox-net.sh with GATEWAY_NS."""

    topology: object
    sandboxes: dict[str, object] = field(default_factory=dict)  # role -> Sandbox

    @classmethod
    def new(cls) -> "TransparentNet":
        """Names only; `build` creates the namespaces (keep the object first, so that a half-built
        network is still destroyed)."""
        from tests.support.topology import Topology

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
        from tests.support.topology import ETC_NETNS, Sandbox

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
    from tests.support.topology import unavailable_reason

    return unavailable_reason()


# --------------------------------------------------------------------------------------------
# the configurations


def gateway_policy_text(origin_ip: str, transparent: bool = False, passthrough: bool = False) -> str:
    network = "" if transparent else "  allow_ip_ranges: [127.0.0.0/8]\n"
    rule = (f"  - id: bench-origin-passthrough\n    hosts: [{ORIGIN_NAME}]\n    inspect: false\n" if passthrough
            else f"  - id: bench-origin\n    hosts: [{ORIGIN_NAME}]\n    methods: [GET, HEAD]\n")
    return f"""version: 1
network:
  deny_ip_ranges: default
{network}resolver:
  static_hosts:
    {ORIGIN_NAME}: [{origin_ip}]
rules:
{rule}"""


def gateway_features(workdir: Path, origin_ip: str) -> dict:
    """What the gateway in this tree supports: `run --workers N`, and `inspect: false` rules (`check`
    must accept such a policy). Each is None when supported, else the reason it is not."""
    help_text = subprocess.run([sys.executable, "-m", "gateway", "run", "--help"], capture_output=True, text=True,
                               cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)), timeout=60)
    workers = None if "--workers" in help_text.stdout else "`gateway run --help` has no --workers"
    policy = workdir / "probe-passthrough-policy.yaml"
    policy.write_text(gateway_policy_text(origin_ip, passthrough=True))
    check = subprocess.run([sys.executable, "-m", "gateway", "check", str(policy)], capture_output=True, text=True,
                           cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)), timeout=60)
    passthrough = None if check.returncode == 0 else (
        "`gateway check` refuses a rule with inspect: false: "
        + (check.stdout + check.stderr).strip().splitlines()[-1][:200] if (check.stdout + check.stderr).strip()
        else f"`gateway check` exited {check.returncode}")
    return {"workers": workers, "passthrough": passthrough}


LABELS = {
    "direct": "direct (no proxy)",
    "mitmdump": "mitmdump",
    "mitmdump_passthrough": "mitmdump passthrough",
    "gateway": "gateway, 1 worker",
    "gateway_workers": "gateway, N workers",
    "gateway_passthrough": "gateway, inspect: false",
    "squid": "squid (CONNECT)",
    "mitmdump_bulk": "mitmdump (a), bulk",
    "gateway_bulk": "gateway (b), bulk",
    "mitmdump_stream": "mitmdump + stream (a'), bulk",
    "mitmdump_transparent": "mitmdump transparent",
    "gateway_transparent": "gateway transparent",
}


def label(key: str, workers: int | None = None) -> str:
    text = LABELS.get(key, key)
    return text.replace("N workers", f"{workers} workers") if workers else text


def start_proxy(setup: Setup, key: str, tools: dict[str, str], policy_text: str | None = None) -> Proxy:
    """Start configuration `key` and check it really does what it is said to do; BenchError if not."""
    if key == "direct":
        proxy = Proxy(key, label(key), None, setup.origin_ip, 443, setup.ca_cert, intercepts=False)
        sanity_check(setup, proxy)
        return proxy
    if key == "squid":
        return start_squid(setup, tools)
    transparent = key.endswith("_transparent")
    if transparent:
        assert setup.net is not None
        role = key.removesuffix("_transparent")
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
    kind = key.removesuffix("_bulk")
    workers = 1
    cpu: int | None = 0
    passthrough = key.endswith("passthrough")
    if key.startswith("gateway"):
        policy = setup.workdir / f"{key}-policy.yaml"
        policy.write_text(policy_text or gateway_policy_text(origin_ip, transparent, passthrough=passthrough))
        cmd = [sys.executable, "-m", "gateway", "run", "-q", "--policy", str(policy),
               "--mode", mode, "--confdir", str(confdir),
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if setup.features.get("workers") is None:  # supported: say how many, the default is every core
            workers = (os.cpu_count() or 1) if kind == "gateway_workers" else 1
            cmd += ["--workers", str(workers)]
        if kind == "gateway_workers":
            cpu = None  # N workers run on every CPU (the scaling figure pins and throttles them)
        if setup.gateway_audit:
            cmd += ["--audit-log", str(setup.workdir / f"{key}-audit.jsonl")]
        env["PYTHONPATH"] = str(PROJECT_ROOT)
    else:
        cmd = [tools["mitmdump"], "-q", "--mode", mode,
               "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy", "--set", "flow_detail=0",
               "--set", "termlog_verbosity=warn",
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if key == "mitmdump_stream":
            cmd += ["--set", "stream_large_bodies=1m"]
        if passthrough:
            cmd += ["--set", "ignore_hosts=.*"]  # mitmproxy's TLS passthrough: every host is relayed unread
    service = Service(key, setup.cpu(cpu) + wrap + cmd, setup.workdir / f"{key}.log", env=env, cwd=PROJECT_ROOT)
    service.start()
    proxy = Proxy(key, label(key, workers if kind == "gateway_workers" else None), service, host, port,
                  setup.ca_cert if passthrough else confdir / "mitmproxy-ca-cert.pem", intercepts=not passthrough,
                  workers=workers, nginx="nginx-transparent" if transparent else "nginx",
                  sandbox_ns=setup.net.sandboxes[key.removesuffix("_transparent")].ns if transparent else None,
                  cmd=cmd)
    try:
        if transparent:
            wait_listening(service.proc, service.pid, port)
        else:
            wait_for_port(proxy.host, port, service.proc)
        deadline = time.monotonic() + 15
        ca = confdir / "mitmproxy-ca-cert.pem"
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy.pid = python_pid(service.pid)
        if workers > 1:
            deadline = time.monotonic() + 20
            while len(proxy.pids()) < workers + 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            if len(proxy.pids()) < workers + 1:
                raise BenchError(f"expected a supervisor and {workers} workers, found processes {proxy.pids()}")
        sanity_check(setup, proxy)
    except Exception as exc:
        service.stop()
        raise BenchError(f"{key} did not start: {exc}\n{service.tail()}") from None
    return proxy


def start_squid(setup: Setup, tools: dict[str, str]) -> Proxy:
    """squid as a plain CONNECT proxy: no cache, no ssl-bump, foreground (-N), everything under the
    work directory, allowed to CONNECT to origin.bench:443 only, from loopback only."""
    if "squid" not in tools:
        raise BenchError("squid is not installed (apt-get install -y squid)")
    # its own directory, outside the (root-only) work directory: squid drops privileges to its user
    d = Path(tempfile.mkdtemp(prefix="egress-bench-squid-"))
    setup.extra_dirs.append(d)
    d.chmod(0o755)
    port = free_port()
    hosts = d / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{setup.origin_ip} {ORIGIN_NAME}\n")
    conf = d / "squid.conf"
    conf.write_text(f"""# generated by bench/run.py: a minimal CONNECT-only squid on loopback
http_port 127.0.0.1:{port}
visible_hostname egress-bench-squid
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log none
cache_store_log none
coredump_dir {d}
cache deny all
cache_mem 8 MB
hosts_file {hosts}
dns_nameservers 127.0.0.1
max_filedescriptors 16384
workers 1
shutdown_lifetime 1 seconds
netdb_filename none
pinger_enable off
acl bench_clients src 127.0.0.0/8
acl bench_origin dstdomain {ORIGIN_NAME}
acl bench_port port 443
acl CONNECT method CONNECT
http_access allow CONNECT bench_clients bench_origin bench_port
http_access deny all
""")
    try:
        import pwd

        user = pwd.getpwnam("proxy")  # Debian's squid drops privileges to this user
        for path in (d, hosts, conf):
            os.chown(path, user.pw_uid, user.pw_gid)
    except KeyError:
        pass
    parse = subprocess.run([tools["squid"], "-k", "parse", "-f", str(conf)], capture_output=True, text=True)
    if parse.returncode != 0:
        raise BenchError(f"squid -k parse failed: {(parse.stderr or parse.stdout).strip()[-500:]}")
    cmd = [tools["squid"], "-N", "-f", str(conf)]
    service = Service("squid", setup.cpu(0) + cmd, setup.workdir / "squid.log", stop_signal=signal.SIGINT)
    service.start()
    proxy = Proxy("squid", label("squid"), service, "127.0.0.1", port, setup.ca_cert, intercepts=False, cmd=cmd)
    try:
        wait_for_port("127.0.0.1", port, service.proc)
        proxy.pid = python_pid(service.pid)
        sanity_check(setup, proxy)
    except Exception as exc:
        service.stop()
        tail = (d / "cache.log").read_text(errors="replace")[-1500:] if (d / "cache.log").exists() else ""
        raise BenchError(f"squid did not start: {exc}\n{service.tail()}\n{tail}") from None
    return proxy


def client_prefix(setup: Setup, proxy: Proxy) -> list[str]:
    """Transparent: run the client inside the proxy's sandbox (no proxy settings at all); direct: under
    the private /etc/hosts that names the origin."""
    if proxy.sandbox_ns:
        return ["ip", "netns", "exec", proxy.sandbox_ns]
    if proxy.service is None:
        return list(setup.wrap_hosts)
    return []


def client_proxy_args(proxy: Proxy) -> list[str]:
    return [] if proxy.sandbox_ns or proxy.service is None else ["-x", proxy.url]


def sanity_check(setup: Setup, proxy: Proxy) -> None:
    """A real request through the configuration, verifying the CA it should present: the proxy's CA when
    it intercepts (the origin's certificate is not signed by it), the origin's own when it passes TLS
    through. The gateway must also refuse a name its policy does not allow."""
    out = subprocess.run(client_prefix(setup, proxy) + ["curl", "-sS", "--fail", "--max-time", "15"]
                         + client_proxy_args(proxy) + ["--cacert", str(proxy.client_ca),
                                                       f"https://{ORIGIN_NAME}{SMALL_PATH}"],
                         capture_output=True, env=clean_env())
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"request through {proxy.key} failed: {out.stderr.decode(errors='replace')}")
    if not proxy.key.startswith("gateway"):
        return
    if proxy.sandbox_ns:
        # transparent: the sandbox dials the origin's own address with a refused SNI: 403 after the handshake
        out = subprocess.run(client_prefix(setup, proxy) + [
            "curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(proxy.client_ca),
            "--resolve", f"{DENIED_NAME}:443:{TRANSPARENT_ORIGIN_IP}", f"https://{DENIED_NAME}/"],
            capture_output=True, text=True, env=clean_env())
        if out.stdout.strip() != "403":
            raise BenchError(f"the transparent gateway did not refuse {DENIED_NAME} (answered {out.stdout.strip()!r})")
    else:
        out = subprocess.run(["curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_connect}",
                              "-x", proxy.url, "--cacert", str(proxy.client_ca), f"https://{DENIED_NAME}/"],
                             capture_output=True, text=True, env=clean_env())
        if out.stdout.strip() != "403":
            raise BenchError(f"{proxy.key} did not refuse {DENIED_NAME} (CONNECT answered {out.stdout.strip()!r})")


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
    cmd = setup.cpu(1) + ["curl", "-sS", "--fail", "--max-time", "180", "-x", proxy.url,
                          "--cacert", str(proxy.client_ca), "-o", "/dev/null",
                          "-w", "%{http_code} %{size_download} %{time_total}", f"https://{ORIGIN_NAME}{BIG_PATH}"]
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


def memory(pids: list[int]) -> dict:
    rss = [rss_kib(p) for p in pids]
    pss = [pss_kib(p) for p in pids]
    return {"rss_kib": sum(v or 0 for v in rss), "pss_kib": sum(v or 0 for v in pss) if all(v is not None for v in pss)
            else None, "processes": len(pids)}


def run_idle(setup: Setup, proxy: Proxy, count: int) -> dict:
    """RSS of the proxy (all its processes) with `count` idle tunnels open through it, each with TLS
    established through the tunnel and one request answered (bench/idle_tunnels.py, on the client CPU)."""
    before = memory(proxy.pids())
    cmd = setup.cpu(1) + [sys.executable, str(BENCH_DIR / "idle_tunnels.py"), "--proxy", f"{proxy.host}:{proxy.port}",
                          "--target", f"{ORIGIN_NAME}:443", "--cafile", str(proxy.client_ca), "--path", SMALL_PATH,
                          "--count", str(count), "--concurrency", "32", "--sources", IDLE_SOURCES]
    t0 = time.monotonic()
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env())
    try:
        ready, _, _ = select.select([client.stdout], [], [], 240)
        line = client.stdout.readline() if ready else ""
        if not line:
            client.kill()
            raise BenchError(f"idle tunnels through {proxy.key}: no report from the client "
                             f"({client.stderr.read()[-500:] if client.poll() is not None else 'timed out'})")
        opened = json.loads(line)
        time.sleep(1.0)  # let the proxy settle (buffers, lazy upstream work)
        with_tunnels = memory(proxy.pids())
        time.sleep(0.5)
        again = memory(proxy.pids())
        if again["rss_kib"] > with_tunnels["rss_kib"]:
            with_tunnels = again
    finally:
        if client.poll() is None:
            client.stdin.close()
            try:
                client.wait(60)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(5)
    tail = client.stdout.read() if client.stdout else ""
    still = None
    for ln in tail.splitlines():
        try:
            still = json.loads(ln).get("still_open_at_end", still)
        except ValueError:
            pass
    time.sleep(1.5)  # the proxy closes both sides before the next configuration opens its own
    after = memory(proxy.pids())
    n = opened["open"]
    return {
        "tunnels": n, "failed": opened["failed"], "errors": opened.get("errors"), "open_seconds": opened["seconds"],
        "still_open_at_end": still, "wall_s": round(time.monotonic() - t0, 1),
        "rss_idle_mib": before["rss_kib"] / 1024, "rss_tunnels_mib": with_tunnels["rss_kib"] / 1024,
        "rss_after_mib": after["rss_kib"] / 1024,
        "pss_idle_mib": before["pss_kib"] / 1024 if before["pss_kib"] is not None else None,
        "pss_tunnels_mib": with_tunnels["pss_kib"] / 1024 if with_tunnels["pss_kib"] is not None else None,
        "kib_per_tunnel": (with_tunnels["rss_kib"] - before["rss_kib"]) / n if n else None,
        "processes": with_tunnels["processes"],
    }


@dataclass
class Throttle:
    """The scaling figure's set-up for one run: every worker of a gateway held to `cores_each` of CPU
    (cgroup quota) and, when pinning, every process of it on CPU 0 (the load generator keeps CPU 1)."""

    setup: Setup
    proxy: Proxy
    cores_each: float
    workers: list[int] = field(default_factory=list)
    previous_affinity: dict[int, set[int]] = field(default_factory=dict)
    stats0: dict[int, dict] = field(default_factory=dict)

    def __enter__(self) -> "Throttle":
        quota = self.setup.quota
        assert quota is not None and quota.available
        self.workers = self.proxy.worker_pids()
        for pid in self.workers:
            quota.limit(pid, self.cores_each)
        if self.setup.pin and self.setup.scaling_pin:
            self.previous_affinity = set_affinity(self.proxy.pids(), {0})
        elif self.setup.pin:  # every CPU: the quota alone bounds the gateway
            self.previous_affinity = set_affinity(self.proxy.pids(), set(range(os.cpu_count() or 1)))
        self.stats0 = {pid: quota.stats(pid) for pid in self.workers}
        return self

    def stats(self) -> dict:
        quota = self.setup.quota
        out = {}
        for pid in self.workers:
            now = quota.stats(pid)
            then = self.stats0.get(pid, {})
            out[str(pid)] = {k: now[k] - then.get(k, 0) for k in now if k in ("nr_periods", "nr_throttled",
                                                                              "throttled_usec", "usage_usec")}
        return out

    def __exit__(self, *exc) -> None:
        for pid in self.workers:
            self.setup.quota.unlimit(pid)
        restore_affinity(self.previous_affinity)


def run_scaling(setup: Setup, proxy: Proxy, duration: float, concurrency: int, keepalive: bool,
                cores_each: float) -> dict:
    with Throttle(setup, proxy, cores_each) as throttle:
        result = run_hey(setup, proxy, duration, concurrency, keepalive)
        result["throttle"] = throttle.stats()
        workers = throttle.workers
    wall = result["wall_s"]
    per_worker = [result["cpu_by_pid"].get(str(p), 0.0) for p in workers]
    result["workers"] = len(workers)
    result["cores_each"] = cores_each
    result["worker_cpu_s"] = per_worker
    # how much of its quota each worker used: ~1.0 means the worker, not the load generator, was the limit
    result["quota_used"] = [c / (cores_each * wall) for c in per_worker] if wall else None
    others = [c for p, c in result["cpu_by_pid"].items() if int(p) not in workers]
    result["supervisor_cpu_s"] = sum(others) if others else None  # None: one process, no supervisor
    gateway_cores = result["proxy_cpu_s"] / wall if wall else None
    result["gateway_cores"] = gateway_cores
    result["rps_per_gateway_core"] = result["rps"] / gateway_cores if gateway_cores else None
    return result


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
# profiling (--profile): where the gateway's CPU time goes


def run_profile(setup: Setup, args, meta: dict) -> dict:
    """Record the gateway (one worker) and bare mitmdump under load with py-spy (or, with
    --profile-tool cprofile or when py-spy cannot attach, the gateway under cProfile), and group the
    samples by what the code does (bench/profiling.py)."""
    import profiling

    out_dir = args.results / f"profile-{meta['stamp']}"
    out_dir.mkdir(parents=True, exist_ok=True)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    tool = args.profile_tool
    if tool == "py-spy" and not Path(pyspy).exists() and not shutil.which("py-spy"):
        raise BenchError("py-spy not found: /tmp/venv/bin/pip install py-spy (or --profile-tool cprofile)")
    results: dict = {"tool": tool, "duration": args.profile_seconds, "dir": str(out_dir), "runs": {}}
    for key in args.profile_configs:
        proxy = setup.proxies[key]
        for figure, keepalive in (("keepalive", True), ("newconn", False)):
            name = f"{key}-{figure}"
            raw_path = out_dir / f"{name}.raw"
            log(f"profile: {name} ({args.profile_seconds:g} s of hey -c {args.concurrency}, {tool})")
            hey = threading.Thread(target=lambda: results["runs"].setdefault(name, {}).update(
                hey=run_hey(setup, proxy, args.profile_seconds + 2, args.concurrency, keepalive)))
            hey.start()
            time.sleep(1.0)
            # --nonblocking: py-spy reads the stacks without stopping the process (stopping it 200 times
            # a second slowed the proxy under test by a third or more)
            spy = subprocess.run([pyspy, "record", "-p", str(proxy.pid), "-d", f"{args.profile_seconds:g}",
                                  "-r", "200", "-f", "raw", "-o", str(raw_path)]
                                 + (["--native"] if args.profile_native else ["--nonblocking"]),
                                 capture_output=True, text=True, timeout=args.profile_seconds + 60)
            hey.join()
            if spy.returncode != 0 or not raw_path.exists():
                raise BenchError(f"py-spy failed ({spy.returncode}): {(spy.stderr or spy.stdout).strip()[-800:]} "
                                 "— try --profile-tool cprofile")
            summary = profiling.summarise(raw_path.read_text())
            results["runs"][name].update(summary=summary, raw=str(raw_path))
            (out_dir / f"{name}.md").write_text(profiling.markdown(name, summary))
            h = results["runs"][name]["hey"]
            log(f"  {summary['samples']} samples; {h['rps']:.0f}/s during the recording; top groups: "
                + ", ".join(f"{g} {n / max(1, summary['samples']):.0%}" for g, n in list(summary["groups"].items())[:4]))
    return results


def run_cprofile(setup: Setup, args, meta: dict, tools: dict[str, str]) -> dict:
    """The gateway (one worker) under `python -m cProfile`, for a keep-alive then a new-connection run;
    stats are written when it exits on SIGTERM."""
    import pstats

    import profiling

    out_dir = args.results / f"profile-{meta['stamp']}"
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"tool": "cprofile", "duration": args.profile_seconds, "dir": str(out_dir), "runs": {}}
    for figure, keepalive in (("keepalive", True), ("newconn", False)):
        name = f"gateway-{figure}"
        prof = out_dir / f"{name}.prof"
        proxy = start_proxy(setup, "gateway", tools)
        # restart the same command under cProfile
        proxy.service.stop()
        cmd = proxy.cmd
        profiled = cmd[:1] + ["-m", "cProfile", "-o", str(prof)] + cmd[1:]
        service = Service(f"{name}-cprofile", setup.cpu(0) + setup.wrap_hosts + profiled,
                          setup.workdir / f"{name}-cprofile.log", env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)),
                          cwd=PROJECT_ROOT)
        service.start()
        proxy.service, proxy.pid = service, service.pid
        wait_for_port(proxy.host, proxy.port, service.proc)
        proxy.pid = python_pid(service.pid)
        log(f"profile: {name} under cProfile ({args.profile_seconds:g} s)")
        hey = run_hey(setup, proxy, args.profile_seconds, args.concurrency, keepalive)
        service.stop()
        stats = pstats.Stats(str(prof))
        summary = profiling.summarise_pstats(stats)
        results["runs"][name] = {"hey": hey, "summary": summary, "raw": str(prof)}
        (out_dir / f"{name}.md").write_text(profiling.markdown(name, summary))
    return results


# --------------------------------------------------------------------------------------------
# main


def git_info() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except OSError:
        return "unknown", False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short run: 2 rounds of 2 s, 20,000-rule policy instead of 100,000 (~6 min)")
    p.add_argument("--only", action="append", metavar="GROUP[,GROUP]",
                   help=f"run only these figure groups, of {', '.join(GROUPS)} (repeatable or comma-separated; "
                        "default: all; transparent is skipped with a warning when namespaces are unavailable)")
    p.add_argument("--configs", metavar="KEY[,KEY]",
                   help=f"configurations for the configs and idle groups, of {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--duration", type=float, help="seconds per throughput run of hey (default 4, quick 2)")
    p.add_argument("--concurrency", type=int, default=32, help="hey -c for the throughput runs")
    p.add_argument("--latency-duration", type=float, help="seconds per latency run (default 3, quick 2)")
    p.add_argument("--latency-rate", type=float, default=50.0,
                   help="keep-alive requests/s in the latency runs (hey -c 1 -q RATE): well below saturation")
    p.add_argument("--latency-conn-rate", type=float, default=10.0,
                   help="new connections/s in the latency runs (hey -c 1 -q RATE -disable-keepalive)")
    p.add_argument("--idle-tunnels", type=int, help="idle tunnels opened for the RSS figure (default 1000, quick 500)")
    p.add_argument("--scaling-quota", type=float,
                   help="CPU quota per gateway worker in the scaling figure, in cores (default 0.9·(CPUs−1)/N: N "
                        "workers together get 90%% of all CPUs but one, which is left to hey and nginx; with "
                        "--scaling-pin 0.9/N)")
    p.add_argument("--scaling-pin", action="store_true",
                   help="scaling figure: pin every gateway process to CPU 0 (hey and nginx keep CPU 1) instead of "
                        "letting the throttled workers run on every CPU")
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
                   help="stop starting new rounds after this many minutes (default 14, quick 3)")
    p.add_argument("--profile", action="store_true",
                   help="instead of the rounds: profile the gateway (1 worker) and bare mitmdump under keep-alive "
                        "and new-connection load, and group the samples (results/profile-*)")
    p.add_argument("--profile-tool", choices=("py-spy", "cprofile"), default="py-spy",
                   help="py-spy (attaches to the running proxy) or cProfile (runs the gateway under it)")
    p.add_argument("--profile-seconds", type=float, default=15.0, help="seconds recorded per profile")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames: OpenSSL, ...)")
    p.add_argument("--same-processes", action="store_true",
                   help="keep each proxy's process for the whole run instead of starting fresh ones every round")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temporary directory (logs, configs)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="where to write latest.md / latest.json")
    streaming.add_arguments(p)
    args = p.parse_args(argv)
    args.warmup = None
    q = args.quick
    defaults = {"rounds": (2, 5), "duration": (2.0, 4.0), "latency_duration": (2.0, 3.0),
                "rules": (20000, 100000), "policy_number": (20000, 20000),
                "policy_repeats": (5, 9), "max_minutes": (3.0, 14.0), "idle_tunnels": (500, 1000),
                "warmup": (0.5, 1.0)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.rounds < 1 or args.duration <= 0 or args.rules < 11 or args.policy_repeats < 1:
        p.error("--rounds, --duration and --policy-repeats must be positive and --rules above 10")
    if not args.origin_ip.startswith("127."):
        p.error("--origin-ip must be in 127.0.0.0/8: this benchmark sends traffic to loopback only")
    if args.latency_rate <= 0 or args.latency_conn_rate <= 0 or args.idle_tunnels < 1:
        p.error("--latency-rate, --latency-conn-rate and --idle-tunnels must be positive")
    args.only_given = bool(args.only)
    groups = [GROUP_ALIASES.get(g.strip(), g.strip()) for item in (args.only or [",".join(GROUPS)])
              for g in item.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"--only: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if args.skip_proxy:
        groups = [g for g in groups if g == "decision"]
    if args.skip_policy:
        groups = [g for g in groups if g != "decision"]
    if not groups and not args.profile:
        p.error("nothing to run (check --only, --skip-proxy and --skip-policy)")
    args.groups = [g for g in GROUPS if g in groups]
    configs = [c.strip() for c in (args.configs or ",".join(CONFIGS)).split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    args.configs = [c for c in CONFIGS if c in configs]
    args.profile_configs = ["gateway", "mitmdump"]
    return args


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# Configurations whose ratio is a target run back to back in every round (their order alternating),
# so that a burst of load from elsewhere on the machine hits both or neither.
ADJACENT = (("mitmdump", "gateway"), ("mitmdump_passthrough", "gateway_passthrough"))


def rotated(items: list, rnd: int) -> list:
    """Round `rnd`'s order: blocks (a pair from ADJACENT, or one configuration) rotate by the round
    number and reverse every other round, so that each takes every position; inside a pair the order
    alternates too."""
    blocks: list[list] = []
    for item in items:
        pair = next((p for p in ADJACENT if item in p), None)
        if pair and all(k in items for k in pair):
            if item == pair[0]:
                blocks.append(list(pair))
        else:
            blocks.append([item])
    if not blocks:
        return []
    shift = rnd % len(blocks)
    blocks = blocks[shift:] + blocks[:shift]
    if rnd % 2 and len(blocks) > 2:  # (two blocks: the rotation alone alternates them)
        blocks.reverse()
    return [k for block in blocks for k in (reversed(block) if rnd % 2 else block)]


def restart_proxies(setup: Setup, tools: dict[str, str], keys: list[str], bulk_keys: list[str], args) -> None:
    """Fresh processes for every round: one process can run a steady 10-20% faster or slower than
    another started the same way (memory layout, hash seeds, where the kernel put it), and with one
    process per configuration for the whole run that bias would be in every round. Restarted, it
    becomes round-to-round noise, which the medians and paired ratios deal with."""
    started = time.monotonic()
    for key in keys:
        proxy = setup.proxies.get(key)
        if proxy is None or proxy.service is None:
            continue
        proxy.service.stop()
        setup.proxies[key] = fresh = start_proxy(setup, key, tools)
        if key not in bulk_keys:  # a short warm-up, not counted (bulk downloads need none)
            run_hey(setup, fresh, args.warmup / 2, args.concurrency, True)
            run_hey(setup, fresh, args.warmup / 2, args.concurrency, False)
    log(f"fresh proxy processes for this round ({time.monotonic() - started:.0f} s)")


def note_failures(meta: dict, rnd: int, figure: str, key: str, res: dict) -> None:
    if res.get("failure_fraction", 0) > 0.001:
        what = (f"{res.get('non_200')} non-200 and {res['missing']} missing of {res['expected']} at the set rate"
                if "missing" in res else f"{res.get('non_200')} non-200 and {res.get('errors')} errors")
        meta["warnings"].append(f"round {rnd + 1} {figure} {key}: {what} ({res['failure_fraction']:.2%})")


def fmtn(value, digits: int = 1) -> str:
    return report.fmt(value, digits)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    import mitmproxy.version

    commit, dirty = git_info()
    groups = [] if args.profile else list(args.groups)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta: dict = {
        "format": 2,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "stamp": stamp,
        "mode": "profile" if args.profile else ("quick" if args.quick else "full"),
        "groups": groups or ["profile"],
        "rounds": args.rounds, "rounds_done": 0, "duration": args.duration, "concurrency": args.concurrency,
        "latency": {"duration": args.latency_duration, "rate": args.latency_rate, "conn_rate": args.latency_conn_rate,
                    "concurrency": 1},
        "idle_tunnels": args.idle_tunnels,
        "bulk_mb": args.bulk_mb, "commit": commit, "dirty": dirty, "mitmproxy": mitmproxy.version.VERSION,
        "python": platform.python_version(), "cpus": os.cpu_count(), "machine": machine_description(),
        "loadavg_start": loadavg(), "loadavg_rounds": [], "warnings": [], "skipped": {},
        "gateway_audit_log": args.gateway_audit_log, "nice": args.nice,
        "configs": [], "config_labels": {}, "commands": {},
    }
    raw: dict[str, list[dict]] = {}
    idle: dict[str, dict] = {}
    policy_result = None
    profile_result = None
    streaming_result = None

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="egress-bench-"))
    setup: Setup | None = None
    failed = False
    explicit = bool({"configs", "idle", "scaling", "bulk"} & set(groups)) or args.profile
    try:
        if "transparent" in groups and not args.profile:
            reason = transparent_unavailable()
            if reason:
                if args.only_given:
                    raise BenchError(f"transparent mode cannot run here: {reason}")
                meta["warnings"].append(f"transparent figures skipped: {reason}")
                log(f"transparent figures skipped: {reason}")
                groups.remove("transparent")
                meta["groups"] = groups
        proxy_groups = [g for g in groups if g != "decision"]
        if proxy_groups or args.profile:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft < 16384 <= hard:  # the proxies inherit it: 1,000 tunnels need 2,000+ descriptors
                resource.setrlimit(resource.RLIMIT_NOFILE, (16384, hard))
            pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
            tools = check_tools(origin_tools=args.profile or bool(set(proxy_groups) - {"streaming"}))
            if "nginx" in tools:
                meta["nginx"] = subprocess.run([tools["nginx"], "-v"], capture_output=True, text=True).stderr.strip()
            if "squid" in tools:
                meta["squid"] = subprocess.run([tools["squid"], "-v"], capture_output=True,
                                               text=True).stdout.splitlines()[0].strip()
            setup = Setup(workdir, args.origin_ip, pin, hosts_wrapper(workdir, args.origin_ip) if explicit else [],
                          nice=args.nice, gateway_audit=args.gateway_audit_log)
            setup.features = gateway_features(workdir, args.origin_ip)
            meta["gateway_features"] = {k: v or "supported" for k, v in setup.features.items()}
            meta["pinned"] = pin
            bulk_bytes = args.bulk_mb * 1_000_000
            log(f"work directory {workdir}; gateway: --workers "
                f"{'supported' if setup.features['workers'] is None else 'NOT supported'}, inspect: false "
                f"{'supported' if setup.features['passthrough'] is None else 'NOT supported'}")
            make_origin_files(setup, bulk_bytes if "bulk" in groups else 0)

            # which configurations each group needs
            wanted: list[str] = []
            if args.profile:
                wanted = list(args.profile_configs)
            if "configs" in groups:
                wanted += args.configs
            if "idle" in groups:
                wanted += [c for c in args.configs if c != "direct"]
            if "scaling" in groups:
                wanted += ["gateway", "gateway_workers"]
            if "bulk" in groups:
                # processes of their own: bare mitmdump keeps the memory of a buffered body, which would
                # distort the idle-tunnel figure of the configurations
                wanted += ["mitmdump_bulk", "gateway_bulk"] + ([] if args.no_stream_baseline else ["mitmdump_stream"])
            wanted = list(dict.fromkeys(wanted))
            optional = {"mitmdump_passthrough", "gateway_workers", "gateway_passthrough", "squid"}
            unsupported = {}
            if setup.features["workers"] is not None:
                unsupported["gateway_workers"] = setup.features["workers"]
            elif (os.cpu_count() or 1) < 2:
                unsupported["gateway_workers"] = "one CPU: N workers would be one worker"
            if setup.features["passthrough"] is not None:
                unsupported["gateway_passthrough"] = setup.features["passthrough"]
            if "squid" not in tools:
                unsupported["squid"] = "squid is not installed (apt-get install -y squid)"
            if wanted:
                log(f"explicit: origin https://{ORIGIN_NAME} on {args.origin_ip}:443 (nginx)")
                start_nginx(setup, "nginx", args.origin_ip, tools)
            for key in wanted:
                if key in unsupported:
                    meta["skipped"][key] = unsupported[key]
                    log(f"{key}: skipped: {unsupported[key]}")
                    continue
                try:
                    setup.proxies[key] = proxy = start_proxy(setup, key, tools)
                except BenchError as exc:
                    if key not in optional:
                        raise
                    meta["skipped"][key] = str(exc).splitlines()[0][:300]
                    log(f"{key}: skipped: {exc}")
                    continue
                meta["commands"][key] = proxy.cmd
                log(f"{key}: {proxy.url if proxy.service else 'no proxy'}"
                    + (f" (pid {proxy.pid}, {len(proxy.pids())} process(es))" if proxy.service else ""))
            if "transparent" in groups and not args.profile:
                setup.net = TransparentNet.new()
                setup.net.build()
                for role in ("mitmdump", "gateway"):
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
                for key in ("mitmdump_transparent", "gateway_transparent"):
                    setup.proxies[key] = proxy = start_proxy(setup, key, tools)
                    meta["commands"][key] = proxy.cmd
                    log(f"{key}: sandbox {proxy.sandbox_ns} -> :{proxy.port} (pid {proxy.pid})")

            configs = [c for c in args.configs if c in setup.proxies] if "configs" in groups else []
            idle_configs = [c for c in args.configs if c in setup.proxies and c != "direct"] if "idle" in groups else []
            meta["configs"] = [c for c in CONFIGS if c in setup.proxies]
            meta["config_labels"] = {k: p.label for k, p in setup.proxies.items()}
            scaling = []
            if "scaling" in groups:
                setup.quota = CpuQuota()
                meta["cpu_quota"] = setup.quota.describe()
                if "gateway_workers" not in setup.proxies or "gateway" not in setup.proxies:
                    why = meta["skipped"].get("gateway_workers", "the N-worker gateway is not running")
                    meta["skipped"]["scaling"] = why
                    log(f"scaling: skipped: {why}")
                elif not setup.quota.available:
                    meta["skipped"]["scaling"] = f"no CPU quota: {setup.quota.reason}"
                    log(f"scaling: skipped: no CPU quota ({setup.quota.reason})")
                else:
                    scaling = ["gateway", "gateway_workers"]
                    n = setup.proxies["gateway_workers"].workers
                    cpus = os.cpu_count() or 1
                    setup.scaling_pin = args.scaling_pin
                    cores_each = args.scaling_quota or round(0.9 * (1 if args.scaling_pin else cpus - 1) / n, 3)
                    meta["scaling"] = {"workers": n, "cores_each": cores_each, "quota": setup.quota.describe(),
                                       "pinned_to_cpu0": setup.pin and args.scaling_pin}
                    log(f"scaling: each worker held to {cores_each} CPU ({setup.quota.describe()})"
                        + ("; all gateway processes on CPU 0 during these runs" if setup.pin and args.scaling_pin
                           else "; the gateway's processes may run on every CPU during these runs"))

            if args.profile:
                if args.profile_tool == "cprofile":
                    profile_result = run_cprofile(setup, args, meta, tools)
                else:
                    profile_result = run_profile(setup, args, meta)
                groups = []

            transparent_keys = ["mitmdump_transparent", "gateway_transparent"] if "transparent" in groups else []
            bulk_keys = [k for k in ("mitmdump_bulk", "gateway_bulk", "mitmdump_stream") if k in setup.proxies] \
                if "bulk" in groups else []
            warm = list(dict.fromkeys(configs + idle_configs + scaling + transparent_keys + bulk_keys))
            if warm and not args.profile:
                log("warm-up (not counted)")
                for key in warm:
                    run_hey(setup, setup.proxies[key], args.warmup, args.concurrency, True)
                    run_hey(setup, setup.proxies[key], args.warmup, args.concurrency, False)

            for rnd in range(args.rounds if groups and proxy_groups else 0):
                if time.monotonic() > deadline:
                    meta["warnings"].append(f"time limit reached: stopped after {rnd} rounds")
                    break
                if not (configs or scaling or transparent_keys or bulk_keys):
                    break
                if rnd and not args.same_processes:
                    restart_proxies(setup, tools, warm, bulk_keys, args)
                meta["loadavg_rounds"].append(loadavg())
                log(f"round {rnd + 1}/{args.rounds}; load average {meta['loadavg_rounds'][-1]}")
                for figure, keepalive in (("keepalive", True), ("newconn", False)):
                    results = {}
                    for key in rotated(configs, rnd):
                        res = run_hey(setup, setup.proxies[key], args.duration, args.concurrency, keepalive)
                        note_failures(meta, rnd, figure, key, res)
                        results[key] = res
                        log(f"  {figure:9s} {key:22s} {res['rps']:9.1f}/s  cpu {fmtn(res.get('cpu_us_per_req'), 0)} "
                            f"µs/req  load-generator CPU {fmtn(res['loadgen_cpu_fraction'], 2)}")
                        time.sleep(0.3)
                    if results:
                        raw.setdefault(figure, []).append(results)
                for figure, keepalive, rate in (("latency_keepalive", True, args.latency_rate),
                                                ("latency_newconn", False, args.latency_conn_rate)):
                    results = {}
                    for key in rotated(configs, rnd + 1):
                        res = run_hey(setup, setup.proxies[key], args.latency_duration, 1, keepalive, rate=rate)
                        note_failures(meta, rnd, figure, key, res)
                        results[key] = res
                        s = sorted(res["samples_ms"])
                        log(f"  {figure:17s} {key:22s} {len(s):4d} at {rate:g}/s  p50 "
                            f"{fmtn(report.percentile(s, 50), 2)} ms  p99 {fmtn(report.percentile(s, 99), 2)} ms")
                        time.sleep(0.2)
                    if results:
                        raw.setdefault(figure, []).append(results)
                if scaling:
                    cores_each = meta["scaling"]["cores_each"]
                    for figure, keepalive in (("scaling_keepalive", True), ("scaling_newconn", False)):
                        results = {}
                        for key in rotated(scaling, rnd):
                            res = run_scaling(setup, setup.proxies[key], args.duration, args.concurrency, keepalive,
                                              cores_each)
                            note_failures(meta, rnd, figure, key, res)
                            results[key] = res
                            log(f"  {figure:17s} {key:22s} {res['rps']:9.1f}/s  quota used "
                                f"{', '.join(fmtn(q, 2) for q in res['quota_used'] or [])}  load-generator CPU "
                                f"{fmtn(res['loadgen_cpu_fraction'], 2)}")
                            time.sleep(0.3)
                        raw.setdefault(figure, []).append(results)
                if transparent_keys:
                    for figure, keepalive in (("transparent_keepalive", True), ("transparent_newconn", False)):
                        results = {}
                        for key in rotated(transparent_keys, rnd):
                            res = run_hey(setup, setup.proxies[key], args.duration, args.concurrency, keepalive)
                            note_failures(meta, rnd, figure, key, res)
                            results[key] = res
                            log(f"  {figure:21s} {key:22s} {res['rps']:9.1f}/s  cpu "
                                f"{fmtn(res.get('cpu_us_per_req'), 0)} µs/req")
                            time.sleep(0.3)
                        raw.setdefault(figure, []).append(results)
                if bulk_keys:
                    results = {}
                    for key in rotated(bulk_keys, rnd):
                        res = run_bulk(setup, setup.proxies[key], bulk_bytes)
                        results[key.removesuffix("_bulk")] = res
                        log(f"  bulk                  {key:22s} {res['mb_per_s']:8.1f} MB/s  RSS "
                            f"{res['rss_before_mib']:.0f} → peak {res['rss_peak_mib']:.0f} MiB "
                            f"(after {res['rss_after_mib']:.0f})")
                        time.sleep(0.5)
                    raw.setdefault("bulk", []).append(results)
                meta["rounds_done"] = rnd + 1

            if idle_configs:
                log(f"idle tunnels: {args.idle_tunnels} per configuration")
                for key in idle_configs:
                    try:
                        res = run_idle(setup, setup.proxies[key], args.idle_tunnels)
                    except BenchError as exc:
                        meta["warnings"].append(f"idle tunnels through {key}: {exc}")
                        log(f"  idle {key}: {exc}")
                        continue
                    idle[key] = res
                    if res["failed"]:
                        meta["warnings"].append(f"idle tunnels through {key}: {res['failed']} of "
                                                f"{args.idle_tunnels} failed: {res['errors']}")
                    log(f"  idle {key:22s} {res['tunnels']} open in {res['open_seconds']:.1f}s: RSS "
                        f"{res['rss_idle_mib']:.0f} → {res['rss_tunnels_mib']:.0f} MiB "
                        f"({fmtn(res['kib_per_tunnel'])} KiB/tunnel, {res['processes']} process(es))")

            if "streaming" in groups and not args.profile:
                streaming_result = streaming.run(sys.modules[__name__], setup, args, meta, tools)

            for proxy in setup.proxies.values():
                if proxy.service is None:
                    continue
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
    except (BenchError, RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"ERROR: {exc}")
        meta["warnings"].append(f"error: {exc}".splitlines()[0])
        failed = True
    finally:
        # Clean-up must not be cut short by a second Ctrl-C or SIGTERM: ignore both until it is done.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if setup is not None:
                for proxy in setup.proxies.values():
                    if proxy.service is not None:
                        proxy.service.stop()
                for nginx in setup.nginx.values():
                    nginx.stop()
                if setup.quota is not None:
                    left = setup.quota.destroy()
                    if left:
                        meta["warnings"].append(f"cgroups not removed: {left}")
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

    if "decision" in groups and not failed and not args.profile:
        try:
            # the proxies are stopped: the policy timing has the machine to itself
            if args.nice:
                os.nice(args.nice)
            log(f"policy decision cost: 10 and {args.rules:,} rules")
            policy_result = bench_policy([10, args.rules], args.policy_number, args.policy_repeats, args.origin_ip,
                                         deadline + 6 * 60)
        except KeyboardInterrupt:
            meta["warnings"].append("interrupted during the policy figure")
            failed = True

    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = loadavg()
    args.results.mkdir(parents=True, exist_ok=True)
    if args.profile:
        status = write_profile(args, meta, profile_result, failed)
        remove_workdir(args, workdir, setup, failed or status != 0)
        return status
    try:
        document = report.build_document(meta, raw, idle, policy_result, streaming_result)
        markdown = report.build_markdown(document)
    except Exception:
        dump = args.results / "crashed-raw.json"
        dump.write_text(json.dumps({"meta": meta, "raw": raw, "idle": idle, "policy": policy_result,
                                   "streaming": streaming_result}, indent=2,
                                   default=str))
        log(f"report failed; raw figures saved to {dump}")
        raise
    markdown += f"\nTotal time {meta['elapsed_s']:.0f} s; load average at end {meta['loadavg_end']}.\n"
    print(markdown)
    for name in ("latest", stamp):
        (args.results / f"{name}.md").write_text(markdown)
        (args.results / f"{name}.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    log(f"results: {args.results / 'latest.md'} and latest.json (also {stamp}.*)")
    try:
        import plot

        if plot.available():
            if plot.plot(document, args.results / f"{stamp}.png"):
                shutil.copyfile(args.results / f"{stamp}.png", args.results / "latest.png")
                log(f"plot: {args.results / 'latest.png'}")
        else:
            log("plot skipped: matplotlib is not installed (pip install matplotlib)")
    except Exception as exc:  # noqa: BLE001 - the plot is optional
        log(f"plot failed: {exc}")
    remove_workdir(args, workdir, setup, failed)
    return 1 if failed else 0


def remove_workdir(args, workdir: Path, setup: Setup | None, failed: bool) -> None:
    extra = setup.extra_dirs if setup else []
    if args.keep_workdir or failed:
        log(f"work directory kept: {workdir}" + (f" (and {', '.join(map(str, extra))})" if extra else ""))
        return
    shutil.rmtree(workdir, ignore_errors=True)
    for d in extra:
        shutil.rmtree(d, ignore_errors=True)


def write_profile(args, meta: dict, result: dict | None, failed: bool) -> int:
    import profiling

    if not result:
        log("profile: nothing recorded")
        return 1
    L = [f"# Profile — {meta['started']}", "",
         f"Commit {meta['commit']}{' (+ uncommitted changes)' if meta['dirty'] else ''}; {meta['machine']}; "
         f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}. Tool: {result['tool']}, "
         f"{result['duration']:g} s per recording, hey -c {args.concurrency}; the proxy pinned to CPU 0, hey and "
         f"nginx to CPU 1.", ""]
    for name, run in result["runs"].items():
        h = run.get("hey", {})
        L.append(f"{name}: {fmtn(h.get('rps'))} requests/s during the recording, proxy CPU "
                 f"{fmtn(h.get('cpu_us_per_req'), 0)} µs per request.")
        L.append("")
        L.append(profiling.markdown(name, run["summary"]))
    text = "\n".join(L)
    print(text)
    stamp = meta["stamp"]
    for name in ("profile-latest", f"profile-{stamp}"):
        (args.results / f"{name}.md").write_text(text)
        (args.results / f"{name}.json").write_text(json.dumps({"meta": meta, "profile": result}, indent=2,
                                                              default=str) + "\n")
    log(f"profile: {args.results / 'profile-latest.md'} (raw stacks in {result['dir']})")
    return 1 if failed else 0


def machine_description() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        total = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        total = 0
    return (f"{os.cpu_count()} × {model or 'unknown CPU'}, {total / 1024:.0f} GiB RAM, Linux {platform.release()}")


if __name__ == "__main__":
    sys.exit(main())
