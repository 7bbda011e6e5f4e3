"""A PNG of a benchmark run: throughput and latency per configuration.

Optional: needs matplotlib, which is not a dependency of the project (`pip install matplotlib` into
the environment that runs the benchmark). bench/run.py calls `plot()` after every run and skips it
with a note when matplotlib is missing; it can also be run on a saved result:

    python bench/plot.py bench/results/latest.json [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot(document: dict, path: Path) -> bool:
    """Write the figure to `path`; False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = document.get("summary", {})
    labels = document.get("meta", {}).get("config_labels", {})
    order = [c for c in document.get("meta", {}).get("configs", [])]
    panels = []
    for figure, title, unit in (("keepalive", "Keep-alive HTTPS through a tunnel", "requests/s"),
                                ("newconn", "New connection + TLS per request", "connections/s")):
        medians = summary.get(figure, {}).get("rps", {}).get("median", {})
        if medians:
            panels.append(("bar", figure, title, unit, medians))
    latency = document.get("latency", {})
    if latency:
        panels.append(("latency", "latency", "Latency at a fixed moderate rate", "ms", latency))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.5))
    if len(panels) == 1:
        axes = [axes]
    for ax, (kind, figure, title, unit, data) in zip(axes, panels):
        if kind == "bar":
            names = [c for c in order if data.get(c) is not None]
            values = [data[c] for c in names]
            bars = ax.bar(range(len(names)), values, color=["#999999" if c == "direct" else "#3b75af" for c in names])
            ax.set_yscale("log")
            for bar, value in zip(bars, values):
                ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                            fontsize=8)
        else:
            names = [c for c in order if c in data.get("latency_keepalive", {})]
            xs = range(len(names))
            width = 0.2
            for offset, (fig_key, q, colour, name) in enumerate((
                    ("latency_keepalive", "p50_ms", "#3b75af", "keep-alive p50"),
                    ("latency_keepalive", "p99_ms", "#9ecae9", "keep-alive p99"),
                    ("latency_newconn", "p50_ms", "#e1812c", "new conn p50"),
                    ("latency_newconn", "p99_ms", "#f6c28b", "new conn p99"))):
                vals = [(data.get(fig_key, {}).get(c) or {}).get(q) or 0 for c in names]
                ax.bar([x + (offset - 1.5) * width for x in xs], vals, width, color=colour, label=name)
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([labels.get(c, c) for c in names], rotation=35, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    meta = document.get("meta", {})
    fig.suptitle(f"egress gateway benchmark {meta.get('started', '')} — commit {meta.get('commit', '?')}, "
                 f"{meta.get('cpus', '?')} CPUs, load {meta.get('loadavg_start', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "latest.json")
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else source.with_suffix(".png")
    if not available():
        sys.exit("matplotlib is not installed: pip install matplotlib")
    sys.exit(0 if plot(json.loads(source.read_text()), out) else 1)
