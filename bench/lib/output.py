"""Writing a run's results: bench/results/latest.{md,json} and the stamped copies, the plot, the raw
figures when the report itself fails, and removing the work directory unless it should be kept."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import report  # bench/report.py
from lib.environment import loadavg
from lib.log import log
from lib.profile_runs import write_profile
from lib.results import Figures, RunMeta
from lib.session import Setup


def finish(args, meta: RunMeta, measured: Figures, started: float, workdir: Path, setup: Setup | None,
           failed: bool) -> int:
    """Write what the run measured (the report, or the profile) and clean up; the exit status."""
    meta.elapsed_s = round(time.monotonic() - started, 1)
    meta.loadavg_end = loadavg()
    args.results.mkdir(parents=True, exist_ok=True)
    if args.profile:
        status = write_profile(args, meta, measured.profile, failed)
        remove_workdir(args, workdir, setup, failed or status != 0)
        return status
    write_results(args, meta, measured)
    remove_workdir(args, workdir, setup, failed)
    return 1 if failed else 0


def write_results(args, meta: RunMeta, measured: Figures) -> None:
    """The report on stdout and in results/, its JSON document beside it, then the plot (optional)."""
    try:
        document = report.build_document(meta.to_json(), measured.raw, measured.idle, measured.policy,
                                         measured.streaming)
        markdown = report.build_markdown(document)
    except Exception:
        dump = args.results / "crashed-raw.json"
        dump.write_text(json.dumps({"meta": meta.to_json(), "raw": measured.raw, "idle": measured.idle,
                                    "policy": measured.policy, "streaming": measured.streaming}, indent=2,
                                   default=str))
        log(f"report failed; raw figures saved to {dump}")
        raise
    markdown += f"\nTotal time {meta.elapsed_s:.0f} s; load average at end {meta.loadavg_end}.\n"
    print(markdown)
    stamp = meta.stamp
    for name in ("latest", stamp):
        (args.results / f"{name}.md").write_text(markdown)
        (args.results / f"{name}.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    log(f"results: {args.results / 'latest.md'} and latest.json (also {stamp}.*)")
    write_plot(args.results, stamp, document)


def write_plot(results: Path, stamp: str, document: dict) -> None:
    try:
        import plot  # bench/plot.py

        if plot.available():
            if plot.plot(document, results / f"{stamp}.png"):
                shutil.copyfile(results / f"{stamp}.png", results / "latest.png")
                log(f"plot: {results / 'latest.png'}")
        else:
            log("plot skipped: matplotlib is not installed (pip install matplotlib)")
    except Exception as exc:  # noqa: BLE001 - the plot is optional
        log(f"plot failed: {exc}")


def remove_workdir(args, workdir: Path, setup: Setup | None, failed: bool) -> None:
    extra = setup.extra_dirs if setup else []
    if args.keep_workdir or failed:
        log(f"work directory kept: {workdir}" + (f" (and {', '.join(map(str, extra))})" if extra else ""))
        return
    shutil.rmtree(workdir, ignore_errors=True)
    for d in extra:
        shutil.rmtree(d, ignore_errors=True)
