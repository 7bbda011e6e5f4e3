"""The state of one run: where it works, what it started, how its processes are placed. Passed to
every part instead of module globals, so that each part says what it needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cpuquota import CpuQuota
from lib.processes import Service
from lib.procfs import process_tree


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
