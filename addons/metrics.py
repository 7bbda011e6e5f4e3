"""Observability: the metrics/health HTTP endpoint, the mitmproxy hooks that feed the metrics, the
audit log's operational options, SIGHUP dispatching, and graceful draining.

- `egress_metrics=HOST:PORT` serves `/metrics` (Prometheus text format, or OpenMetrics when the
  Accept header asks for it), `/healthz` (the process and its event loop are alive) and `/readyz`
  (policy loaded, proxy listeners up, CA certificate present, not draining) from a thread of its
  own. The address joins the gateway's own listeners in the address guard, so no request through
  the proxy can reach it (403 `self_address`).
- Decision entries and policy check timings reach gateway.metrics.GatewayMetrics through the shared
  state's listeners; this addon adds what only mitmproxy sees: open connections, relayed bytes and
  the upstream's time to first byte.
- `egress_audit_chain`, `egress_audit_max_bytes`, `egress_audit_backups` and the refusal line
  budgets (`egress_audit_max_refusals_per_second_per_sandbox`, `..._per_key`) configure the audit log
  that EgressCore opens (this addon runs after it); the heartbeat writes its due refusal summaries
  and retries it while it is unwritable (`/readyz` says so, `egress_audit_writable` too).
- `state.signals` (a SignalHub) lets several parts of the gateway subscribe to one signal: SIGHUP
  reopens the audit log here; a policy reload may subscribe too.
- `drain()` stops accepting, waits for in-flight requests; the runner calls it on SIGTERM.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from mitmproxy import ctx, exceptions, http
from mitmproxy.utils import human
from prometheus_client import make_wsgi_app

from gateway.audit import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, MAX_LINE_BYTES, PipeAuditLog
from gateway.auditrate import DEFAULT_PER_KEY, DEFAULT_PER_SOURCE, DEFAULT_TOTAL
from gateway.metrics import GatewayMetrics
from gateway.workers import notify_ready, worker_index

from . import fair_share
from .state import GatewayState
from .streaming import counting_stream

logger = logging.getLogger("egress")

HEARTBEAT_SECONDS = 1.0
STALLED_SECONDS = 10.0  # /healthz fails when the event loop has not ticked for this long
DRAIN_GRACE_SECONDS = 0.2  # after the last response hook, for the bytes to reach the client socket
AUDIT_OPTIONS = frozenset({
    "egress_audit_log", "egress_audit_chain", "egress_audit_max_bytes", "egress_audit_backups",
    "egress_audit_max_refusals_per_second_per_sandbox", "egress_audit_max_refusals_per_second_per_key",
    "egress_audit_max_refusals_per_second", "egress_audit_max_line_bytes",
})
COUNTED = "egress_bytes_counted"  # flow.metadata: this message's body is counted by a stream wrapper


# --- SIGHUP and friends ----------------------------------------------------------------------------


# --- the metrics/health endpoint -------------------------------------------------------------------


def parse_listen(spec: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """HOST:PORT or [IPV6]:PORT, HOST an IP address (or `localhost`); PORT 0 picks a free port."""
    match = re.fullmatch(r"\[([^\]]+)\]:(\d{1,5})|([^:\[\]]+):(\d{1,5})", spec.strip())
    if not match:
        raise ValueError(f"{spec!r}: expected HOST:PORT or [IPV6]:PORT")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{spec!r}: the host must be an IP address") from None
    if port > 65535:
        raise ValueError(f"{spec!r}: port out of range")
    return address, port


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self):
        # HTTPServer.server_bind looks the address up with socket.getfqdn (a reverse DNS query that
        # can hang without DNS); the name is only used for SERVER_NAME.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]
        self.setup_environ()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002  (scrapes every few seconds: not worth a line)
        pass


class HealthServer:
    """The HTTP endpoint, in a thread: it keeps answering however busy the proxy's event loop is,
    and /healthz notices when that loop stops ticking."""

    def __init__(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int,
                 metrics_app: Callable, health: Callable[[], tuple[bool, str]], ready: Callable[[], tuple[bool, str]]):
        self._metrics_app = metrics_app
        self._health = health
        self._ready = ready

        class Server(_Server):
            address_family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            # `run --workers N`: every worker serves the (merged) metrics on the same port.
            allow_reuse_port = worker_index() is not None

        self.server = make_server(str(address), port, self._app, server_class=Server, handler_class=_QuietHandler)
        self.address = address
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="egress-metrics", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return self._text(start_response, "405 Method Not Allowed", "GET or HEAD only\n", [("Allow", "GET, HEAD")])
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in ("/healthz", "/readyz"):
            ok, text = (self._health if path == "/healthz" else self._ready)()
            return self._text(start_response, "200 OK" if ok else "503 Service Unavailable", text)
        return self._text(start_response, "404 Not Found", "not found: try /metrics, /healthz or /readyz\n")

    @staticmethod
    def _text(start_response, status: str, text: str, headers: list | None = None):
        body = text.encode("utf-8")
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store"), *(headers or [])])
        return [body]


# --- no secret values in the audit log ------------------------------------------------------------


class SecretScrubber:
    """AuditLog.scrub: replaces every form of every secret the policy declares (as response
    redaction does) in string values of an audit record. Secret *names* ("injected", "secret") stay.
    Costs nothing when the policy has no secrets."""

    NAME_KEYS = frozenset({"time", "event", "injected", "secret"})

    def __init__(self, state: GatewayState):
        self.state = state

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        redactor = self.state.redactor()  # the response redactor's: every value held, past ones too
        if redactor is None:
            return values
        return {k: v if k in self.NAME_KEYS else self._clean(redactor, v) for k, v in values.items()}

    @classmethod
    def _clean(cls, redactor, value: Any) -> Any:
        if isinstance(value, str):
            return redactor.redact_text(value)[0]
        if isinstance(value, (list, tuple)):
            return [cls._clean(redactor, v) for v in value]
        return value


# --- the addon -------------------------------------------------------------------------------------


def _mode_name(client) -> str:
    return type(client.proxy_mode).__name__.removesuffix("Mode").lower() if client.proxy_mode else "?"


def _decision(flow) -> Any:
    return flow.metadata.get("egress_decision")


def _counting_in(inner, count: Callable[[int], None]):
    """A stream callable counting bytes *before* `inner` (True: pass-through) sees them."""
    def stream(data: bytes):
        count(len(data))
        return data if inner is True else inner(data)
    return stream



class Observability:
    name = "egressobservability"

    def __init__(self, state: GatewayState):
        self.state = state
        self.metrics = GatewayMetrics()
        self.scrubber = SecretScrubber(state)
        self.signals = state.signals
        self.signals.subscribe(signal.SIGHUP, self.reopen_audit)
        self.server: HealthServer | None = None
        self._spec = ""
        self._guard_listeners: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = []
        self._subscribed = False
        self._running = False
        self._listeners_up = False
        self._heartbeat = 0.0
        self._heartbeat_task: asyncio.Task | None = None
        self._ca_path: str | None = None
        self.draining = False
        self._modes: dict[str, str] = {}  # client id -> mode, for the active connections gauge
        self._in_flight: dict[str, str] = {}  # flow id -> client id: requests not answered yet
        self._tcp_rules: dict[str, str | None] = {}  # client "ip:port" -> rule of its raw TCP connection
        self._policy = None  # the policy last installed
        self._audit_seen: tuple[int, int, int] = (0, 0, 0)  # (id of the log, failures, suppressed) told to metrics
        self._audit_lock = threading.Lock()  # the heartbeat and the endpoint's thread both tell them
        state.install_listeners.append(self._on_install)  # every engine installed (start-up, reloads)
        state.usage_listeners.append(self.metrics.limited)  # bytes counted against policy limits
        state.wait_listeners.append(self.metrics.loop_share_waited)  # reads held for a sandbox's loop share

    # --- options ---------------------------------------------------------------------------------

    def load(self, loader):
        loader.add_option(
            "egress_metrics", str, "",
            "Serve /metrics, /healthz and /readyz on HOST:PORT (an IP address); empty: off. The address is "
            "one of the gateway's own listeners, never reachable through the proxy.",
        )
        loader.add_option(
            "egress_audit_chain", bool, False,
            "Hash-chain the audit log: every line carries 'prev', the SHA-256 of the previous line.",
        )
        loader.add_option(
            "egress_audit_max_bytes", int, DEFAULT_MAX_BYTES,
            "Rotate the audit log file before it would exceed this many bytes (0: never; the default is "
            "ignored for stdout, which cannot rotate).",
        )
        loader.add_option(
            "egress_audit_backups", int, DEFAULT_BACKUPS, "Rotated audit log files to keep (PATH.1 ... PATH.N).",
        )
        loader.add_option(
            "egress_audit_max_refusals_per_second_per_sandbox", int, DEFAULT_PER_SOURCE,
            "Refusal lines written one by one per second per sandbox (or client address without one); the "
            "refusals over it are counted in one 'suppressed' summary line per kind (0: every refusal its "
            "line). Allowed requests always get their own line.",
        )
        loader.add_option(
            "egress_audit_max_refusals_per_second_per_key", int, DEFAULT_PER_KEY,
            "Of those, refusal lines written one by one per second for one (event, reason, rule, host); 0: no "
            "budget of its own per kind.",
        )
        loader.add_option(
            "egress_audit_max_line_bytes", int, MAX_LINE_BYTES,
            "The longest audit line (bytes, with its chain hash): past it the longest client-controlled "
            "values are shortened and named in 'truncated'. At least 2048.",
        )
        loader.add_option(
            "egress_audit_max_refusals_per_second", int, DEFAULT_TOTAL,
            "Refusal lines written one by one per second by the whole gateway, every sandbox and client "
            "together (cycling client addresses buy no more); the refusals over it are counted in "
            "'suppressed' summary lines too. 0: no gateway-wide budget.",
        )
        loader.add_option(
            "egress_drain_timeout", float, 10.0,
            "On SIGTERM (egress-gateway run), seconds to wait for in-flight requests before exiting.",
        )

    def configure(self, updated: set[str]):
        if updated & AUDIT_OPTIONS:
            self._configure_audit()
        if "egress_metrics" in updated or "egress_drain_timeout" in updated:
            if ctx.options.egress_drain_timeout < 0:
                raise exceptions.OptionsError("egress_drain_timeout must be >= 0")
            self._sync_metrics(strict=True)
            engine = self.state.engine
            if engine is not None and self._needs_reinstall(engine):
                self.state.install(engine)

    def _configure_audit(self) -> None:
        max_bytes = ctx.options.egress_audit_max_bytes
        backups = ctx.options.egress_audit_backups
        if max_bytes < 0:
            raise exceptions.OptionsError("egress_audit_max_bytes must be >= 0")
        if backups < 1:
            raise exceptions.OptionsError("egress_audit_backups must be >= 1")
        per_sandbox = ctx.options.egress_audit_max_refusals_per_second_per_sandbox
        per_key = ctx.options.egress_audit_max_refusals_per_second_per_key
        total = ctx.options.egress_audit_max_refusals_per_second
        if per_sandbox < 0 or per_key < 0 or total < 0:
            raise exceptions.OptionsError("egress_audit_max_refusals_per_second(_per_sandbox, _per_key) must be >= 0")
        line_bytes = ctx.options.egress_audit_max_line_bytes
        if line_bytes < 2048:
            raise exceptions.OptionsError("egress_audit_max_line_bytes must be >= 2048")
        audit = self.state.audit
        audit.max_line_bytes = line_bytes
        if audit.target == "-" and max_bytes == ctx.options.default("egress_audit_max_bytes"):
            max_bytes = 0  # rotation is on by default for files; stdout cannot rotate
        if max_bytes and audit.target == "-":
            raise exceptions.OptionsError("audit log rotation (egress_audit_max_bytes) needs a file, not stdout")
        audit.configure(chain=ctx.options.egress_audit_chain, max_bytes=max_bytes, backups=backups,
                        scrub=self.scrubber, refusals_per_second=per_sandbox, refusals_per_key=per_key or per_sandbox,
                        refusals_total=total)

    def _sync_metrics(self, strict: bool) -> None:
        """Bring the endpoint in line with egress_metrics (bind, or rebind on a change)."""
        spec = getattr(ctx.options, "egress_metrics", "") or ""
        if spec == self._spec:
            return
        try:
            listen = parse_listen(spec) if spec else None
        except ValueError as exc:
            if strict:
                raise exceptions.OptionsError(f"egress_metrics: {exc}") from None
            return
        if self.server is not None:
            self.server.stop()
            self.server = None
            self._guard_listeners = []
            self.state.extra_listeners[:] = []
        if listen is not None:
            try:
                server = HealthServer(*listen, self._metrics_app(), self.health, self.readiness)
            except OSError as exc:
                if strict:
                    # Like a proxy port in use: logged as an error, which stops a gateway that is
                    # starting (exit status 1).
                    logger.error("egress gateway: cannot serve metrics on %s: %s", spec, exc.strerror)
                    self._spec = spec
                return
            server.start()
            self.server = server
            self._guard_listeners = [(server.address, server.port)]
            if server.address == ipaddress.ip_address("0.0.0.0"):
                self._guard_listeners.append((ipaddress.ip_address("::"), server.port))
            self.state.extra_listeners[:] = self._guard_listeners  # every engine installed guards it
            if not self._subscribed:
                self.state.decision_listeners.append(self._on_decision)
                self.state.timing_listeners.append(self.metrics.on_timing)
                self._subscribed = True
            if self._running:
                logger.info("egress gateway: metrics at %s/metrics", server.url)
        self._spec = spec

    def _metrics_app(self):
        """The Prometheus app, with the audit log's state brought up to date at every scrape."""
        app = make_wsgi_app(self.metrics.exposition_registry)

        def serve(environ, start_response):
            self._audit_metrics()
            return app(environ, start_response)
        return serve

    def _needs_reinstall(self, engine) -> bool:
        missing = not set(self._guard_listeners) <= set(engine.guard.listeners)
        return missing or (self._subscribed and engine.timings is None)

    def _on_install(self, engine) -> None:
        if engine.policy is not self._policy:  # not when the same engine is installed again (configure)
            self._policy = engine.policy
            self.metrics.policy_loaded(engine.policy)

    # --- lifecycle -------------------------------------------------------------------------------

    def running(self):
        self._running = True
        loop = asyncio.get_running_loop()
        if not self.signals.installed(signal.SIGHUP):
            try:
                self.signals.install(loop)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
                logger.warning("egress gateway: cannot handle SIGHUP here: the audit log is not reopened on it")
        self._ca_path = os.path.join(os.path.expanduser(ctx.options.confdir), "mitmproxy-ca-cert.pem")
        self._tick()
        self._heartbeat_task = loop.create_task(self._beat(), name="egress heartbeat")
        if self.server is not None:
            logger.info("egress gateway: metrics at %s/metrics (health: /healthz, readiness: /readyz)", self.server.url)
        audit = self.state.audit
        if isinstance(audit, PipeAuditLog):
            logger.info("egress gateway: audit lines go to the supervisor (worker %s)", worker_index())
        elif audit.target:
            extras = [f"rotated at {audit.max_bytes} bytes, {audit.backups} kept" if audit.max_bytes else "",
                      "hash-chained" if audit.chain else ""]
            extra = ", ".join(e for e in extras if e)
            logger.info("egress gateway: audit log %s%s", "stdout" if audit.target == "-" else audit.target,
                        f" ({extra})" if extra else "")
        logger.info("egress gateway: ready: %s", self.summary())
        notify_ready()  # `run --workers N`: the supervisor now knows this worker listens

    def summary(self) -> str:
        """One line: where the gateway listens, the policy in force, the CA sandboxes must trust."""
        proxyserver = ctx.master.addons.get("proxyserver")
        listening = []
        for server in proxyserver.servers if proxyserver is not None else []:
            kind = type(server.mode).__name__.removesuffix("Mode").lower()
            listening += [f"{kind} {human.format_address(a)}" for a in dict.fromkeys(server.listen_addrs)]
        engine = self.state.engine
        policy = f"{engine.policy.source} (sha256 {engine.policy.sha256})" if engine is not None else "none"
        parts = [f"listening on {', '.join(listening) or 'nothing'}", f"policy {policy}", f"CA certificate {self._ca_path}"]
        if self.server is not None:
            parts.append(f"metrics {self.server.url}/metrics")
        return "; ".join(parts)

    def done(self):
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.state.audit.head is not None:
            logger.info("egress gateway: audit chain head %s", self.state.audit.head)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            self._tick()
            self._audit_tick()

    def _audit_tick(self) -> None:
        """Due refusal summaries written, a failing log retried; the metrics told."""
        try:
            self.state.audit.maintain()
        except Exception:  # noqa: BLE001  (never stop the heartbeat)
            logger.exception("egress gateway: audit log maintenance failed")
        self._audit_metrics()

    def _audit_metrics(self) -> None:
        """Tell the metrics what changed in the audit log (heartbeat, and every scrape)."""
        if not self._subscribed:
            return
        with self._audit_lock:
            audit = self.state.audit
            seen_id, failures, suppressed = self._audit_seen
            if seen_id != id(audit):
                failures = suppressed = 0
            now_failures, now_suppressed = audit.write_failures, audit.suppressed
            self.metrics.audit_state(audit.writable, now_failures - failures, now_suppressed - suppressed)
            self._audit_seen = (id(audit), now_failures, now_suppressed)

    def _tick(self) -> None:
        self._heartbeat = time.monotonic()
        proxyserver = ctx.master.addons.get("proxyserver") if ctx.master else None
        servers = list(proxyserver.servers) if proxyserver is not None else []
        self._listeners_up = bool(servers) and all(s.is_running for s in servers) and not self.draining
        self.metrics.loop_share_active.set(fair_share.active())

    def reopen_audit(self) -> None:
        audit = self.state.audit
        audit.reopen()
        if audit.target not in (None, "-") and not isinstance(audit, PipeAuditLog):
            logger.info("egress gateway: audit log %s reopened", audit.target)

    # --- /healthz and /readyz (called from the endpoint's thread) ----------------------------------

    def health(self) -> tuple[bool, str]:
        if not self._running:
            return True, "ok: starting\n"
        age = time.monotonic() - self._heartbeat
        if age > STALLED_SECONDS:
            return False, f"event loop stalled for {age:.0f}s\n"
        return True, "ok\n"

    def readiness(self) -> tuple[bool, str]:
        checks = []
        engine = self.state.engine
        checks.append(("policy", engine is not None, f"sha256 {engine.policy.sha256}" if engine else "not loaded"))
        if self.draining:
            checks.append(("listeners", False, "draining: not accepting connections"))
        elif not self._running:
            checks.append(("listeners", False, "starting"))
        else:
            checks.append(("listeners", self._listeners_up, "up" if self._listeners_up else "not listening"))
        ca = self._ca_path
        ca_ok = bool(ca) and os.path.isfile(ca)
        checks.append(("ca", ca_ok, ca if ca_ok else f"missing {ca}" if ca else "not known yet"))
        alive, why = self.health()
        checks.append(("event_loop", alive, why.strip()))
        audit = self.state.audit
        if audit.target is not None:
            if audit.writable:
                checks.append(("audit_log", True, "writable"))
            else:
                code = getattr(audit, "supervisor_errno", 0)
                why = f"{os.strerror(code)}, says the supervisor" if code else "the last write failed"
                since = audit.failing_since
                checks.append(("audit_log", False, f"not writable ({why}"
                               + (f", since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))}" if since else "")
                               + "): every decision is refused (500 internal_error)"))
        ok = all(passed for _, passed, _ in checks)
        lines = [f"{name}: {'ok' if passed else 'FAIL'} ({detail})" for name, passed, detail in checks]
        return ok, ("ready\n" if ok else "not ready\n") + "\n".join(lines) + "\n"

    # --- draining ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def drain(self, timeout: float) -> bool:
        """Stop accepting connections, then wait up to `timeout` seconds for in-flight requests.
        True when none is left (the caller then shuts down)."""
        self.draining = True
        self._listeners_up = False
        proxyserver = ctx.master.addons.get("proxyserver")
        if proxyserver is not None:
            await proxyserver.servers.update([])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._in_flight:
            return False
        await asyncio.sleep(DRAIN_GRACE_SECONDS)
        return True

    # --- decision entries ---------------------------------------------------------------------------

    def _on_decision(self, entry: dict[str, Any]) -> None:
        self.metrics.on_decision(entry)
        if (entry.get("protocol") == "tcp" and entry.get("event") == "connection"
                and entry.get("decision") in ("allow", "would_deny")):  # both relay bytes
            self._tcp_rules[str(entry.get("client"))] = entry.get("rule")

    # --- mitmproxy hooks -------------------------------------------------------------------------

    def client_connected(self, client):
        mode = _mode_name(client)
        self._modes[client.id] = mode
        self.metrics.connection_opened(mode)

    def client_disconnected(self, client):
        mode = self._modes.pop(client.id, None)
        if mode is not None:
            self.metrics.connection_closed(mode)
        if self._in_flight:
            for flow_id in [f for f, c in self._in_flight.items() if c == client.id]:
                del self._in_flight[flow_id]
        if client.peername and self._tcp_rules:
            self._tcp_rules.pop(f"{client.peername[0]}:{client.peername[1]}", None)

    def requestheaders(self, flow: http.HTTPFlow):
        self._in_flight[flow.id] = flow.client_conn.id
        if not self._subscribed or flow.response is not None:
            return
        decision = _decision(flow)
        if decision is None or not decision.allowed:
            return
        if flow.request.stream:
            rule = decision.rule
            flow.request.stream = counting_stream(flow.request.stream, lambda n: self.metrics.relayed("sent", rule, n))
            flow.metadata[COUNTED + "_request"] = True

    def request(self, flow: http.HTTPFlow):
        if not self._subscribed or flow.response is not None or flow.metadata.get(COUNTED + "_request"):
            return
        decision = _decision(flow)
        if decision is not None and decision.allowed:
            self.metrics.relayed("sent", decision.rule, len(flow.request.raw_content or b""))

    def responseheaders(self, flow: http.HTTPFlow):
        if not self._subscribed:
            return
        decision = _decision(flow)
        response = flow.response
        if decision is None or not decision.allowed or response is None or flow.server_conn.timestamp_start is None:
            return
        sent = flow.request.timestamp_end or flow.request.timestamp_start
        if response.timestamp_start and sent:
            self.metrics.upstream_first_byte(decision.rule, response.timestamp_start - sent)
        if response.stream:
            rule = decision.rule
            response.stream = _counting_in(response.stream, lambda n: self.metrics.relayed("received", rule, n))
            flow.metadata[COUNTED + "_response"] = True

    def response(self, flow: http.HTTPFlow):
        self._in_flight.pop(flow.id, None)
        if not self._subscribed or flow.metadata.get(COUNTED + "_response"):
            return
        decision = _decision(flow)
        response = flow.response
        if decision is None or not decision.allowed or response is None or flow.server_conn.timestamp_start is None:
            return
        if response.stream:  # switched to streaming mid-body, after responseheaders: not counted
            return
        self.metrics.relayed("received", decision.rule, len(response.raw_content or b""))

    def error(self, flow: http.HTTPFlow):
        self._in_flight.pop(flow.id, None)

    def websocket_message(self, flow: http.HTTPFlow):
        if not self._subscribed or flow.websocket is None or not flow.websocket.messages:
            return
        decision = _decision(flow)
        message = flow.websocket.messages[-1]
        self.metrics.relayed("sent" if message.from_client else "received",
                             decision.rule if decision is not None else None, len(message.content))

    def tcp_message(self, flow):
        if not self._subscribed or not flow.messages:
            return
        message = flow.messages[-1]
        peer = flow.client_conn.peername
        rule = self._tcp_rules.get(f"{peer[0]}:{peer[1]}") if peer else None
        self.metrics.relayed("sent" if message.from_client else "received", rule, len(message.content))
