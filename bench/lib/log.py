"""One line of progress on stderr, stamped: the run's only log (stdout carries the report)."""

from __future__ import annotations

import datetime
import sys


class BenchError(RuntimeError):
    """Something the benchmark cannot go on without (a tool missing, a proxy that does not start)."""


def log(msg: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)
