"""Time to match one request path against the glob of issue 14, old matcher against new (not a test;
see bench/README.md).

    .venv/bin/python bench/paths.py                 # about a minute, nearly all of it the old matcher
    .venv/bin/python bench/paths.py --old-max 60    # measure the old matcher further before extrapolating

The glob is `/packages/**/*-*-*.whl`. "old" is the regex the loader used to compile it to
(`gateway.globs.reference_regex`, Python's backtracking `re`); "new" is what the loader compiles it
to now (`gateway.globs.PathGlob`), measured twice: `match` as the gateway calls it, which refuses
these paths without reading them (they do not end in the glob's literal `.whl`), and the automaton
alone on the same path (`_run`), which is what a path that gets past the cheap checks costs. Paths:
`/packages/` followed by `a-a-a-...` (shape `a-`) or `-----...` (shape `-`, the old matcher's worst
of the shapes tried), neither matching. Sizes are KiB of path.

The old matcher is cubic in the path, so it is measured only while its next size is predicted (from
the exponent of the last two measured sizes) to take at most --old-max seconds; beyond, its time is
that prediction, marked `~`. Each new figure is the best of --repeats runs, the first on a cold
cache (a fresh compile); each ratio is old / new automaton, measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.globs import PathGlob, reference_regex  # noqa: E402

GLOB = "/packages/**/*-*-*.whl"
SIZES_KIB = (1, 2, 2.5, 4, 6, 8, 16, 32, 64)
SHAPES = {"a-": "a-", "-": "-"}


def path_of(shape: str, kib: float) -> str:
    head = "/packages/"
    size = round(kib * 1024)
    return head + (shape * size)[: size - len(head)]


def seconds(fn, arg) -> float:
    started = time.perf_counter()
    fn(arg)
    return time.perf_counter() - started


def best_of(make, arg, repeats: int) -> float:
    """Best of `repeats` runs of a fresh `make()`'s first call (cold) and its later ones (warm)."""
    matcher = make()
    return min(seconds(matcher if i else make(), arg) for i in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old-max", type=float, default=20.0, help="seconds one old match may be predicted to take")
    parser.add_argument("--repeats", type=int, default=5, help="runs per new figure (best of)")
    args = parser.parse_args()

    old = reference_regex(GLOB)
    print(f"glob {GLOB}; old: Python re (backtracking), new: gateway.globs.PathGlob\n")
    for name, shape in SHAPES.items():
        print(f"### path /packages/{name}{name}{name}...\n")
        print("| path KiB | old ms | new match µs | new automaton ms | old / new automaton |")
        print("|---:|---:|---:|---:|---:|")
        measured: list[tuple[int, float]] = []
        for kib in SIZES_KIB:
            path = path_of(shape, kib)
            assert PathGlob(GLOB).match(path) is False and PathGlob(GLOB)._run(path) is False
            if len(measured) >= 2:
                (n1, t1), (n2, t2) = measured[-2:]
                exponent = math.log(t2 / t1) / math.log(n2 / n1)
                predicted = t2 * (len(path) / n2) ** exponent
            else:
                exponent, predicted = None, 0.0
            if predicted <= args.old_max:
                t_old = seconds(old.match, path)
                measured.append((len(path), t_old))
                old_text = f"{t_old * 1000:,.0f}"
            else:
                t_old = predicted
                old_text = f"~{t_old * 1000:,.0f} (n^{exponent:.1f})"
            t_match = best_of(lambda: PathGlob(GLOB).match, path, args.repeats)
            t_run = best_of(lambda: PathGlob(GLOB)._run, path, args.repeats)
            print(
                f"| {kib:g} | {old_text} | {t_match * 1e6:.1f} | {t_run * 1000:.2f} | {t_old / t_run:,.0f} |",
                flush=True,
            )
        print()


if __name__ == "__main__":
    main()
