"""Podman for the tests that build and run the real images, set up so that it works on a CI-like
machine (root, no Docker daemon, no systemd as PID 1, hybrid cgroups) and leaves the system's
container configuration alone.

Everything podman keeps lives under STATE (default /var/tmp/egress-gateway-tests/podman, override
with EGRESS_PODMAN_STATE): a containers.conf and a storage.conf of our own (pointed to by
CONTAINERS_CONF and CONTAINERS_STORAGE_CONF in the environment of every podman call), the image and
layer store (the build cache that makes a second run fast), the network definitions.

The settings, and why: runtime runc (crun refuses these hosts' hybrid cgroups); the cgroupfs cgroup
manager and the file events logger (no systemd); default ulimits no higher than this process's hard
limits (podman's own defaults fail with `setrlimit ... operation not permitted` without
CAP_SYS_RESOURCE; conmon also caps RLIMIT_NPROC at kernel.pid_max).

Network namespaces (`Netns`) are made here with a loopback only: a container joined to one
(`--network ns:PATH`) shares that loopback with the test's origins and clients and has no route off
the machine."""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import shutil
import subprocess
from pathlib import Path

from tests.support.netns import thread_inside

STATE = Path(os.environ.get("EGRESS_PODMAN_STATE", "/var/tmp/egress-gateway-tests/podman"))
RUNROOT = Path("/run/egress-gateway-tests/podman")
NETNS_DIR = Path("/run/netns")


def _hard_limit(kind: int, ceiling: int | None = None) -> int:
    hard = resource.getrlimit(kind)[1]
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    return min(hard, ceiling) if ceiling else hard


def _pid_max() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return None


def nproc_limit() -> int:
    """The RLIMIT_NPROC a container may get. A `--ulimit` option replaces default_ulimits, and podman
    then sets nproc to 1048576 itself: pass this with any --ulimit."""
    return _hard_limit(resource.RLIMIT_NPROC, _pid_max())


def containers_conf() -> str:
    nofile = _hard_limit(resource.RLIMIT_NOFILE)
    nproc = nproc_limit()
    return f"""\
# Written by tests/deploy/podman.py for the image tests; not the system's configuration.
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{STATE}/events.log"
tmp_dir = "{RUNROOT}/libpod"

[network]
network_backend = "netavark"
network_config_dir = "{STATE}/networks"
"""


def storage_conf() -> str:
    return f"""\
# Written by tests/deploy/podman.py for the image tests; not the system's configuration.
[storage]
driver = "overlay"
graphroot = "{STATE}/storage"
runroot = "{RUNROOT}/storage"
"""


def environment() -> dict[str, str]:
    """os.environ plus our two configuration files (written on first use)."""
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "networks").mkdir(exist_ok=True)
    for name, text in (("containers.conf", containers_conf()), ("storage.conf", storage_conf())):
        path = STATE / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return dict(os.environ, CONTAINERS_CONF=str(STATE / "containers.conf"),
                CONTAINERS_STORAGE_CONF=str(STATE / "storage.conf"))


def podman(*args: str, check: bool = True, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=environment(),
                            timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why podman cannot build and run images here, or None."""
    if os.geteuid() != 0:
        return "the image tests need root (rootful podman)"
    for tool in ("podman", "runc", "mmdebstrap", "git", "ip", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (bash .ci/setup --test installs it)"
    if not hasattr(os, "setns"):
        return "os.setns is unavailable (needs Python 3.12 on Linux)"
    try:
        info = podman("info", "--format", "{{.Host.OCIRuntime.Name}} {{.Store.GraphDriverName}}", check=False,
                      timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`podman info` does not work here: {exc}"
    if info.returncode != 0:
        return f"`podman info` does not work here: {info.stderr.strip()[-400:]}"
    return None


# --- network namespaces of our own ----------------------------------------------------------------


class Netns:
    """A network namespace with a loopback and nothing else: origins, clients and containers in it
    talk over 127.0.0.0/8 and cannot reach anything off the machine."""

    def __init__(self, prefix: str = "egi"):
        self.name = f"{prefix}{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.path = NETNS_DIR / self.name
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True, capture_output=True)

    @property
    def network(self) -> str:
        """podman's --network value that joins a container to this namespace."""
        return f"ns:{self.path}"

    @contextlib.contextmanager
    def inside(self):
        """Run the block with this thread in the namespace: sockets made here stay there for life."""
        with thread_inside(self.path):
            yield

    def run(self, *argv: str, timeout: float = 30, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], capture_output=True, text=True,
                              timeout=timeout, check=check)

    def popen(self, *argv: str) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def links(self) -> list[str]:
        out = subprocess.run(["ip", "-n", self.name, "-o", "link"], capture_output=True, text=True).stdout
        return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


# --- containers -----------------------------------------------------------------------------------


class Container:
    """A detached container of ours (`podman run -d`), removed by `remove()`."""

    def __init__(self, image: str, *run_args: str, command: tuple[str, ...] = (), prefix: str = "egi"):
        self.name = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.image = image
        podman("run", "-d", "--name", self.name, *run_args, image, *command, timeout=60)

    def exec(self, *argv: str, user: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        options = ["--user", user] if user else []
        return podman("exec", *options, self.name, *argv, check=False, timeout=timeout)

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def state(self) -> dict:
        import json
        return json.loads(podman("inspect", self.name).stdout)[0]["State"]

    def running(self) -> bool:
        return self.state().get("Running", False)

    def healthcheck(self) -> subprocess.CompletedProcess:
        """Run the image's HEALTHCHECK now (podman schedules it with systemd timers, absent here)."""
        return podman("healthcheck", "run", self.name, check=False, timeout=60)

    def kill(self, signal: str) -> None:
        podman("kill", "--signal", signal, self.name)

    def wait(self, timeout: float = 60) -> int:
        return int(podman("wait", self.name, timeout=timeout).stdout.strip().splitlines()[-1])

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", "--volumes", self.name, check=False)
