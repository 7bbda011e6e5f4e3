"""The pieces of the --workers tests that other suites reuse (tests/passthrough imports them): a
gateway process started with `--workers N` that knows its worker processes, and clients that know
which worker accepted their connection (read from /proc, see procs.py)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import policy_text
from tests.e2e.helpers import Conn, Response, build_request, client_tls_context, extra_static_hosts
from tests.support.gateway import PROJECT_ROOT, GatewayProcess, free_port, wait_for_port

from . import procs

START_TIMEOUT = 60.0
TIMEOUT = 10.0

BASE_RULES = """
- id: web
  hosts: [allowed.test]
  schemes: [https, http]
- id: slow
  hosts: [slow.test]
  schemes: [http]
"""

# The policy the reload tests switch to: allowed.test is gone, api.test is in.
RELOADED_RULES = """
- id: web-v2
  hosts: [api.test]
  schemes: [https, http]
- id: slow
  hosts: [slow.test]
  schemes: [http]
"""


# --- a slow upstream ------------------------------------------------------------------------------


class SlowUpstream:
    """Plain HTTP on <block>.160:80: /slow/<seconds> answers after that long, anything else at once."""

    def __init__(self, host: str):
        self.host = host
        self.arrived = threading.Event()
        self.requests: list[str] = []
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                upstream.requests.append(self.path)
                delay = 0.0
                if self.path.startswith("/slow/"):
                    upstream.arrived.set()
                    delay = float(self.path.split("/")[2])
                time.sleep(delay)  # not synchronisation: the slow origin under test
                body = f"slow.test answered {self.path}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((host, 80), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.arrived.clear()
        self.requests.clear()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the gateway ------------------------------------------------------------------------------------


@dataclass
class WorkerGateway(GatewayProcess):
    """A gateway started with `--workers N` (workers=None: no flag at all, the default applies).

    `expect` is the number of processes that must end up listening: N worker processes (descendants of
    the supervisor), or, for 1, the started process itself."""

    workers: int | None = 2
    expect: int = 2
    env: dict[str, str | None] = field(default_factory=dict)  # None removes a variable
    metrics_port: int | None = None

    def command(self) -> list[str]:
        cmd = super().command()
        if self.workers is not None:
            cmd += ["--workers", str(self.workers)]
        if self.metrics_port is not None:
            cmd += ["--metrics", f"127.0.0.1:{self.metrics_port}"]
        return cmd

    def start(self) -> "WorkerGateway":
        if not self.port:
            self.port = free_port(self.host)
        env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), PYTHONUNBUFFERED="1")
        for name, value in self.env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        self._log = open(self.log_path, "ab")
        self.started_at = time.monotonic()
        self.ready_at = None
        self.process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=PROJECT_ROOT)
        self.started_ids: set[tuple[int, int]] = set()
        try:
            wait_for_port(self.host, self.port, timeout=START_TIMEOUT, process=self.process)
            if self.expect > 0:
                self.wait_serving(self.expect, START_TIMEOUT)
            procs.wait_for(self.ca_cert.exists, 10, what="the CA certificate")
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"gateway did not start ({exc}):\n{self.log()[-6000:]}") from None
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def worker_pids(self) -> list[int]:
        return procs.workers(self.pid, self.port)

    def serving_pids(self) -> list[int]:
        """The processes listening on the proxy port: the workers, or the single process."""
        return self.worker_pids() if self.expect > 1 else procs.listeners([self.pid], self.port)

    def wait_serving(self, count: int, timeout: float = 20.0) -> list[int]:
        def ready():
            if self.process.poll() is not None:
                raise AssertionError(f"gateway exited with {self.process.returncode}")
            pids = self.serving_pids()
            if len(pids) == count and (self.metrics_port is None
                                        or len(procs.listeners(pids, self.metrics_port)) == count):
                return pids
            return None

        pids = procs.wait_for(ready, timeout, what=f"{count} listening process(es) on port {self.port}")
        if getattr(self, "ready_at", None) is None:
            self.ready_at = time.monotonic()
        self.started_ids |= {procs.identity(p) for p in pids} - {None}
        return pids

    def settled_listeners(self, timeout: float = 30.0, quiet: float = 1.5) -> tuple[bool, list[int]]:
        """(does the started process itself listen, the listening descendants), once the set has not
        changed for `quiet` seconds (for tests that must not presume how many processes to expect)."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = (bool(procs.listeners([self.pid], self.port)), tuple(self.worker_pids()))
            if now != last:
                last, since = now, time.monotonic()
            elif (now[0] or now[1]) and time.monotonic() - since >= quiet:
                self.started_ids |= {procs.identity(p) for p in now[1]} - {None}
                return now[0], list(now[1])
            time.sleep(0.05)  # polling, not synchronisation: the set must stay unchanged for `quiet` s
        raise AssertionError(f"the listening processes did not settle: {last}")

    def descendant_ids(self) -> set[tuple[int, int]]:
        return {i for i in (procs.identity(p) for p in procs.descendants(self.pid)) if i}

    def stop(self) -> int | None:
        """SIGTERM the supervisor; then make sure no process this gateway started survives it
        (each is killed by its own pid, after checking it is still that same process)."""
        if self.process is None:
            return None
        known = set(getattr(self, "started_ids", set()))
        with contextlib.suppress(Exception):
            known |= self.descendant_ids()
        code = super().stop()
        for ident in known:
            if procs.running(ident):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(ident[0], signal.SIGKILL)
        return code

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def audit_entries(self) -> list[dict]:
        """Complete audit lines written so far (a line still being written is left out)."""
        if not self.audit_path.exists():
            return []
        data = self.audit_path.read_bytes()
        return [json.loads(line) for line in data.split(b"\n")[:-1] if line.strip()]

    def ca_digest(self) -> str:
        return hashlib.sha256(self.ca_cert.read_bytes()).hexdigest()


