"""Shared by the policy tooling tests: paths, running the CLI in-process."""

from __future__ import annotations

import contextlib
import io
import textwrap
from dataclasses import dataclass
from pathlib import Path

from gateway import cli

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "policies"
CASES = ROOT / "tests" / "policy_cases"

@dataclass
class Run:
    status: int
    stdout: str
    stderr: str


def run_cli(*argv: str) -> Run:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors
            status = exc.code
    return Run(status, out.getvalue(), err.getvalue())


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path
