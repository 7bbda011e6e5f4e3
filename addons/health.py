"""The metrics and health endpoint: `egress_metrics=HOST:PORT` serves `/metrics` (Prometheus text
format, or OpenMetrics when the Accept header asks for it), `/healthz` and `/readyz` from a thread
of its own, so it keeps answering however busy the proxy's event loop is.

The address joins the gateway's own listeners in the address guard, so no request through the
proxy can reach it (403 `self_address`). What the endpoint says comes from its owners: the
metrics from MetricsFeed, liveness and readiness from Lifecycle.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from socketserver import TCPServer, ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from mitmproxy import ctx, exceptions
from prometheus_client import make_wsgi_app

from gateway.listen import parse_listen
from gateway.workers import worker_index

from .lifecycle import Lifecycle
from .metrics import MetricsFeed
from .options import declare
from .state import GatewayState

logger = logging.getLogger("egress")


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


class HealthEndpoint:
    name = "egresshealth"

    def __init__(self, state: GatewayState, feed: MetricsFeed, lifecycle: Lifecycle):
        self.state = state
        self.feed = feed
        self.lifecycle = lifecycle
        self.server: HealthServer | None = None
        self._spec = ""
        self._guard_listeners: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = []
        self._running = False

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def load(self, loader):
        declare(loader, "egress_metrics")

    def configure(self, updated: set[str]):
        if "egress_metrics" not in updated:
            return
        self._sync(strict=True)
        engine = self.state.engine
        if engine is not None and self._needs_reinstall(engine):
            self.state.install(engine)

    def _sync(self, strict: bool) -> None:
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
        self._unbind()
        if listen is not None and not self._bind(listen, spec, strict):
            return
        self._spec = spec

    def _unbind(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
            for listener in self._guard_listeners:  # only its own: the control API's stay
                if listener in self.state.extra_listeners:
                    self.state.extra_listeners.remove(listener)
            self._guard_listeners = []

    def _bind(self, listen, spec: str, strict: bool) -> bool:
        try:
            server = HealthServer(*listen, self._metrics_app(), self.lifecycle.health, self.lifecycle.readiness)
        except OSError as exc:
            if strict:
                # Like a proxy port in use: logged as an error, which stops a gateway that is
                # starting (exit status 1).
                logger.error("egress gateway: cannot serve metrics on %s: %s", spec, exc.strerror)
                self._spec = spec
            return False
        server.start()
        self.server = server
        self._guard_listeners = [(server.address, server.port)]
        if server.address == ipaddress.ip_address("0.0.0.0"):
            self._guard_listeners.append((ipaddress.ip_address("::"), server.port))
        self.state.extra_listeners.extend(self._guard_listeners)  # every engine installed guards it
        self.feed.enable()
        if self._running:
            logger.info("egress gateway: metrics at %s/metrics", server.url)
        return True

    def _metrics_app(self):
        """The Prometheus app, with the audit log's state brought up to date at every scrape."""
        app = make_wsgi_app(self.feed.metrics.exposition_registry)

        def serve(environ, start_response):
            self.feed.audit_metrics()
            return app(environ, start_response)
        return serve

    def _needs_reinstall(self, engine) -> bool:
        missing = not set(self._guard_listeners) <= set(engine.guard.listeners)
        return missing or (self.feed.enabled and engine.timings is None)

    def running(self):
        self._running = True
        if self.server is not None:
            logger.info("egress gateway: metrics at %s/metrics (health: /healthz, readiness: /readyz)", self.server.url)

    def done(self):
        self._unbind()
