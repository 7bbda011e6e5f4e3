"""Run mitmproxy embedded with the gateway's addons (what `egress-gateway run` does).

Only the mitmproxy addons a gateway needs are loaded: the proxy server, TLS, proxy
authentication, client blocking and error checking. The rest of mitmproxy's defaults are left
out on purpose: flow saving (save_stream_file, HAR) would write injected credentials to disk,
map_remote/modify_headers would change a request after the policy judged it, playback and the
onboarding app have no place in front of a sandbox, and every loaded addon costs time on every
hook of every request. `mitmdump -s addons/egress.py` still gets mitmproxy's full set, less what
addons/output_guard.py switches off (every writer of flows) in both modes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import types

from mitmproxy import certs, exceptions, master, options
from mitmproxy.proxy import mode_servers

from gateway.credentials import load_placeholder_key
from gateway.workers import bind_to_supervisor, worker_index
from mitmproxy.addons import block, core, errorcheck, proxyauth, proxyserver, tlsconfig

from .egress import make_addons
from .layer_guard import LayerGuard
from .patches import UntestedMitmproxy, check_mitmproxy_version
from .run_command import operational_options
from .lifecycle import Lifecycle
from .state import GatewayState

logger = logging.getLogger("egress")


def builtin_addons() -> list:
    """The mitmproxy addons the gateway runs with (see the module docstring for what is left out)."""
    return [
        core.Core(),
        block.Block(),
        proxyauth.ProxyAuth(),
        proxyserver.Proxyserver(),
        tlsconfig.TlsConfig(),
        errorcheck.ErrorCheck(),
    ]


async def _serve(policy_path: str, modes: list[str], confdir: str, audit_log: str | None,
                 set_options: list[str], quiet: bool, ops: dict | None = None) -> int:
    opts = options.Options()
    gateway_master = master.Master(opts, with_termlog=True)
    gateway_master.addons.add(*builtin_addons())
    state = GatewayState()
    ours = make_addons(state)
    for addon in ours:
        if isinstance(addon, LayerGuard):
            addon.name = "nextlayer"  # it is the next-layer addon here: mitmproxy looks it up by that name
    try:
        # Options first (the gateway's own are deferred until its addons declare them), so the
        # addons configure once, with the final values: one policy load, the right one.
        opts.update_defer(
            mode=modes,
            confdir=confdir,
            egress_policy=policy_path,
            egress_audit_log=audit_log or "",
            termlog_verbosity="warn" if quiet else "info",
            **(ops or {}),
        )
        if set_options:
            opts.set(*set_options, defer=True)
        deferred = set(opts.deferred)
        gateway_master.addons.add(*ours)
        if opts.deferred:
            raise exceptions.OptionsError(f"unknown option(s): {', '.join(sorted(opts.deferred))}")
        # A deferred value is applied while its addon registers, before that addon is in the chain
        # to hear about it: announce them again. (The policy was loaded with its final path already.)
        again = deferred - {"egress_policy", "egress_dns_timeout"}
        if again:
            opts.update(**{name: getattr(opts, name) for name in again})
    except exceptions.OptionsError as exc:
        print(f"egress-gateway: {exc}", file=sys.stderr)
        return 2
    # Run the gateway's hooks before mitmproxy's built-in addons, exactly as `mitmdump -s` does:
    # the guards then decide first (next layer, DNS answers) and never race a built-in default.
    chain = gateway_master.addons.chain
    chain[:] = [a for a in chain if a in ours] + [a for a in chain if a not in ours]
    lifecycle = next((a for a in ours if isinstance(a, Lifecycle)), None)

    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    async def drain_then_stop() -> None:
        timeout = opts.egress_drain_timeout if lifecycle is not None else 0
        try:
            if lifecycle is not None:
                logger.info("egress gateway: stopping: no new connections; draining %d in-flight request(s) "
                            "(up to %gs)", lifecycle.in_flight, timeout)
                if await lifecycle.drain(timeout):
                    logger.info("egress gateway: drained")
                else:
                    logger.warning("egress gateway: drain timeout: %d request(s) still in flight are cut",
                                   lifecycle.in_flight)
        except Exception:
            logger.exception("egress gateway: draining failed")
        finally:
            gateway_master.shutdown()

    def stop() -> None:
        """SIGTERM/SIGINT: drain, then exit 0. A second signal exits at once."""
        if stopping or lifecycle is None:
            gateway_master.shutdown()
            return
        stopping.append(loop.create_task(drain_then_stop(), name="egress drain"))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    # SIGHUP goes to every subscriber of the shared hub (the audit log reopens; a policy reload may
    # subscribe too): state.signals.subscribe(signal.SIGHUP, callback).
    state.signals.install(loop, (signal.SIGHUP,))
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    await gateway_master.run()
    errorcheck = gateway_master.addons.get("errorcheck")
    return 1 if errorcheck is not None and getattr(errorcheck, "has_errored", False) else 0


def share_listen_ports() -> None:
    """In a worker of `run --workers N`: listen with SO_REUSEPORT, so that N processes share each
    proxy port and the kernel spreads connections across them. mitmproxy's TCP servers call
    asyncio.start_server through their module's `asyncio`; only that module sees the change.
    (UDP servers are mitmproxy_rs's: DNS mode runs in one worker only.)"""
    shim = types.ModuleType("asyncio")
    shim.__getattr__ = lambda name: getattr(asyncio, name)

    async def start_server(*args, **kwargs):
        kwargs.setdefault("reuse_port", True)
        return await asyncio.start_server(*args, **kwargs)

    shim.start_server = start_server
    mode_servers.asyncio = shim


def refuse_untested_mitmproxy() -> int | None:
    """2, said on stderr, on a mitmproxy the patches were not tested against (addons/patches.py)."""
    try:
        check_mitmproxy_version()
    except UntestedMitmproxy as exc:
        print(f"egress-gateway: {exc}", file=sys.stderr)
        return 2
    return None


def prepare_confdir(confdir: str) -> int:
    """Create the CA (and the placeholder key) once, before N workers would each create their own."""
    refused = refuse_untested_mitmproxy()
    if refused is not None:
        return refused
    path = os.path.expanduser(confdir)
    certs.CertStore.from_store(path, "mitmproxy", 2048)
    load_placeholder_key(path)
    return 0


def run_gateway(*, policy_path: str, modes: list[str], confdir: str, audit_log: str | None,
                set_options: list[str], quiet: bool, policy_sha256: str, extra=None) -> int:
    """`extra` is the parsed command line, for options that later subcommand flags add."""
    refused = refuse_untested_mitmproxy()
    if refused is not None:
        return refused
    if worker_index() is not None:
        if not bind_to_supervisor():
            return 1
        share_listen_ports()
    logging.getLogger().setLevel(logging.INFO)
    # The layer guard is the next-layer addon here (it joins after the built-ins, under that name).
    logging.getLogger("mitmproxy.addons.proxyserver").addFilter(
        lambda record: "without nextlayer addon" not in record.getMessage())
    for noisy in ("tornado", "asyncio", "hpack", "quic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return asyncio.run(_serve(policy_path, modes, confdir, audit_log, set_options, quiet, operational_options(extra)))
