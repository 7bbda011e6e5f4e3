"""`egress-gateway run`: the gateway itself (mitmproxy embedded with the egress addons).

This is the composition root, the one place where the pure core (`gateway/`) meets mitmproxy and
the adapters, so it lives here and not in `gateway/`: the CLI finds it through the
`egress_gateway.commands` entry point (pyproject.toml). Importing this module imports no
mitmproxy: a `run --workers N` supervisor never needs it (~70 MiB for its whole life).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import re
import socket
import subprocess
import sys

from gateway.audit import DEFAULT_MAX_BYTES, AuditLog
from gateway.commands import EXIT_INVALID
from gateway.control import DEFAULT_SOCKET
from gateway.options import OPTIONS
from gateway.policy import PolicyError, load_default_policy, load_policy
from gateway.workers import MAX_WORKERS, WORKERS_ENV, Supervisor, default_workers, log_to_stderr, worker_index

DEFAULT_MODE = "regular@127.0.0.1:8080"
DEFAULT_CONFDIR = "~/.mitmproxy"


def register(sub) -> None:
    run = sub.add_parser(
        "run",
        help="run the gateway",
        description="Run the gateway (mitmproxy embedded, with the egress addons) until SIGINT/SIGTERM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument(
        "--policy", metavar="PATH", default=None,
        help="policy YAML file; without it the embedded default policy (policies/default.yaml) is used",
    )
    run.add_argument(
        "--mode", metavar="SPEC", action="append", default=None,
        help=f"mitmproxy mode spec, repeatable (default: {DEFAULT_MODE}); supported: regular@HOST:PORT "
        "(explicit proxy), transparent@HOST:PORT (redirected traffic), dns@HOST:PORT (the sandbox's resolver)",
    )
    run.add_argument(
        "--confdir", metavar="DIR", default=DEFAULT_CONFDIR,
        help="where the gateway's CA lives (created on first start): DIR/mitmproxy-ca-cert.pem is the "
        "certificate sandboxes must trust",
    )
    run.add_argument(
        "--audit-log", metavar="PATH|-", default=None,
        help="append one JSON line per decision to PATH ('-' for stdout)",
    )
    run.add_argument(
        "--set", metavar="NAME=VALUE", action="append", default=[], dest="setoptions",
        help="set any mitmproxy option, e.g. ssl_verify_upstream_trusted_ca=PATH (repeatable); options "
        "that would weaken the gateway (connection_strategy, rawtcp, ssl_insecure, ignore_hosts, ...) are "
        "forced back to safe values",
    )
    run.add_argument(
        "--metrics", metavar="HOST:PORT", default=None,
        help="serve /metrics (Prometheus), /healthz and /readyz on HOST:PORT (an IP address, [::1]:PORT for "
        "IPv6); the address is never reachable through the proxy (docs/metrics.md)",
    )
    run.add_argument(
        "--audit-chain", action="store_true",
        help="hash-chain the audit log: each line carries 'prev', the SHA-256 of the previous line "
        "(check with `egress-gateway audit verify`)",
    )
    run.add_argument(
        "--audit-max-bytes", metavar="N", type=_non_negative_int, default=argparse.SUPPRESS,
        help=f"rotate the audit log file before it would exceed N bytes (PATH -> PATH.1 -> ...); 0: never "
        f"(default: {DEFAULT_MAX_BYTES}, 100 MiB, for a file; stdout does not rotate)",
    )
    run.add_argument(
        "--audit-backups", metavar="K", type=_positive_int, default=OPTIONS["egress_audit_backups"].default,
        help="rotated audit log files to keep with --audit-max-bytes",
    )
    run.add_argument(
        "--drain-timeout", metavar="SECONDS", type=_non_negative_float, default=OPTIONS["egress_drain_timeout"].default,
        help="on SIGTERM/SIGINT, stop accepting and wait up to SECONDS for in-flight requests, then exit 0",
    )
    run.add_argument(
        "--workers", metavar="N", type=_workers, default=argparse.SUPPRESS,
        help="gateway processes sharing the listening ports (SO_REUSEPORT), one core each; with N > 1 a "
        "supervisor restarts dead workers, passes SIGHUP on, merges metrics and writes the one audit log "
        f"(default: ${WORKERS_ENV}, else the usable CPU cores; see docs/deploy.md)",
    )
    control = run.add_argument_group("control API (docs/control-api.md)")
    control.add_argument(
        "--control", metavar="unix:PATH|HOST:PORT", default=None,
        help="serve the control API (register sandboxes, grants) on a unix socket (mode 0600; 'unix' alone: "
        f"{DEFAULT_SOCKET}) or on HOST:PORT with --control-token-file; never reachable through the proxy",
    )
    control.add_argument("--control-token-file", metavar="PATH", default=None,
                         help="NAME:TOKEN lines: bearer tokens the control API accepts, each naming its principal")
    control.add_argument("--control-group", metavar="GROUP", default=None,
                         help="group that may use the control socket (mode 0660 instead of 0600)")
    control.add_argument("--control-max-sandboxes", metavar="N", type=_positive_int, default=argparse.SUPPRESS,
                         help=f"most sandboxes registered at once (default {OPTIONS['egress_control_max_sandboxes'].default})")
    control.add_argument("--control-max-grants", metavar="N", type=_positive_int, default=argparse.SUPPRESS,
                         help=f"most grants one registered sandbox holds at once (default {OPTIONS['egress_control_max_grants'].default})")
    control.add_argument("--control-rate", metavar="PER_SECOND", default=argparse.SUPPRESS,
                         help=f"control API requests a second per principal, 0: no limit (default "
                         f"{OPTIONS['egress_control_rate'].default})")
    run.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    run.set_defaults(func=main)


def _workers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{text}: must be from 1 to {MAX_WORKERS}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return value


def main(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy) if args.policy else load_default_policy()
    except PolicyError as exc:
        print(f"egress-gateway: invalid policy:\n{exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        workers = getattr(args, "workers", None) or default_workers()
    except ValueError as exc:
        print(f"egress-gateway: {exc}", file=sys.stderr)
        return EXIT_INVALID
    modes = args.mode or [DEFAULT_MODE]
    if workers > 1 and worker_index() is None:
        if all(_is_dns(mode) for mode in modes):
            workers = 1  # DNS mode is UDP and runs in one worker only: nothing to share
        elif any(_is_dns(mode) for mode in modes) and _tcp_rules_name_hosts(policy):
            # Such a rule allows a redirected connection by what the gateway's DNS answered its
            # client, and those answers are in the one worker that runs DNS mode: a connection the
            # kernel gave another worker was refused `no_rule` (review 37: 4 of 10 relayed with
            # --workers 2). One worker, until the answers are shared between workers.
            print(f"egress-gateway: running one worker, not {workers}: DNS mode runs in one worker, and a "
                  "protocol: tcp rule names a host (allowed by that worker's DNS answers)", file=sys.stderr)
            workers = 1
        else:
            return supervise(args, modes, workers)
    from .runner import run_gateway  # mitmproxy is imported only when running

    return run_gateway(
        policy_path=args.policy or "",
        modes=modes,
        confdir=args.confdir,
        audit_log=args.audit_log,
        set_options=args.setoptions,
        quiet=args.quiet,
        policy_sha256=policy.sha256,
        extra=args,
    )


def operational_options(extra) -> dict:
    """The mitmproxy options behind `egress-gateway run`'s flags (gateway/options.py `flag`), for the
    flags given; --policy and --audit-log are passed on by name."""
    if extra is None:
        return {}
    found = {}
    for option in OPTIONS.values():
        if option.flag and option.name not in ("egress_policy", "egress_audit_log"):
            value = getattr(extra, option.flag.removeprefix("--").replace("-", "_"), None)
            if value is not None:
                found[option.name] = value
    return found


# --- run --workers N (N > 1): the supervisor -------------------------------------------------------


def _is_dns(mode: str) -> bool:
    return mode.split("@", 1)[0].split(":", 1)[0] == "dns"


def _tcp_rules_name_hosts(policy) -> bool:
    """Whether a `protocol: tcp` rule names a host (not an address or a network)."""
    for rule in policy.rules:
        if rule.protocol != "tcp":
            continue
        for pattern in rule.hosts:
            if pattern.kind != "network" and not _is_address(pattern.value):
                return True
    return False


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def _with_port(spec: str, kind: str) -> str:
    """A spec ending in port 0 gets a free port now: every worker must bind the same one."""
    match = re.fullmatch(r"(?P<head>.*?)(?P<host>\[[^\]]*\]|[^:@\[\]]*):0", spec)
    if not match:
        return spec
    host = match["host"].strip("[]") or "0.0.0.0"
    if host == "localhost":
        host = "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"{spec[:-1]}{port}"


def worker_command(args: argparse.Namespace, modes: list[str], index: int, audit_fd: int | None) -> list[str]:
    """The command line of worker `index`: the same gateway, one process, audit lines to a pipe."""
    cmd = [sys.executable, "-m", "gateway", "run", "--workers", "1", "--confdir", args.confdir,
           "--drain-timeout", repr(args.drain_timeout)]
    if args.policy:
        cmd += ["--policy", args.policy]
    for mode in modes:
        if index == 0 or not _is_dns(mode):
            cmd += ["--mode", mode]
    if audit_fd is not None:
        cmd += ["--audit-log", f"fd:{audit_fd}"]
    if args.metrics:
        cmd += ["--metrics", args.metrics]
    for option in args.setoptions:
        cmd += ["--set", option]
    if args.quiet:
        cmd.append("-q")
    return cmd


def supervise(args: argparse.Namespace, modes: list[str], workers: int) -> int:
    log_to_stderr(args.quiet)
    try:
        modes = [_with_port(m, "udp" if _is_dns(m) else "tcp") for m in modes]
        if args.metrics:
            args.metrics = _with_port(args.metrics, "tcp")
    except OSError as exc:
        print(f"egress-gateway: cannot pick a free port: {exc}", file=sys.stderr)
        return 1
    audit = None
    if args.audit_log:
        max_bytes = getattr(args, "audit_max_bytes", None)
        if max_bytes is None:
            max_bytes = 0 if args.audit_log == "-" else DEFAULT_MAX_BYTES
        try:
            audit = AuditLog(args.audit_log, chain=args.audit_chain, max_bytes=max_bytes,
                             backups=args.audit_backups)
        except OSError as exc:
            print(f"egress-gateway: cannot open audit log {args.audit_log}: {exc.strerror}", file=sys.stderr)
            return 1
        if max_bytes and args.audit_log == "-":
            print("egress-gateway: audit log rotation (--audit-max-bytes) needs a file, not stdout", file=sys.stderr)
            return 2
    # The CA is made by a short-lived child: importing mitmproxy would cost the supervisor, which
    # serves nothing, ~70 MiB for its whole life.
    prepare = subprocess.run(
        [sys.executable, "-c", "import sys; from addons.runner import prepare_confdir; sys.exit(prepare_confdir(sys.argv[1]))",
         args.confdir], capture_output=True, text=True,
    )
    if prepare.returncode == EXIT_INVALID:  # an untested mitmproxy: the child said why
        print(prepare.stderr.strip(), file=sys.stderr)
        return EXIT_INVALID
    if prepare.returncode != 0:
        why = (prepare.stderr.strip().splitlines() or ["unknown error"])[-1]
        print(f"egress-gateway: cannot prepare the CA in {args.confdir}: {why}", file=sys.stderr)
        return 1
    supervisor = Supervisor(workers, lambda index, fd: worker_command(args, modes, index, fd), audit=audit,
                            drain_timeout=args.drain_timeout)
    control = None
    if args.control:
        try:
            control = _supervisor_control(args, supervisor, modes)
        except (ValueError, OSError, KeyError) as exc:
            print(f"egress-gateway: --control: {exc}", file=sys.stderr)
            return 1
    try:
        return supervisor.run()
    finally:
        if control is not None:
            control.stop()


class _PolicyWatch:
    """The supervisor's view of the policy, for validating control requests and explaining: the
    file re-read when the workers re-read it: when its identity changes, looked at most every
    `poll` seconds (egress_policy_poll), and on SIGHUP (`reload`); with `poll` 0, only on SIGHUP
    (review 26: it polled anyway, and explained by a policy no worker had loaded). An invalid new
    version keeps the old one, as the workers do."""

    def __init__(self, path: str | None, policy, poll: float = 1.0):
        self.path, self.policy, self.poll = path, policy, poll
        self._seen = self._stat()
        self._checked = 0.0

    def reload(self) -> None:
        self._seen = None
        self._checked = 0.0
        self._load()

    def _load(self) -> None:
        seen = self._stat()
        if seen != self._seen:
            self._seen = seen
            try:
                self.policy = load_policy(self.path)
            except PolicyError:
                pass

    def _stat(self):
        import os

        try:
            st = os.stat(self.path) if self.path else None
        except OSError:
            return None
        return st and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def __call__(self):
        import time

        now = time.monotonic()
        if self.path and self.poll > 0 and now - self._checked >= max(self.poll, 1.0):
            self._checked = now
            self._load()
        return self.policy


def _policy_poll(args: argparse.Namespace) -> float:
    """egress_policy_poll as the workers get it (`--set egress_policy_poll=N`), else its default."""
    poll: float = OPTIONS["egress_policy_poll"].default
    for option in getattr(args, "setoptions", None) or ():
        name, _, value = option.partition("=")
        if name.strip() == "egress_policy_poll":
            try:
                poll = float(value)
            except ValueError:
                pass
    return poll


class _SupervisorControl:
    def __init__(self, server, timer):
        self.server, self.timer = server, timer

    def stop(self) -> None:
        self.timer.stop()
        self.server.stop()


def _mode_listeners(modes: list[str]) -> list[tuple]:
    """The proxy's listening addresses as the workers bind them (`MODE@HOST:PORT`, `MODE@PORT`: all
    interfaces), for the supervisor's explain engine; a spec without a port is left out."""
    import ipaddress

    found = []
    for spec in modes:
        _, at, where = spec.partition("@")
        host, _, port = where.rpartition(":") if ":" in where else ("", "", where)
        if not at or not port.isdigit():
            continue
        host = host.strip("[]") or "0.0.0.0"
        try:
            ip = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
        except ValueError:
            continue
        found.append((ip, int(port)))
        if ip == ipaddress.ip_address("0.0.0.0"):
            found.append((ipaddress.ip_address("::"), int(port)))
    return found


