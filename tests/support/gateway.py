"""The gateway as a real process (`python -m gateway run`), started and stopped by tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.gateway_process import GatewayProcess as BenchGatewayProcess
from tests.support.waiting import value_when, wait_for

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
class GatewayProcess(BenchGatewayProcess):
    """bench's gateway process (the command, the CA, stop, log and audit lines), with what the
    suites add: a command prefix (a gateway inside a namespace), waits on the one `wait_for`,
    audit marks."""

    command_prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "ns"]

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return self.command_prefix + super().command()

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

    audit_mark = 0  # the audit lines before the running test (`mark`)

    def mark(self) -> None:
        """Note where the running test's audit lines begin: a gateway shared by a module serves
        many tests, and a later test's client may get an earlier one's port back (seen: a POST's
        line matched with another test's GET of the same 127.0.0.1:port)."""
        self.audit_mark = len(self.audit())

    def audit_since_mark(self) -> list[dict]:
        return self.audit()[self.audit_mark:]

    def audit_lines(self, since: int = 0, count: int = 1, wait: float = 3.0, **match) -> list[dict]:
        """The audit lines after the first `since` whose fields equal `match`, once there are
        `count` of them (after `wait` s: as many as there are, for the caller's assertion to say
        what is missing)."""
        return value_when(lambda: [e for e in self.audit()[since:] if all(e.get(k) == v for k, v in match.items())],
                          lambda lines: len(lines) >= count, wait, interval=0.02)


class NamespacedGateway(GatewayProcess):
    """A GatewayProcess whose readiness is read from its own log ("... listening at ...", one line
    per mode) instead of probing with a new Python process per attempt, with a longer deadline:
    three mitmproxy processes starting at once on a small, busy machine can take a while."""

    START_TIMEOUT = 90.0

    def _wait_prefixed(self) -> None:
        modes = [arg for arg in self.command() if "@" in arg and not arg.startswith("-")]

        def listening() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}")
            return self.log().count(" listening at ") >= len(modes)

        wait_for(listening, self.START_TIMEOUT, f"a listening line for each of {modes}", interval=0.1)
