"""What this machine and this tree offer: the tools found, the commit, the CPUs, what the gateway supports."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from lib.configurations import gateway_policy_text
from lib.log import BenchError
from lib.names import PROJECT_ROOT


def check_tools(origin_tools: bool = True) -> dict[str, str]:
    found = {}
    for tool in ("nginx", "hey", "curl", "unshare", "squid"):
        path = shutil.which(tool) or (f"/usr/sbin/{tool}" if Path(f"/usr/sbin/{tool}").exists() else None)
        if not path:
            if tool == "squid" or (tool in ("nginx", "hey") and not origin_tools):
                continue  # optional: that configuration is skipped with a note; streaming needs neither
            hint = " (apt-get update && apt-get install -y nginx hey squid)" if tool in ("nginx", "hey") else ""
            raise BenchError(f"{tool} not found{hint}")
        found[tool] = path
    mitmdump = Path(sys.executable).parent / "mitmdump"
    found["mitmdump"] = str(mitmdump) if mitmdump.exists() else (shutil.which("mitmdump") or "")
    if not found["mitmdump"]:
        raise BenchError("mitmdump not found next to this Python nor on PATH")
    return found


def gateway_features(workdir: Path, origin_ip: str) -> dict:
    """What the gateway in this tree supports: `run --workers N`, and `inspect: false` rules (`check`
    must accept such a policy). Each is None when supported, else the reason it is not."""
    help_text = subprocess.run([sys.executable, "-m", "gateway", "run", "--help"], capture_output=True, text=True,
                               cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)), timeout=60)
    workers = None if "--workers" in help_text.stdout else "`gateway run --help` has no --workers"
    policy = workdir / "probe-passthrough-policy.yaml"
    policy.write_text(gateway_policy_text(origin_ip, passthrough=True))
    check = subprocess.run([sys.executable, "-m", "gateway", "check", str(policy)], capture_output=True, text=True,
                           cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)), timeout=60)
    passthrough = None if check.returncode == 0 else (
        "`gateway check` refuses a rule with inspect: false: "
        + (check.stdout + check.stderr).strip().splitlines()[-1][:200] if (check.stdout + check.stderr).strip()
        else f"`gateway check` exited {check.returncode}")
    return {"workers": workers, "passthrough": passthrough}


def git_info() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except OSError:
        return "unknown", False


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_description() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        total = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        total = 0
    return (f"{os.cpu_count()} × {model or 'unknown CPU'}, {total / 1024:.0f} GiB RAM, Linux {platform.release()}")
