"""Starting, waiting for and pinning the processes of a run (origins, proxies, clients)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from lib.gateway_process import terminate
from lib.log import BenchError


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
        terminate(self.proc, grace=20, sig=self.stop_signal)
        self._log.close()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for clients: no proxy variables (explicit mode passes the proxy with -x)."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy"}}
    env.update(extra)
    return env


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
