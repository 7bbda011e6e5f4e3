"""Where a proxy's CPU time goes: group py-spy samples (collapsed stacks, `py-spy record -f raw`) by
what the code does. Used by `bench/run.py --profile`; also runnable on a saved file:

    python bench/profiling.py gw-keepalive.raw [more.raw ...]

Each sample is charged to one group: the innermost frame (leaf first) whose file matches a group below.
Frames of generic library code (re, enum, dataclasses, functools, typing, ...) match nothing and pass
the sample on to their caller, so a regular expression run by the gateway's checks counts as the
gateway's. The first matching rule wins, so the order matters (audit/metrics before the rest of the
gateway, TLS before the rest of mitmproxy).
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

GROUPS: list[tuple[str, re.Pattern]] = [
    # the gateway's stand-ins for mitmproxy's own functions count as what they stand in for (the
    # hooks and layers they call count as their own)
    ("mitmproxy hook dispatch", re.compile(r"^addons/hook_dispatch\.py")),
    # mitmproxy's Layer.handle_event, copied with one line changed (addons/layer_memory.py)
    ("mitmproxy connection and layer machinery", re.compile(r"^addons/layer_memory\.py")),
    ("audit log and metrics", re.compile(
        r"^(addons/metrics\.py|addons/audit_fields\.py|gateway/audit\.py|gateway/metrics\.py|gateway/redact\.py)")),
    ("the gateway's own checks and addons", re.compile(r"^(addons|gateway)/")),
    ("TLS (handshakes, encryption, certificates)", re.compile(
        r"^(ssl\.py|_ssl|mitmproxy/proxy/layers/tls\.py|mitmproxy/certs\.py|mitmproxy/addons/tlsconfig\.py|"
        r"mitmproxy/tls\.py|mitmproxy/net/tls\.py|OpenSSL/|cryptography/|mitmproxy_rs/.*tls)")),
    ("HTTP parsing, serialising and message objects", re.compile(
        r"^(mitmproxy/proxy/layers/http/|mitmproxy/net/http/|h11/|h2/|hpack/|hyperframe/|mitmproxy/http\.py|"
        r"mitmproxy/coretypes/|mitmproxy/flow\.py|http/)")),
    ("mitmproxy hook dispatch", re.compile(r"^(mitmproxy/addonmanager\.py|mitmproxy/hooks\.py|mitmproxy/eventsequence\.py)")),
    ("mitmproxy built-in addons", re.compile(r"^mitmproxy/addons/")),
    ("mitmproxy connection and layer machinery", re.compile(r"^mitmproxy/")),
    ("logging", re.compile(r"^logging/")),
    ("asyncio event loop and sockets", re.compile(r"^(asyncio/|selectors\.py|socket\.py)")),
]
OTHER = "other (interpreter, imports, generic library code)"
# Generic helpers: their time belongs to whoever called them (mitmproxy's runtime type checks of
# message fields, its strutils, ...), so they match no group and pass the sample up.
GENERIC = re.compile(r"^mitmproxy/utils/")
# The gateway's entry point: on every stack, so not worth listing by inclusive time.
ENTRY = re.compile(r"^(gateway/__main__\.py|gateway/cli\.py|addons/run_command\.py|addons/runner\.py)")

# Leaf frames of threads that wait (py-spy's record mode sometimes counts them as active, although
# their CPU time stays 0): an idle executor worker, a selector or a lock wait. Not CPU: left out.
IDLE_LEAVES = {
    ("_worker", "concurrent/futures/thread.py"),
    ("EpollSelector.select", "selectors.py"),
    ("select", "selectors.py"),
    ("Condition.wait", "threading.py"),
    ("Event.wait", "threading.py"),
    ("Thread._wait_for_tstate_lock", "threading.py"),
}

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::(?P<line>\d+))?\)$")


def parse(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """Collapsed stacks -> [(frames root..leaf as (function, file)), count]."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        if not stack.strip():  # py-spy --nonblocking could not read a consistent stack
            samples.append(([], int(count)))
            continue
        frames = []
        for raw in stack.split(";"):
            m = _FRAME.match(raw)
            frames.append((m.group("func"), m.group("file")) if m else (raw, ""))
        samples.append((frames, int(count)))
    return samples


def _short(file: str) -> str:
    """py-spy usually prints paths relative to sys.path; make site-packages and absolute ones so too."""
    for marker in ("site-packages/", "lib/python3."):
        if marker in file:
            rest = file.split(marker, 1)[1]
            return rest.split("/", 1)[1] if marker == "lib/python3." and "/" in rest else rest
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return file[len(root):] if file.startswith(root) else file


