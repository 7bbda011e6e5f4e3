"""Coverage-guided fuzzing (atheris/libFuzzer) of the front-door parsers, a few seconds per target,
the targets side by side.

Skipped when atheris is not installed (it is not a test dependency of the project: `pip install
atheris`, a binary wheel). The targets and their properties are in atheris_targets.py; each run is
seeded, so a CI failure reproduces with the same command (printed on failure).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SCALE

pytest.importorskip("atheris")

HERE = Path(__file__).resolve().parent
SECONDS = max(1, int(3 * SCALE))
TARGETS = ("hostnames", "paths", "classify")


def test_atheris_targets(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    runs = {}
    for target in TARGETS:
        cmd = [sys.executable, str(HERE / "atheris_targets.py"), target, f"-max_total_time={SECONDS}",
               "-seed=1" if SCALE == 1 else "-seed=0", f"-artifact_prefix={tmp_path}/{target}-",
               "-print_final_stats=1"]
        runs[target] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              cwd=HERE.parents[1], env=env))
    failures = []
    for target, (cmd, process) in runs.items():
        _, stderr = process.communicate(timeout=SECONDS + 90)
        executed = re.search(r"stat::number_of_executed_units: (\d+)", stderr)
        print(f"atheris {target}: {executed.group(1) if executed else '?'} executions in {SECONDS}s")
        if process.returncode != 0:
            failures.append(f"{target} (exit {process.returncode}): {' '.join(cmd)}\n{stderr[-2500:]}")
    assert not failures, "\n\n".join(failures)
