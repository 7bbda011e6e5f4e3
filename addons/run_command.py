"""`egress-gateway run`: the gateway itself (mitmproxy embedded with the egress addons).

This is the composition root, the one place where the pure core (`gateway/`) meets mitmproxy and
the adapters, so it lives here and not in `gateway/`: the CLI finds it through the
`egress_gateway.commands` entry point (pyproject.toml). Importing this module imports no
mitmproxy: a `run --workers N` supervisor never needs it (~70 MiB for its whole life).
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys

from gateway.audit import DEFAULT_MAX_BYTES, AuditLog
from gateway.commands import EXIT_INVALID
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
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
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
    return supervisor.run()
