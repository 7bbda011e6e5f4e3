"""What /proc says of a process: its memory, its CPU time, its command line, its descendants.
Read directly (no psutil) so that the benchmark runs with the project's own environment."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def memory(pids: list[int]) -> dict:
    rss = [rss_kib(p) for p in pids]
    pss = [pss_kib(p) for p in pids]
    return {"rss_kib": sum(v or 0 for v in rss), "pss_kib": sum(v or 0 for v in pss) if all(v is not None for v in pss)
            else None, "processes": len(pids)}
