"""The gateway as a real process (`python -m gateway run`), started and stopped by tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.gateway_process import terminate
from tests.support.waiting import wait_for

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float = 20.0, process: subprocess.Popen | None = None) -> None:
    """Until a connection to host:port succeeds; RuntimeError at once if `process` exits first."""
    def listening() -> bool:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_for(listening, timeout, f"a listener on {host}:{port}")


@dataclass
class GatewayProcess:
    policy: Path | None
    workdir: Path
    host: str = "127.0.0.1"
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    upstream_ca: Path | None = None
    command_prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "ns"]

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.confdir = self.workdir / "confdir"
        self.audit_path = self.workdir / "audit.jsonl"
        self.log_path = self.workdir / "gateway.log"
        self.process: subprocess.Popen | None = None

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "gateway", "run", "--mode", f"regular@{self.host}:{self.port}",
               "--confdir", str(self.confdir), "--audit-log", str(self.audit_path)]
        if self.policy is not None:
            cmd += ["--policy", str(self.policy)]
        if self.upstream_ca is not None:
            cmd += ["--set", f"ssl_verify_upstream_trusted_ca={self.upstream_ca}"]
        return self.command_prefix + cmd + self.extra_args

    def start(self) -> "GatewayProcess":
        if not self.port:
            self.port = free_port(self.host)
        env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=PROJECT_ROOT)
        try:
            wait_for_port(self.host, self.port, process=self.process) if not self.command_prefix else self._wait_prefixed()
            wait_for(self.ca_cert.exists, 10, "the CA certificate")
        except Exception:
            self.stop()
            raise RuntimeError(f"gateway did not start:\n{self.log()}")
        return self

    def _wait_prefixed(self) -> None:
        probe = self.command_prefix + [sys.executable, "-c",
                                       f"import socket; socket.create_connection(({self.host!r}, {self.port}), 0.5)"]

        def listening() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}")
            return subprocess.run(probe, capture_output=True).returncode == 0

        wait_for(listening, 20, "the gateway to listen", interval=0.1)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        terminate(self.process)
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    audit_mark = 0  # the audit lines before the running test (`mark`)

    def mark(self) -> None:
        """Note where the running test's audit lines begin: a gateway shared by a module serves
        many tests, and a later test's client may get an earlier one's port back (seen: a POST's
        line matched with another test's GET of the same 127.0.0.1:port)."""
        self.audit_mark = len(self.audit())

    def audit_since_mark(self) -> list[dict]:
        return self.audit()[self.audit_mark:]

    def audit(self) -> list[dict]:
        if not self.audit_path.exists():
            return []
        text = self.audit_path.read_text()
        # A line being written may be read half-way (one write(2) is not atomic for a concurrent
        # read of a regular file): only lines already ended count, as a log shipper reads them.
        complete = text[:text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
