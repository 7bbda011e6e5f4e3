"""Fixtures for the load tests: a fast asyncio upstream (its own process), a gateway started for
load (module scope), an RSS/CPU sampler for the gateway process, and a higher RLIMIT_NOFILE.

Everything is on loopback, in the session's own block 127.X.0.0/24 (tests/conftest.py): the load
upstream takes 127.X.0.20:443 under the name `load.test`; the recording upstreams of the shared
fixture stay where they are (other.test is the forbidden destination the load tests must never
touch).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import policy_text
from tests.support.gateway import PROJECT_ROOT, GatewayProcess
from tests.support.waiting import value_when

LOAD_HOST = "load.test"
NOFILE = 65536


def pytest_configure(config):
    config.addinivalue_line("markers", "load: load test, 1,000 concurrent connections against one gateway "
                                       "(EGRESS_LOAD_SECONDS sets the hold time, default 20)")


def load_seconds() -> float:
    """The hold phase: EGRESS_LOAD_SECONDS (default 20; e.g. 120 for a longer soak)."""
    value = float(os.environ.get("EGRESS_LOAD_SECONDS", "20"))
    if not 1 <= value <= 3600:
        raise pytest.UsageError("EGRESS_LOAD_SECONDS must be between 1 and 3600")
    return value


@pytest.fixture(scope="session", autouse=True)
def raise_nofile():
    """1,000 tunnels are ~1,000 sockets here, ~2,000 in the gateway (client + upstream side) and
    ~1,000 in the load upstream; the child processes inherit this limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE
    try:
        if hard != resource.RLIM_INFINITY and hard < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))  # root may raise the hard limit
        elif soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --------------------------------------------------------------------------------------------
# the load upstream


@dataclass
class LoadUpstream:
    host: str
    port: int
    stats_path: Path
    process: subprocess.Popen
    stderr: object = None

    def stats(self) -> dict:
        return json.loads(self.stats_path.read_text())

    def wait_stats(self, predicate, timeout: float = 5.0) -> dict:
        """The stats once `predicate(stats)` holds (or the last ones after `timeout` s); the file is
        rewritten every 0.5 s."""
        return value_when(self.stats, predicate, timeout, interval=0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.stderr is not None:
            self.stderr.close()


@pytest.fixture(scope="session")
def load_upstream(pki, upstreams, tmp_path_factory) -> LoadUpstream:
    host = f"{upstreams.block}.120"  # .20-.23 belong to tests/credentials
    cert, key = pki.issue([LOAD_HOST], [host], stem=LOAD_HOST)
    workdir = tmp_path_factory.mktemp("load-upstream")
    stats = workdir / "stats.json"
    stderr = open(workdir / "stderr.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.load.upstream", "--host", host, "--port", "443", "--name", LOAD_HOST,
         "--cert", str(cert), "--key", str(key), "--stats", str(stats), "--max-seconds", "1800"],
        cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=stderr,
        env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)),
    )
    line = process.stdout.readline()
    if line.strip() != b"ready":
        process.kill()
        stderr.close()
        raise RuntimeError(f"load upstream did not start: {line!r} {(workdir / 'stderr.log').read_text()}")
    server = LoadUpstream(host, 443, stats, process, stderr)
    yield server
    server.stop()


# --------------------------------------------------------------------------------------------
# a gateway for load


def load_policy(upstreams, load_upstream: LoadUpstream) -> str:
    """load.test allows GET under /ok/ only (so /forbidden/... is a 403 path_not_allowed);
    other.test has no rule (CONNECT to it is a 403 no_rule)."""
    rules = f"""
    - id: load
      hosts: [{LOAD_HOST}]
      methods: [GET]
      paths: ["/ok/**"]
    """
    extra = f"# the load upstream\n    {LOAD_HOST}: [{load_upstream.host}]\n"
    return policy_text(upstreams, rules, extra)


def start_load_gateway(workdir: Path, upstreams, pki, load_upstream: LoadUpstream, args: list[str]) -> GatewayProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    policy.write_text(load_policy(upstreams, load_upstream))
    gateway = GatewayProcess(policy, workdir / "gw", extra_args=args, upstream_ca=pki.ca_cert)
    gateway.start()
    return gateway


def metrics_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:  # loopback only
        return response.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.fullmatch(rf"{re.escape(name)}(\{{(.*)\}})? (\S+)", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def healthz(url: str, timeout: float = 10.0) -> int:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


# --------------------------------------------------------------------------------------------
# sampling the gateway process


CLK_TCK = os.sysconf("SC_CLK_TCK")


def read_proc(pid: int) -> tuple[int, int, float, int]:
    """(VmRSS KiB, VmHWM KiB, CPU seconds user+system, open file descriptors) of a live process."""
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = -1
    return rss, hwm, cpu, fds


@dataclass
class Sampler:
    """Samples a process's RSS, CPU time and open descriptors every `interval` seconds in a thread."""

    pid: int
    interval: float = 0.1
    samples: list = field(default_factory=list)  # (monotonic, rss KiB, hwm KiB, cpu s, fds)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> tuple | None:
        try:
            row = (time.monotonic(), *read_proc(self.pid))
        except (OSError, ValueError, IndexError):
            return None
        self.samples.append(row)
        return row

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def between(self, start: float, end: float) -> list:
        return [s for s in self.samples if start <= s[0] <= end]

    def settled_rss(self, seconds: float = 1.5, timeout: float = 15.0) -> int:
        """RSS once it stops moving: the median of `seconds` worth of samples, waiting up to `timeout`
        for two consecutive windows to agree within 1 MiB."""
        deadline = time.monotonic() + timeout
        previous = None
        while True:
            start = time.monotonic()
            time.sleep(seconds)  # not synchronisation: the sampling window of the measurement
            window = sorted(s[1] for s in self.between(start, time.monotonic()))
            current = window[len(window) // 2] if window else read_proc(self.pid)[0]
            if previous is not None and abs(current - previous) <= 1024 or time.monotonic() > deadline:
                return current
            previous = current
