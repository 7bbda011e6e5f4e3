#!/usr/bin/env python3
"""Egress gateway benchmark: the gateway side by side with direct access, bare mitmdump and squid, in one run.

    /tmp/venv/bin/python bench/run.py            # everything (~17 minutes)
    /tmp/venv/bin/python bench/run.py --quick    # smoke run (~5 minutes)
    /tmp/venv/bin/python bench/run.py --only configs,scaling --quick
    /tmp/venv/bin/python bench/run.py --profile  # where the gateway's time goes (py-spy), no rounds

Configurations (explicit mode, all on this machine, traffic only to 127.0.0.0/8), started once and kept
up for the whole run:
- direct: hey straight to the nginx origin over TLS (no proxy);
- mitmdump: bare mitmdump intercepting (no addon script, lazy connections, flow_detail=0);
- mitmdump passthrough: the same with ignore_hosts=.* (mitmproxy relays the TLS unread);
- gateway: `python -m gateway run --workers 1`, intercepting, its checks on;
- gateway N workers: `--workers N`, N = the number of CPUs (a supervisor and N processes on one port);
- gateway passthrough: one worker with a policy rule `inspect: false` (SNI checked, TLS relayed unread);
- squid: a plain CONNECT proxy (no caching, no ssl-bump), generated minimal squid.conf.
Every proxy gets a fresh process before every round but the first (--same-processes: not).
Figures: keep-alive HTTPS req/s through a CONNECT tunnel, new TLS connections/s (CONNECT + handshake per
request), latency at a fixed moderate rate (added to direct), proxy CPU per request (all its processes),
RSS (all processes) with 1,000 idle tunnels, the N-worker scaling (each worker held to a CPU quota),
plus transparent mode, bulk streaming and the policy decision cost. Rounds are interleaved (the order
rotates and reverses between rounds); every figure is a median over rounds, every ratio is taken
within this run. See bench/README.md.

This is not a test: pytest does not collect it (no test_*.py name, outside testpaths).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
for _path in (str(PROJECT_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from lib import cli, decision, output  # noqa: E402  (bench/lib: the parts of a run, one concern each)
from lib.proxy_run import run_with_proxies  # noqa: E402
from lib.results import Figures, RunMeta  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = cli.parse_args(argv, description=__doc__.split("\n\n")[0])
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    groups = [] if args.profile else list(args.groups)
    meta = RunMeta.start(args, groups)
    measured = Figures()
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="egress-bench-"))
    setup, failed = run_with_proxies(args, meta, measured, groups, workdir, deadline)
    if "decision" in groups and not failed and not args.profile:
        failed = decision.run_figure(args, meta, measured, deadline)
    return output.finish(args, meta, measured, started, workdir, setup, failed)


def _interrupt(signum, frame):
    """SIGTERM ends a run as Ctrl-C does: the processes are stopped and what was measured is written."""
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
