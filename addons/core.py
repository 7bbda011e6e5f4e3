"""Options, policy loading and the safety settings that mitmproxy must run with.

mitmproxy's defaults are wrong for a gateway (eager upstream connections, raw TCP relaying,
host-based passthrough): this addon forces them on every configure, so neither `--set` nor a
later change can switch them back, and refuses proxy modes whose pinning is not implemented.
"""

from __future__ import annotations

import ipaddress
import logging
import os

from mitmproxy import ctx, exceptions
from mitmproxy.proxy import mode_specs

from gateway.credentials import load_placeholder_key
from gateway.engine import Engine
from gateway.localaddrs import local_addresses
from gateway.policy import Policy, PolicyError, load_default_policy, load_policy
from gateway.resolver import Resolver

from .audit_fields import mode_name
from .options import declare
from .state import GatewayState

logger = logging.getLogger("egress")

# option -> value the gateway needs, and why.
FORCED_OPTIONS: dict[str, tuple[object, str]] = {
    "connection_strategy": ("lazy", "no upstream connection may open before the policy decided"),
    "rawtcp": (False, "bytes the gateway cannot parse are refused, not relayed"),
    "ssl_insecure": (False, "upstream TLS is always verified"),
    "ignore_hosts": ([], "passthrough would skip every check"),
    "allow_hosts": ([], "passthrough would skip every check"),
    "tcp_hosts": ([], "raw TCP relaying would skip every check"),
    "udp_hosts": ([], "raw UDP relaying would skip every check"),
    "http3": (False, "QUIC is not inspected"),
    "validate_inbound_headers": (True, "malformed headers are refused"),
}
SUPPORTED_MODES = (mode_specs.RegularMode, mode_specs.TransparentMode, mode_specs.DnsMode)


class EgressCore:
    """Declares the egress_* options and owns the shared state."""

    def __init__(self, state: GatewayState):
        self.state = state
        self.self_addresses = local_addresses()
        self._configured = False
        self._configuring = False

    def load(self, loader):
        declare(
            loader,
            "egress_policy",
            "egress_dns_timeout",
            "egress_max_head_bytes",
            "egress_max_header_fields",
            "egress_head_timeout",
        )

    def configure(self, updated: set[str]):
        if self._configuring:
            return  # the options this very call forces back; nothing here depends on them
        self._configuring = True
        try:
            self._configure(updated)
        finally:
            self._configuring = False

    def _configure(self, updated: set[str]) -> None:
        if not self._configured:
            # The first time, everything counts as new: options set before this addon was added
            # (the embedded runner sets them first) must still be checked and forced.
            self._configured = True
            updated = set(ctx.options.keys())
        self._force_safe_options(updated)
        if "mode" in updated:
            self._check_modes()
        if updated & {"egress_policy", "mode", "egress_dns_timeout"} or self.state.engine is None:
            self._load_policy()
        if "confdir" in updated or self.state.placeholder_key is None:
            self._load_placeholder_key()

    def _force_safe_options(self, updated: set[str]) -> None:
        changes = {}
        for name, (value, why) in FORCED_OPTIONS.items():
            if not hasattr(ctx.options, name):
                continue
            current = getattr(ctx.options, name)
            if (list(current) if isinstance(value, list) else current) != value:
                if name in updated and ctx.options.default(name) != current:
                    logger.warning("egress gateway: ignoring %s=%r: %s", name, current, why)
                changes[name] = value
        if getattr(ctx.options, "stream_large_bodies", "unset") is None:
            # Stream big bodies instead of buffering them whole (mitmproxy's default), so memory
            # stays flat on large downloads; an explicit --set stream_large_bodies wins.
            changes["stream_large_bodies"] = "1m"
        if changes:
            ctx.options.update(**changes)

    def _check_modes(self) -> None:
        for spec in ctx.options.mode:
            mode = mode_specs.ProxyMode.parse(spec)
            if not isinstance(mode, SUPPORTED_MODES):
                raise exceptions.OptionsError(
                    f"mode {spec!r} is not supported by the egress gateway (supported: regular, transparent, dns)"
                )

    def _listeners(self) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
        found = []
        for spec in ctx.options.mode:
            mode = mode_specs.ProxyMode.parse(spec)
            port = mode.listen_port(ctx.options.listen_port)
            host = mode.listen_host(ctx.options.listen_host) or "0.0.0.0"
            if port is None:
                continue
            for text in (host, "::" if host == "0.0.0.0" else None):
                if text:
                    try:
                        found.append((ipaddress.ip_address(text), port))
                    except ValueError:
                        found.append((ipaddress.ip_address("0.0.0.0"), port))
        return found

    def build_engine(self, policy: Policy) -> Engine:
        """An engine for `policy` with this gateway's own addresses, listeners and DNS timeout."""
        resolver = Resolver(policy.static_hosts, timeout=ctx.options.egress_dns_timeout)
        engine = Engine.build(policy, self.self_addresses, self._listeners(), resolver)
        # Said once at load, by name and source (never a value): the requests that need one of
        # these fail with 502 secret_unavailable until it is fixed.
        for name, why in engine.secrets.problems().items():
            logger.warning("egress gateway: secret %r is unavailable: %s", name, why)
        return engine

    def _load_policy(self) -> None:
        path = ctx.options.egress_policy
        try:
            policy = load_policy(path) if path else load_default_policy()
        except PolicyError as exc:
            raise exceptions.OptionsError(f"invalid egress policy:\n{exc}") from None
        self.state.install(self.build_engine(policy))
        logger.info(
            "egress gateway: policy %s loaded (sha256 %s, %d rules)", policy.source, policy.sha256, len(policy.rules)
        )

    def _load_placeholder_key(self) -> None:
        try:
            self.state.placeholder_key = load_placeholder_key(ctx.options.confdir)
        except OSError as exc:
            logger.warning("egress gateway: no placeholder key in %s (%s): placeholders are not swapped",
                           ctx.options.confdir, exc.strerror)
            self.state.placeholder_key = None

    def running(self):
        confdir = os.path.expanduser(ctx.options.confdir)
        logger.info("egress gateway: CA certificate for sandboxes: %s", os.path.join(confdir, "mitmproxy-ca-cert.pem"))

    def client_connected(self, client):
        self.state.connection(client.id, client.peername, mode_name(client.proxy_mode))

    def client_disconnected(self, client):
        self.state.forget(client.id)