def make_gateway(workdir: Path, upstreams, pki, workers: int | None = 2, rules: str = BASE_RULES,
                 args: list[str] | None = None, expect: int | None = None, env: dict | None = None,
                 prefix: list[str] | None = None, metrics: bool = False) -> WorkerGateway:
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    write_policy(policy, upstreams, rules)
    return WorkerGateway(policy, workdir / "gw", extra_args=args or [], upstream_ca=pki.ca_cert,
                         command_prefix=prefix or [], workers=workers,
                         expect=expect if expect is not None else (workers or 1), env=env or {},
                         metrics_port=free_port() if metrics else None)


def write_policy(path: Path, upstreams, rules: str) -> None:
    """Write atomically (a rename), so a polling worker never reads half a file."""
    text = policy_text(upstreams, rules, extra_static_hosts({"slow.test": f"{upstreams.block}.160"}))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- clients that know which worker answered ----------------------------------------------------------


@dataclass
class Probe:
    worker: int
    client: str  # "ip:port" as the audit log names it
    status: int | None  # None: no HTTP answer (connection closed)
    reason: str | None
    body: bytes

    def __repr__(self) -> str:
        return f"Probe(worker={self.worker}, client={self.client}, status={self.status}, reason={self.reason})"


def open_conn(gateway: WorkerGateway, port: int | None = None) -> tuple[Conn, int]:
    """A TCP connection to the gateway (or its metrics port) and the pid of the process that accepted it."""
    port = port or gateway.port
    sock = socket.create_connection((gateway.host, port), timeout=TIMEOUT)
    sock.settimeout(TIMEOUT)
    conn = Conn(sock)
    try:
        pid = procs.owner(sock, port, gateway.serving_pids)
    except BaseException:
        conn.close()
        raise
    return conn, pid


def _answer(response: Response | None) -> tuple[int | None, str | None, bytes]:
    if response is None:
        return None, None, b""
    return response.status, response.egress_reason, response.body


def probe_http(gateway: WorkerGateway, host: str, path: str = "/") -> Probe:
    """One absolute-form plain-HTTP request on a fresh connection."""
    conn, pid = open_conn(gateway)
    with conn:
        try:
            response = conn.request("GET", f"http://{host}{path}", {"Host": host, "Connection": "close"})
        except (ConnectionError, OSError):
            response = None
        return Probe(pid, conn.client, *_answer(response))


def probe_https(gateway: WorkerGateway, host: str, path: str = "/", host_header: str | None = None) -> Probe:
    """CONNECT host:443, TLS (verified against the gateway's CA file) and one GET, on a fresh connection."""
    conn, pid = open_conn(gateway)
    with conn:
        conn.send(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        answer = conn.read_response(head_only=True)
        if answer.status != 200:
            if answer.header("Content-Length"):
                answer.body = conn.read_exactly(int(answer.header("Content-Length")))
            return Probe(pid, conn.client, *_answer(answer))
        context = client_tls_context(gateway, ["http/1.1"])
        tls = context.wrap_socket(conn.sock, server_hostname=host)
        tls.settimeout(TIMEOUT)
        inner = Conn(tls)
        inner.client = conn.client
        try:
            response = inner.request("GET", path, {"Host": host_header or host, "Connection": "close"})
        except (ConnectionError, OSError):
            response = None
        return Probe(pid, conn.client, *_answer(response))


def probe_until_every_worker(gateway: WorkerGateway, probe, pids: list[int] | None = None, at_least: int = 1,
                             max_probes: int = 200) -> list[Probe]:
    """Call probe() (fresh connection each time) until every worker answered `at_least` times."""
    pids = pids or gateway.serving_pids()
    results: list[Probe] = []
    while not all(sum(r.worker == p for r in results) >= at_least for p in pids):
        if len(results) >= max_probes:
            raise AssertionError(f"{max_probes} connections did not reach every worker {pids}: "
                                 f"{[r.worker for r in results]}")
        results.append(probe())
    return results


def by_worker(results: list[Probe]) -> dict[int, list[Probe]]:
    grouped: dict[int, list[Probe]] = {}
    for r in results:
        grouped.setdefault(r.worker, []).append(r)
    return grouped


def http_get_raw(conn: Conn, path: str) -> Response:
    """GET path on a connection to a metrics/health endpoint."""
    conn.send(build_request("GET", path, {"Host": "metrics", "Connection": "close"}))
    return conn.read_response()


def log_tail(gateway: WorkerGateway, lines: int = 40) -> str:
    return "\n".join(gateway.log().splitlines()[-lines:])


def egress_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=PROJECT_ROOT)


