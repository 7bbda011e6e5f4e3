"""The gateway as a process (`python -m gateway run`, one listener on loopback) for the standalone
benchmarks and the noisy-neighbour world (bench/lib/noisy.py, bench/reuse.py). Standard library only,
so that it imports as `lib.gateway_process` (bench's scripts) and as `bench.lib.gateway_process` (the
tests that use bench's noisy world). The test suites' fixture with the same interface, and more
(audit marks, a gateway inside a namespace), is tests/support/gateway.py: bench imports nothing
from tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def terminate(process: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Stop a child the way the gateway is meant to stop (SIGTERM: it drains), killed if it takes
    longer than `grace` seconds."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@dataclass
class GatewayProcess:
    policy: Path | None
    workdir: Path
    host: str = "127.0.0.1"
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    upstream_ca: Path | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.confdir = self.workdir / "confdir"
        self.audit_path = self.workdir / "audit.jsonl"
        self.log_path = self.workdir / "gateway.log"
        self.process: subprocess.Popen | None = None

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "gateway", "run", "--mode", f"regular@{self.host}:{self.port}",
               "--confdir", str(self.confdir), "--audit-log", str(self.audit_path)]
        if self.policy is not None:
            cmd += ["--policy", str(self.policy)]
        if self.upstream_ca is not None:
            cmd += ["--set", f"ssl_verify_upstream_trusted_ca={self.upstream_ca}"]
        return cmd + self.extra_args

    def start(self, timeout: float = 20.0) -> "GatewayProcess":
        """Start it; returns once it accepts connections and its CA is written (RuntimeError with its
        log if it does not within `timeout` seconds)."""
        self.port = self.port or _free_port(self.host)
        env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=PROJECT_ROOT)
        deadline = time.monotonic() + timeout
        while not (self._listening() and self.ca_cert.exists()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway did not start:\n{self.log()}")
            time.sleep(0.05)  # polling the listener and the CA file: the only signs it is up
        return self

    def _listening(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> int | None:
        if self.process is None:
            return None
        terminate(self.process)
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def audit(self) -> list[dict]:
        """The audit lines written so far (a line being written is left out)."""
        if not self.audit_path.exists():
            return []
        text = self.audit_path.read_text()
        complete = text[:text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