class _SupervisorEngine:
    """The engine `sandbox explain` is answered with in the supervisor (which decides no traffic):
    built once per policy from the policy the workers run, with the gateway's own addresses and
    listeners in its deny list as the workers' engines have them."""

    def __init__(self, policy, registry, listeners: list[tuple]):
        from gateway.localaddrs import local_addresses

        self.policy, self.registry, self.listeners = policy, registry, listeners
        self.self_addresses = local_addresses()
        self.built = None

    def __call__(self):
        from gateway.engine import Engine

        policy = self.policy()
        if self.built is None or self.built.policy is not policy:
            self.built = Engine.build(policy, self.self_addresses, self.listeners)
            self.built.grant_rules = self.registry.grant_rules
        return self.built


def _supervisor_control(args: argparse.Namespace, supervisor: Supervisor, modes: list[str]) -> _SupervisorControl:
    """`run --workers N --control SPEC`: the supervisor owns the API and the registry; the workers
    hold copies (gateway/control_fanout.py). Its metrics go to the workers' multiprocess directory,
    so every scrape sums them in."""
    import os

    from gateway.control import ControlService, Limits
    from gateway.control_fanout import CONTROL_LISTEN_ENV, ExpiryTimer, Fanout
    from gateway.control_server import ControlServer, read_tokens
    from gateway.ratelimit import parse_rate
    from gateway.registry import Registry
    from gateway.workers import MULTIPROC_ENV

    os.environ[MULTIPROC_ENV] = supervisor.metrics_dir  # before prometheus_client makes a value
    from prometheus_client import CollectorRegistry

    from gateway.metrics import ControlMetrics

    metrics = ControlMetrics(CollectorRegistry())
    policy = _PolicyWatch(args.policy, load_policy(args.policy) if args.policy else load_default_policy(),
                          _policy_poll(args))
    if args.policy:
        supervisor.on_sighup.append(policy.reload)
    registry = Registry()
    rate = parse_rate(getattr(args, "control_rate", OPTIONS["egress_control_rate"].default))
    limits = Limits(max_sandboxes=getattr(args, "control_max_sandboxes", OPTIONS["egress_control_max_sandboxes"].default),
                    max_grants=getattr(args, "control_max_grants", OPTIONS["egress_control_max_grants"].default),
                    rate=rate, burst=2 * rate)
    holder: dict = {}

    def publish(ops):
        confirmed = holder["fanout"].publish(ops)
        metrics.sizes(len(registry), registry.grant_count)
        return confirmed

    listeners = _mode_listeners(modes)
    if getattr(args, "metrics", None):  # the metrics port is one of the gateway's own listeners too (review 26)
        listeners.extend(_mode_listeners([f"metrics@{args.metrics}"]))
    service = ControlService(registry, policy, publish, supervisor.record, limits, count=metrics.count,
                             engine=_SupervisorEngine(policy, registry, listeners))
    fanout = holder["fanout"] = Fanout(registry, service.lock, supervisor.served, supervisor.kill)
    supervisor.control = fanout
    tokens = read_tokens(args.control_token_file) if args.control_token_file else None
    server = ControlServer(args.control, service, tokens=tokens, group=args.control_group)
    if server.address is not None:
        ip, port = server.address
        supervisor.env[CONTROL_LISTEN_ENV] = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
        # (the explain engine is built at the first request: after this)
        listeners.extend(_mode_listeners([f"control@{supervisor.env[CONTROL_LISTEN_ENV]}"]))
    timer = ExpiryTimer(service.expire, fanout.wake)
    server.start()
    timer.start()
    logging.getLogger("egress").info("egress gateway: control API at %s (supervisor)", server.where)
    return _SupervisorControl(server, timer)
