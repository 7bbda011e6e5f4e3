"""Bringing a run up (tools, origins, every configuration its groups need, the namespaces, the CPU quota)
and down again, so that what is measured finds everything started and checked, and a failed run leaves
nothing behind."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cpuquota import CpuQuota
from lib.configurations import CONFIGS, OPTIONAL
from lib.environment import check_tools, gateway_features
from lib.log import BenchError, log
from lib.names import ORIGIN_NAME, TRANSPARENT_ORIGIN_IP
from lib.origin import hosts_wrapper, make_origin_files, start_nginx
from lib.proxies import start_proxy
from lib.results import RunMeta
from lib.session import Setup
from lib.transparent import TransparentNet


@dataclass
class Plan:
    """Which configurations each figure runs through, once everything is up."""

    configs: list[str] = field(default_factory=list)
    idle_configs: list[str] = field(default_factory=list)
    scaling: list[str] = field(default_factory=list)
    transparent_keys: list[str] = field(default_factory=list)
    bulk_keys: list[str] = field(default_factory=list)
    bulk_bytes: int = 0

    @property
    def warm(self) -> list[str]:
        """Every configuration measured in the rounds, once each (warmed up, then restarted every round)."""
        return list(dict.fromkeys(self.configs + self.idle_configs + self.scaling + self.transparent_keys
                                  + self.bulk_keys))


def prepare(args, meta: RunMeta, groups: list[str], workdir: Path) -> tuple[Setup, dict[str, str]]:
    """The tools and the run's Setup (nothing started yet but the gateway's feature probes)."""
    proxy_groups = [g for g in groups if g != "decision"]
    explicit = bool({"configs", "idle", "scaling", "bulk"} & set(groups)) or args.profile
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 16384 <= hard:  # the proxies inherit it: 1,000 tunnels need 2,000+ descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (16384, hard))
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    tools = check_tools(origin_tools=args.profile or bool(set(proxy_groups) - {"streaming"}))
    if "nginx" in tools:
        meta.nginx = subprocess.run([tools["nginx"], "-v"], capture_output=True, text=True).stderr.strip()
    if "squid" in tools:
        meta.squid = subprocess.run([tools["squid"], "-v"], capture_output=True, text=True).stdout.splitlines()[0].strip()
    setup = Setup(workdir, args.origin_ip, pin, hosts_wrapper(workdir, args.origin_ip) if explicit else [],
                  nice=args.nice, gateway_audit=args.gateway_audit_log)
    setup.features = gateway_features(workdir, args.origin_ip)
    meta.gateway_features = {k: v or "supported" for k, v in setup.features.items()}
    meta.pinned = pin
    return setup, tools


def start(setup: Setup, args, meta: RunMeta, groups: list[str], tools: dict[str, str]) -> Plan:
    """Start the origins and configurations `groups` need (Setup keeps them, for tear_down even when this
    fails half-way); what cannot run is a skip in `meta`."""
    plan = Plan(bulk_bytes=args.bulk_mb * 1_000_000)
    log(f"work directory {setup.workdir}; gateway: --workers "
        f"{'supported' if setup.features['workers'] is None else 'NOT supported'}, inspect: false "
        f"{'supported' if setup.features['passthrough'] is None else 'NOT supported'}")
    make_origin_files(setup, plan.bulk_bytes if "bulk" in groups else 0)
    _start_explicit(setup, args, meta, wanted_configs(args, groups), unsupported_configs(setup, tools), tools)
    if "transparent" in groups and not args.profile:
        _start_transparent(setup, meta, tools)
    plan.configs = [c for c in args.configs if c in setup.proxies] if "configs" in groups else []
    plan.idle_configs = [c for c in args.configs if c in setup.proxies and c != "direct"] if "idle" in groups else []
    meta.configs = [c for c in CONFIGS if c in setup.proxies]
    meta.config_labels = {k: p.label for k, p in setup.proxies.items()}
    if "scaling" in groups:
        plan.scaling = _set_up_scaling(setup, args, meta)
    plan.transparent_keys = ["mitmdump_transparent", "gateway_transparent"] if "transparent" in groups else []
    plan.bulk_keys = [k for k in ("mitmdump_bulk", "gateway_bulk", "mitmdump_stream") if k in setup.proxies] \
        if "bulk" in groups else []
    return plan


def wanted_configs(args, groups: list[str]) -> list[str]:
    """The explicit-mode configurations the selected groups measure, each once."""
    wanted: list[str] = []
    if args.profile:
        wanted = list(args.profile_configs)
    if "configs" in groups:
        wanted += args.configs
    if "idle" in groups:
        wanted += [c for c in args.configs if c != "direct"]
    if "scaling" in groups:
        wanted += ["gateway", "gateway_workers"]
    if "bulk" in groups:
        # processes of their own: bare mitmdump keeps the memory of a buffered body, which would
        # distort the idle-tunnel figure of the configurations
        wanted += ["mitmdump_bulk", "gateway_bulk"] + ([] if args.no_stream_baseline else ["mitmdump_stream"])
    return list(dict.fromkeys(wanted))


def unsupported_configs(setup: Setup, tools: dict[str, str]) -> dict[str, str]:
    """Configurations this machine or tree cannot run, each with the note the report gives."""
    unsupported = {}
    if setup.features["workers"] is not None:
        unsupported["gateway_workers"] = setup.features["workers"]
    elif (os.cpu_count() or 1) < 2:
        unsupported["gateway_workers"] = "one CPU: N workers would be one worker"
    if setup.features["passthrough"] is not None:
        unsupported["gateway_passthrough"] = setup.features["passthrough"]
    if "squid" not in tools:
        unsupported["squid"] = "squid is not installed (apt-get install -y squid)"
    return unsupported


def _start_explicit(setup: Setup, args, meta: RunMeta, wanted: list[str], unsupported: dict[str, str],
                    tools: dict[str, str]) -> None:
    if wanted:
        log(f"explicit: origin https://{ORIGIN_NAME} on {args.origin_ip}:443 (nginx)")
        start_nginx(setup, "nginx", args.origin_ip, tools)
    for key in wanted:
        if key in unsupported:
            meta.skipped[key] = unsupported[key]
            log(f"{key}: skipped: {unsupported[key]}")
            continue
        try:
            setup.proxies[key] = proxy = start_proxy(setup, key, tools)
        except BenchError as exc:
            if key not in OPTIONAL:
                raise
            meta.skipped[key] = str(exc).splitlines()[0][:300]
            log(f"{key}: skipped: {exc}")
            continue
        meta.commands[key] = proxy.cmd
        log(f"{key}: {proxy.url if proxy.service else 'no proxy'}"
            + (f" (pid {proxy.pid}, {len(proxy.pids())} process(es))" if proxy.service else ""))


def _start_transparent(setup: Setup, meta: RunMeta, tools: dict[str, str]) -> None:
    setup.net = TransparentNet.new()
    setup.net.build()
    for role in ("mitmdump", "gateway"):
        setup.net.add_sandbox(role)
    t = setup.net.topology
    meta.transparent_topology = {
        "gateway_ns": t.gw, "internet_ns": t.inet,
        "sandboxes": {r: f"{sb.ns} {sb.address} -> :{sb.proxy_port}" for r, sb in setup.net.sandboxes.items()},
        "origin": f"{TRANSPARENT_ORIGIN_IP}:443",
    }
    log(f"transparent: namespaces gateway {t.gw}, internet {t.inet}, sandboxes "
        f"{', '.join(sb.ns for sb in setup.net.sandboxes.values())}; origin https://{ORIGIN_NAME} on "
        f"{TRANSPARENT_ORIGIN_IP}:443 (nginx in {t.inet})")
    start_nginx(setup, "nginx-transparent", TRANSPARENT_ORIGIN_IP, tools, netns=t.inet)
    for key in ("mitmdump_transparent", "gateway_transparent"):
        setup.proxies[key] = proxy = start_proxy(setup, key, tools)
        meta.commands[key] = proxy.cmd
        log(f"{key}: sandbox {proxy.sandbox_ns} -> :{proxy.port} (pid {proxy.pid})")


def _set_up_scaling(setup: Setup, args, meta: RunMeta) -> list[str]:
    """The CPU quota for the scaling figure; its two configurations, or none (a skip) when it cannot run."""
    setup.quota = CpuQuota()
    meta.cpu_quota = setup.quota.describe()
    if "gateway_workers" not in setup.proxies or "gateway" not in setup.proxies:
        why = meta.skipped.get("gateway_workers", "the N-worker gateway is not running")
        meta.skipped["scaling"] = why
        log(f"scaling: skipped: {why}")
        return []
    if not setup.quota.available:
        meta.skipped["scaling"] = f"no CPU quota: {setup.quota.reason}"
        log(f"scaling: skipped: no CPU quota ({setup.quota.reason})")
        return []
    n = setup.proxies["gateway_workers"].workers
    cpus = os.cpu_count() or 1
    setup.scaling_pin = args.scaling_pin
    cores_each = args.scaling_quota or round(0.9 * (1 if args.scaling_pin else cpus - 1) / n, 3)
    meta.scaling = {"workers": n, "cores_each": cores_each, "quota": setup.quota.describe(),
                    "pinned_to_cpu0": setup.pin and args.scaling_pin}
    log(f"scaling: each worker held to {cores_each} CPU ({setup.quota.describe()})"
        + ("; all gateway processes on CPU 0 during these runs" if setup.pin and args.scaling_pin
           else "; the gateway's processes may run on every CPU during these runs"))
    return ["gateway", "gateway_workers"]


def tear_down(setup: Setup | None, meta: RunMeta) -> None:
    """Stop every process and remove the namespaces and cgroups; not cut short by a second Ctrl-C or
    SIGTERM (both ignored until it is done)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if setup is not None:
            for proxy in setup.proxies.values():
                if proxy.service is not None:
                    proxy.service.stop()
            for nginx in setup.nginx.values():
                nginx.stop()
            if setup.quota is not None:
                left = setup.quota.destroy()
                if left:
                    meta.warnings.append(f"cgroups not removed: {left}")
            if setup.net is not None:
                leftovers = setup.net.destroy()
                if leftovers:
                    meta.warnings.append(f"not cleaned up: {leftovers}")
                    log(f"WARNING: not cleaned up: {leftovers}")
                else:
                    log("transparent: namespaces and /etc/netns entries removed")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