def group_of(frames: list[tuple[str, str]]) -> str:
    for func, file in reversed(frames):
        short = _short(file)
        if GENERIC.search(short):
            continue
        for name, pattern in GROUPS:
            if pattern.search(short):
                return name
    return OTHER


def summarise(text: str, top: int = 25) -> dict:
    samples = parse(text)
    total = sum(n for _, n in samples)
    groups: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    idle = sum(n for frames, n in samples if frames and (frames[-1][0], _short(frames[-1][1])) in IDLE_LEAVES)
    unreadable = sum(n for frames, n in samples if not frames)
    samples = [(frames, n) for frames, n in samples
               if frames and (frames[-1][0], _short(frames[-1][1])) not in IDLE_LEAVES]
    total = sum(n for _, n in samples)
    for frames, n in samples:
        groups[group_of(frames)] += n
        if frames:
            func, file = frames[-1]
            leaf[f"{func} ({_short(file)})"] += n
        seen = set()
        for func, file in frames:
            key = f"{func} ({_short(file)})"
            if key not in seen:
                seen.add(key)
                inclusive[key] += n
                if re.match(r"^(addons|gateway)/", _short(file)) and not ENTRY.search(_short(file)):
                    ours[key] += n
    return {
        "samples": total,
        "idle_samples_left_out": idle,
        "unreadable_samples_left_out": unreadable,
        "groups": {k: v for k, v in groups.most_common()},
        "top_self": leaf.most_common(top),
        "top_inclusive": inclusive.most_common(top),
        "gateway_inclusive": ours.most_common(top),
    }


def summarise_pstats(stats, top: int = 25) -> dict:
    """The same summary from cProfile statistics (pstats.Stats). cProfile keeps no stacks, so each
    function's own time goes to the group of its own file: generic library code lands in "other"
    instead of its caller's group, and C functions (ssl read/write, OpenSSL) appear as built-ins.
    Its clock is wall time and the recording includes the start-up (imports): a fallback only."""
    total = 0.0
    groups: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    cumulative: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    for (file, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():
        if "select.epoll" in func or func in ("<built-in method select.select>",):
            continue  # cProfile's clock is wall time: waiting for events is not CPU
        short = _short(file)
        if file == "~" and ("ssl" in func.lower() or "_ssl" in func):
            short = "_ssl"
        total += tt
        groups[group_of([(func, short)])] += tt
        key = f"{func} ({short}:{line})"
        own[key] += tt
        cumulative[key] += ct
        if re.match(r"^(addons|gateway)/", short) and not ENTRY.search(short) and func != "<module>":
            ours[key] += ct
    scale = 1000.0  # report milliseconds as "samples" so that markdown() can share the code
    return {
        "samples": int(total * scale),
        "groups": {k: int(v * scale) for k, v in groups.most_common()},
        "top_self": [(k, int(v * scale)) for k, v in own.most_common(top)],
        "top_inclusive": [(k, int(v * scale)) for k, v in cumulative.most_common(top)],
        "gateway_inclusive": [(k, int(v * scale)) for k, v in ours.most_common(top)],
        "unit": "ms of CPU (cProfile)",
    }


def markdown(name: str, summary: dict, top: int = 15) -> str:
    total = summary["samples"] or 1
    L = [f"### {name} — {summary['samples']} samples", "", "| group | share of samples |", "|---|---:|"]
    for group, n in summary["groups"].items():
        L.append(f"| {group} | {n / total:.1%} |")
    L.append("")
    left = [f"{summary[k]} {what}" for k, what in (
        ("idle_samples_left_out", "samples of waiting threads"),
        ("unreadable_samples_left_out", "samples whose stack py-spy could not read without stopping the process"))
        if summary.get(k)]
    if left:
        L.append(f"(Left out: {'; '.join(left)}.)")
        L.append("")
    L.append("Top functions by own time (leaf frame):")
    L.append("")
    L.append("| function | share |")
    L.append("|---|---:|")
    for key, n in summary["top_self"][:top]:
        L.append(f"| `{key}` | {n / total:.1%} |")
    L.append("")
    if summary["gateway_inclusive"]:
        L.append("The project's functions by inclusive time (the gateway's layer classes subclass mitmproxy's, so "
                 "their share includes the mitmproxy code they run):")
        L.append("")
        L.append("| function | share |")
        L.append("|---|---:|")
        for key, n in summary["gateway_inclusive"][:top]:
            L.append(f"| `{key}` | {n / total:.1%} |")
        L.append("")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(markdown(path, summarise(Path(path).read_text())))
