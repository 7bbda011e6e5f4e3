"""CPU quotas for single processes, with cgroups, for the benchmark's scaling figure.

Each limited process gets a cgroup of its own (`egress-bench-<pid of run.py>-<pid>`) under the CPU
controller's hierarchy: cgroup v2 (`cpu.max`) when the `cpu` controller is on the unified hierarchy
and can be enabled for children, else cgroup v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`). A quota of
`cores` means the process may use `cores` CPU-seconds per second, spread over whatever CPUs it may run
on. `destroy()` moves every process back to the root cgroup and removes the groups.

Both need root. Nothing here touches a cgroup the benchmark did not create.
"""

from __future__ import annotations

import os
from pathlib import Path


def _mounts() -> list[tuple[str, str, list[str]]]:
    found = []
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                found.append((parts[1], parts[2], parts[3].split(",")))
    except OSError:
        pass
    return found


def _probe(root: Path, name: str, value: str) -> None:
    """Write `value` to `name` of a throw-away cgroup under `root`: OSError when quotas cannot be set there."""
    probe = root / f"egress-bench-probe-{os.getpid()}"
    probe.mkdir()
    try:
        (probe / name).write_text(value)
    finally:
        probe.rmdir()


class CpuQuota:
    def __init__(self, period_us: int = 20_000):
        self.period_us = period_us
        self.kind: str | None = None  # "v2" | "v1"
        self.root: Path | None = None
        self.groups: dict[int, Path] = {}
        self.reason: str | None = None  # why quotas are unavailable
        self._detect()

    @property
    def available(self) -> bool:
        return self.kind is not None

    def describe(self) -> str:
        if self.kind == "v2":
            return f"cgroup v2 cpu.max at {self.root} (period {self.period_us} µs)"
        if self.kind == "v1":
            return f"cgroup v1 cpu.cfs_quota_us at {self.root} (period {self.period_us} µs)"
        return f"unavailable: {self.reason}"

    def _detect(self) -> None:
        if os.geteuid() != 0:
            self.reason = "needs root"
            return
        problems = []
        mounts = _mounts()
        for mountpoint, fstype, _ in mounts:
            if fstype != "cgroup2":
                continue
            root = Path(mountpoint)
            try:
                controllers = (root / "cgroup.controllers").read_text().split()
            except OSError as exc:
                problems.append(f"{root}: {exc}")
                continue
            if "cpu" not in controllers:
                problems.append(f"cgroup v2 at {root} has no cpu controller (controllers: {' '.join(controllers) or 'none'})")
                continue
            try:
                enabled = (root / "cgroup.subtree_control").read_text().split()
                if "cpu" not in enabled:
                    (root / "cgroup.subtree_control").write_text("+cpu")
                _probe(root, "cpu.max", f"max {self.period_us}")
            except OSError as exc:
                problems.append(f"cgroup v2 at {root}: cannot enable cpu for children ({exc})")
                continue
            self.kind, self.root = "v2", root
            return
        for mountpoint, fstype, opts in mounts:
            if fstype == "cgroup" and "cpu" in opts:
                root = Path(mountpoint)
                if not (root / "cpu.cfs_quota_us").exists():
                    problems.append(f"cgroup v1 at {root} has no cpu.cfs_quota_us (kernel without CFS bandwidth control)")
                    continue
                try:
                    _probe(root, "cpu.cfs_period_us", str(self.period_us))
                except OSError as exc:
                    problems.append(f"cgroup v1 at {root}: {exc}")
                    continue
                self.kind, self.root = "v1", root
                return
        self.reason = "; ".join(problems) or "no cgroup hierarchy with the cpu controller is mounted"

    def _group(self, pid: int) -> Path:
        group = self.groups.get(pid)
        if group is None:
            assert self.root is not None
            group = self.root / f"egress-bench-{os.getpid()}-{pid}"
            group.mkdir(exist_ok=True)
            if self.kind == "v1":
                (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cgroup.procs").write_text(str(pid))  # moves every thread of the process
            self.groups[pid] = group
        return group

    def limit(self, pid: int, cores: float) -> None:
        """Let process `pid` use at most `cores` CPU-seconds per second from now on."""
        group = self._group(pid)
        quota = max(1000, int(cores * self.period_us))
        if self.kind == "v2":
            (group / "cpu.max").write_text(f"{quota} {self.period_us}")
        else:
            (group / "cpu.cfs_quota_us").write_text(str(quota))

    def unlimit(self, pid: int) -> None:
        group = self.groups.get(pid)
        if group is None:
            return
        try:
            if self.kind == "v2":
                (group / "cpu.max").write_text(f"max {self.period_us}")
            else:
                (group / "cpu.cfs_quota_us").write_text("-1")
        except OSError:
            pass

    def stats(self, pid: int) -> dict[str, int]:
        """cpu.stat of the process's group: nr_periods, nr_throttled, throttled time (µs)."""
        group = self.groups.get(pid)
        if group is None:
            return {}
        out = {}
        try:
            for line in (group / "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[name] = int(value)
        except OSError:
            return {}
        if "throttled_time" in out:  # v1: ns
            out["throttled_usec"] = out.pop("throttled_time") // 1000
        return out

    def destroy(self) -> list[str]:
        """Move the processes back to the root group and remove ours; returns what could not be removed."""
        left = []
        for pid, group in list(self.groups.items()):
            try:
                for member in (group / "cgroup.procs").read_text().split():
                    try:
                        assert self.root is not None
                        (self.root / "cgroup.procs").write_text(member)
                    except OSError:
                        pass
                group.rmdir()
                del self.groups[pid]
            except FileNotFoundError:
                del self.groups[pid]
            except OSError as exc:
                left.append(f"{group}: {exc}")
        return left
