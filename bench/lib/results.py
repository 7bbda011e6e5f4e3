"""What a run records: `RunMeta` (how it ran: parameters, machine, warnings, skips) and `Figures` (what it
measured). Typed fields instead of a dict of some thirty keys, so that a misspelt key fails where it is
written; `RunMeta.to_json()` gives the keys, in the order, that bench/report.py, bench/plot.py and saved
results (bench/results/*.json) have always read."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass, field, fields

from lib.environment import git_info, loadavg, machine_description

# Set only by some runs (e.g. no nginx version without the proxies): left out of the JSON while None.
_ONLY_WHEN_SET = {"nginx", "squid", "gateway_features", "pinned", "transparent_topology", "cpu_quota", "scaling",
                  "elapsed_s", "loadavg_end"}


@dataclass
class RunMeta:
    started: str
    stamp: str
    mode: str  # full | quick | profile
    groups: list[str]
    rounds: int
    duration: float
    concurrency: int
    latency: dict
    idle_tunnels: int
    bulk_mb: int
    commit: str
    dirty: bool
    mitmproxy: str
    python: str
    cpus: int | None
    machine: str
    loadavg_start: str
    gateway_audit_log: bool
    nice: int
    format: int = 2
    rounds_done: int = 0
    loadavg_rounds: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # configuration or figure -> why it did not run
    configs: list[str] = field(default_factory=list)
    config_labels: dict[str, str] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    nginx: str | None = None
    squid: str | None = None
    gateway_features: dict | None = None
    pinned: bool | None = None
    transparent_topology: dict | None = None
    cpu_quota: str | None = None
    scaling: dict | None = None
    elapsed_s: float | None = None
    loadavg_end: str | None = None

    # the order of the JSON keys (the order the dict this replaces was filled in)
    _ORDER = ("format", "started", "stamp", "mode", "groups", "rounds", "rounds_done", "duration", "concurrency",
              "latency", "idle_tunnels", "bulk_mb", "commit", "dirty", "mitmproxy", "python", "cpus", "machine",
              "loadavg_start", "loadavg_rounds", "warnings", "skipped", "gateway_audit_log", "nice", "configs",
              "config_labels", "commands", "nginx", "squid", "gateway_features", "pinned", "transparent_topology",
              "cpu_quota", "scaling", "elapsed_s", "loadavg_end")

    @classmethod
    def start(cls, args, groups: list[str]) -> "RunMeta":
        """The meta of a run starting now with these options; `groups` is kept (not copied), as the run
        drops a group it cannot run from it."""
        import mitmproxy.version

        commit, dirty = git_info()
        return cls(
            started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            stamp=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
            mode="profile" if args.profile else ("quick" if args.quick else "full"),
            groups=groups or ["profile"], rounds=args.rounds, duration=args.duration, concurrency=args.concurrency,
            latency={"duration": args.latency_duration, "rate": args.latency_rate,
                     "conn_rate": args.latency_conn_rate, "concurrency": 1},
            idle_tunnels=args.idle_tunnels, bulk_mb=args.bulk_mb, commit=commit, dirty=dirty,
            mitmproxy=mitmproxy.version.VERSION, python=platform.python_version(), cpus=os.cpu_count(),
            machine=machine_description(), loadavg_start=loadavg(), gateway_audit_log=args.gateway_audit_log,
            nice=args.nice)

    def to_json(self) -> dict:
        """The dict written as "meta" in results/*.json (the fields still None of _ONLY_WHEN_SET left out)."""
        assert set(self._ORDER) == {f.name for f in fields(self)}
        return {name: getattr(self, name) for name in self._ORDER
                if not (name in _ONLY_WHEN_SET and getattr(self, name) is None)}


@dataclass
class Figures:
    """What a run measured, as bench/report.py takes it: raw per-round results by figure, the idle-tunnel
    figure by configuration, and the decision, profile and streaming groups' results (None: not run)."""

    raw: dict[str, list[dict]] = field(default_factory=dict)
    idle: dict[str, dict] = field(default_factory=dict)
    policy: dict | None = None
    profile: dict | None = None
    streaming: dict | None = None
