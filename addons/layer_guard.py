"""Decides the protocol layer for every connection the gateway knows how to inspect, and refuses
the rest at once.

mitmproxy's own next_layer falls back to raw TCP, DNS-over-TCP relaying or passthrough in several
cases; here, after a CONNECT (or on a transparently redirected connection) only TLS or HTTP/1 may
follow, after TLS only HTTP (HTTP/2 when ALPN said h2), and on the proxy port only HTTP/1 requests.
In transparent mode, other bytes are relayed only when a `protocol: tcp` rule allows the original
destination. Anything else gets a 400 (or a close) at once, without waiting for a request head
that will never come, and without an upstream connection.

Bytes that cannot be judged yet are held by addons/first_bytes.py (a TLS ClientHello read whole,
within its budgets, before any rule lookup sees it); the HTTP layers, their limits and the audit
of their own refusals are made by addons/http_layer_maker.py.
"""

from __future__ import annotations

import logging
import re

from mitmproxy import ctx
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers import ClientTLSLayer, HttpLayer, ServerTLSLayer, TCPLayer, modes
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.tls import ClientHello

from gateway.decision import Decision, verdict_fields
from gateway.session import PASSTHROUGH, ClientSession

from . import conn_timers, instance_layout, layer_memory, passthrough, stream_memory, task_info
from .audit_fields import connection_fields
from .failclosed import fail_closed
from .first_bytes import FirstBytes
from .http1_server import MAX_EMPTY_LINES
from .http_layer_maker import HttpLayerMaker
from .layers import GatewayTcpLayer
from .options import declare
from .refusal_layers import HoldLayer, RefusalLayer
from .state import GatewayState

logger = logging.getLogger("egress")

H2_PREFACE = b"PRI * HTTP/2.0"
MAX_FIRST_LINE = 8192
_METHOD_PREFIX = re.compile(rb"^[A-Z][A-Z0-9_-]{0,19}(?: |\Z)")
_REQUEST_LINE = re.compile(rb"^[A-Z][A-Z0-9_-]{0,19} [^ \r\n]+ HTTP/1\.[01]\r?\Z")
_EMPTY_LINES = re.compile(rb"(?:\r?\n)*")

TLS, HTTP, H2C, OTHER, WAIT = "tls", "http", "h2c", "other", "wait"


def classify(data: bytes) -> str:
    """What the first bytes of a connection (or of a TLS stream) are, or WAIT for more.

    HTTP/1 only on a complete `METHOD SP target SP HTTP/1.x` line, so a text protocol whose lines
    start with a word (SMTP, IRC, Redis) is never mistaken for it; anything that cannot become an
    HTTP request line or a TLS record is OTHER at once (SSH, binary), without waiting."""
    if not data:
        return WAIT
    if data[0] in b"\r\n":
        return _after_empty_lines(data)
    if data[0] == 0x16:
        if len(data) < 3:
            return WAIT
        return TLS if starts_like_tls_record(data) else OTHER
    if H2_PREFACE.startswith(data[: len(H2_PREFACE)]):
        return WAIT if len(data) < len(H2_PREFACE) else H2C
    line, newline, _ = data.partition(b"\n")
    if newline:
        return HTTP if _REQUEST_LINE.match(line) else OTHER
    if len(data) > MAX_FIRST_LINE or not _METHOD_PREFIX.match(data[:21]):
        return OTHER
    return WAIT


def _after_empty_lines(data: bytes) -> str:
    """Empty lines before a request line are skipped (RFC 9112 2.2), on a connection's first bytes
    as after a request: up to MAX_EMPTY_LINES of them, then HTTP or nothing. Past that many it is
    HTTP too, for the HTTP layer to refuse with its own reason (`malformed_request`)."""
    blank = _EMPTY_LINES.match(data).group()
    skipped, rest = blank.count(b"\n"), data[len(blank):]
    if skipped > MAX_EMPTY_LINES:
        return HTTP
    if rest in (b"", b"\r"):
        return WAIT
    kind = classify(rest) if rest[0] not in b"\r\n" else OTHER  # a bare CR is not a line end
    return kind if kind in (HTTP, WAIT) else OTHER


# The layer stacks the gateway knows, by role: the explicit proxy port, a CONNECT tunnel before
# its first byte, and a CONNECT tunnel after the client's TLS handshake.
PROXY_PORT = ("proxy",)
TUNNEL = ("proxy", "http", "stream")
TUNNEL_TLS = ("proxy", "http", "stream", "server_tls", "client_tls")
TRANSPARENT = ("transparent",)
TRANSPARENT_TLS = ("transparent", "server_tls", "client_tls")
_ROLES = (
    (modes.HttpProxy, "proxy"),
    (modes.TransparentProxy, "transparent"),
    (HttpLayer, "http"),
    (HttpStream, "stream"),
    (ServerTLSLayer, "server_tls"),
    (ClientTLSLayer, "client_tls"),
)


def _no_wait_for_http(kind: str, data: bytes) -> str:
    """Where nothing but TLS or HTTP may follow (the proxy port, tunnels, inside TLS), bytes that
    start like a method are handed to the HTTP layer at once: its parser refuses a bad line, and
    its head timer also covers a client that goes silent half-way. Only transparent connections,
    where a raw TCP rule may apply, wait for the whole first line."""
    data = data[len(_EMPTY_LINES.match(data).group()):]  # skipped before a request line (classify)
    if kind == WAIT and _METHOD_PREFIX.match(data[:21]) and not H2_PREFACE.startswith(data[: len(H2_PREFACE)]):
        return HTTP
    return kind


def _shape(stack) -> tuple[str, ...]:
    roles = []
    for item in stack:
        role = next((name for cls, name in _ROLES if isinstance(item, cls)), type(item).__name__)
        roles.append(role)
    return tuple(roles)


def _refuse_on_error(self, nextlayer: layer.NextLayer, error: Exception) -> None:
    nextlayer.layer = RefusalLayer(
        nextlayer.context, Decision.deny("internal_error", "the gateway failed while choosing a protocol layer"), False
    )




class LayerGuard:
    def __init__(self, state: GatewayState):
        layer_memory.install()  # every layer's queue of paused events made only when first used
        stream_memory.install()  # every connection's list of drain waiters made only when a writer waits
        conn_timers.install()  # a connection's watchdog and wakeups are loop timers, not sleeping tasks
        task_info.install()  # tasks keep their names, not debug attributes nothing here reads
        instance_layout.install()  # per-connection objects keep their attributes inline, without dicts
        self.state = state
        self.http = HttpLayerMaker(state)
        self.first_bytes = FirstBytes(self._decide, self._refuse)

    def load(self, loader):
        declare(loader, "egress_max_client_hello_bytes", "egress_client_hello_timeout")

    @fail_closed(_refuse_on_error)
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        if nextlayer.layer is not None:
            # mitmproxy's own next_layer ran first (embedded order) and its layers are already on
            # the stack; the decision here replaces them.
            if nextlayer.layer in context.layers:
                del context.layers[context.layers.index(nextlayer.layer) :]
            nextlayer.layer = None
        self._decide(nextlayer)

    def _decide(self, nextlayer: layer.NextLayer | HoldLayer) -> None:
        context = nextlayer.context
        stack = context.layers
        data = nextlayer.data_client()
        if context.client.transport_protocol != "tcp":
            self._refuse(nextlayer, "non_http", "only TCP is proxied", speak_http=False)
            return
        shape = _shape(stack)
        if shape == PROXY_PORT:
            self._proxy_port(nextlayer, data)
        elif shape == TUNNEL:
            self._tunnel_start(nextlayer, data)
        elif shape in (TUNNEL_TLS, TRANSPARENT_TLS):
            self._inside_tls(nextlayer, data)
        elif shape == TRANSPARENT:
            self._transparent_start(nextlayer, data)
        else:
            names = "/".join(type(x).__name__ for x in stack)
            self._refuse(nextlayer, "non_http", f"this connection cannot be inspected ({names})", speak_http=False)

    def _proxy_port(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        kind = _no_wait_for_http(classify(data), data)
        if kind == WAIT:
            self.first_bytes.wait(nextlayer)
        elif kind == H2C:
            self._refuse(nextlayer, "h2c_refused", "HTTP/2 prior knowledge is refused on the proxy port")
        elif kind == TLS:
            self._refuse(nextlayer, "non_http", "TLS to the proxy port is not supported; use plain HTTP and CONNECT", speak_http=False)
        elif kind == OTHER:
            self._refuse(nextlayer, "non_http", "the proxy port speaks HTTP/1 only")
        else:
            self.http.proxy_port(nextlayer)

    def _tunnel_start(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        kind = _no_wait_for_http(classify(data), data)
        if kind == WAIT:
            self.first_bytes.wait(nextlayer)
        elif kind == TLS:
            self.first_bytes.client_hello(nextlayer, data, self._tunnel_tls)
        else:
            self._http_only(nextlayer, kind, "cleartext HTTP/2 (prior knowledge) is refused in tunnels",
                            "the tunnel carries neither TLS nor HTTP")

    def _tunnel_tls(self, hold: HoldLayer, hello: ClientHello) -> None:
        if self._relayed_unread(hold, hello):
            return
        self._tls_layers(hold)

    @staticmethod
    def _tls_layers(hold: HoldLayer) -> None:
        server_tls = ServerTLSLayer(hold.context)
        server_tls.child_layer = ClientTLSLayer(hold.context)
        hold.layer = server_tls

    def _relayed_unread(self, nextlayer: HoldLayer, hello: ClientHello) -> bool:
        """A tunnel a passthrough rule allowed: the whole ClientHello is here; if it passes every
        check, relay the connection as plain TCP (no TLS layers: as fast as mitmproxy's own
        ignore_hosts). True when decided here; False leaves the hello to the TLS layers, where the
        TLS guard refuses it."""
        conn = self.state.connections.get(nextlayer.context.client.id)
        if conn is None or conn.phase != PASSTHROUGH:
            return False
        extensions = list(hello.extensions)
        step = conn.passthrough_hello(hello.sni, extensions)
        if not step.admitted:
            return False
        passthrough.record(self.state, conn, step, hello.sni, extensions)
        nextlayer.context.server.address = step.upstream
        conn.relay(step)
        nextlayer.layer = TCPLayer(nextlayer.context, ignore=True)
        return True

    def _transparent_start(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        context = nextlayer.context
        conn = self.state.connection(context.client.id, context.client.peername, "transparent")
        if context.server.address:
            conn.set_original((str(context.server.address[0]), int(context.server.address[1])))
        kind = classify(data)
        if kind == WAIT:
            self.first_bytes.wait(nextlayer)
        elif kind == TLS:
            # The whole ClientHello, within its budget, before the TLS guard looks up any rule.
            self.first_bytes.client_hello(nextlayer, data, lambda hold, hello: self._tls_layers(hold))
        elif kind == H2C:
            self._refuse(nextlayer, "h2c_refused", "cleartext HTTP/2 (prior knowledge) is refused")
        elif kind == HTTP:
            self.http.inspected(nextlayer)
        else:
            self._raw_tcp(nextlayer, conn)

    def _raw_tcp(self, nextlayer: layer.NextLayer, conn: ClientSession) -> None:
        """Bytes that are neither TLS nor HTTP: the session decides whether a `protocol: tcp` rule
        relays them (ClientSession.raw_tcp); this audits, records and applies its step."""
        engine = self.state.require_engine()
        scope = self.state.scope(conn)
        step = conn.raw_tcp(engine, scope, lambda address: self.state.dns_memory.names_for(conn.address, address)
                            if conn.address else set())
        if step.host is None:  # no destination to name: refused as the other bytes it cannot inspect
            self._refuse(nextlayer, step.decision.reason, step.decision.message, speak_http=False)
            return
        # allow, deny, or (report mode) would_deny: from the decision, never by hand.
        self.state.record(
            event="connection", **connection_fields(conn, scope.sandbox), **verdict_fields(step.decision),
            host=step.host, port=step.port, address=step.host if step.decision.allowed else None, protocol="tcp",
        )
        if not step.admitted:
            nextlayer.layer = RefusalLayer(nextlayer.context, step.decision, speak_http=False)
            return
        self.state.establish(nextlayer.context.client.id, conn, step.establish)
        if not conn.relay(step):  # decided under a policy that a reload replaced meanwhile, and revoked
            nextlayer.layer = RefusalLayer(nextlayer.context, conn.poisoned, speak_http=False)
            return
        nextlayer.layer = GatewayTcpLayer(nextlayer.context)

    def _inside_tls(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        alpn = nextlayer.context.client.alpn
        if alpn == b"h2":
            if data.startswith(H2_PREFACE[: len(data)]):
                self.http.inspected(nextlayer)
            else:
                self._refuse(nextlayer, "non_http", "ALPN said h2 but the bytes are not HTTP/2", speak_http=False)
        elif alpn not in (None, b"", b"http/1.1", b"http/1.0"):
            self._refuse(nextlayer, "non_http", "only HTTP is allowed inside TLS", speak_http=False)
        elif (kind := _no_wait_for_http(classify(data), data)) == WAIT:
            self.first_bytes.wait(nextlayer)
        else:
            self._http_only(nextlayer, kind, "HTTP/2 without ALPN negotiation is refused",
                            "the TLS stream carries something other than HTTP")

    def _http_only(self, nextlayer: layer.NextLayer, kind: str, h2c_refused: str, non_http: str) -> None:
        """Cleartext bytes where only HTTP/1 may follow (in a tunnel, inside TLS without h2): the HTTP
        layer, or the refusal that says why not."""
        if kind == H2C:
            self._refuse(nextlayer, "h2c_refused", h2c_refused)
        elif kind == HTTP:
            self.http.inspected(nextlayer)
        else:
            self._refuse(nextlayer, "non_http", non_http)

    def running(self):
        # The decisions here are the only ones: mitmproxy's own next_layer would decide on too few
        # bytes (and fall back to raw TCP or DNS relaying) whenever this guard waits for more.
        builtin = ctx.master.addons.get("nextlayer")
        if builtin is not None and builtin is not self:
            ctx.master.addons.remove(builtin)

    def _refuse(self, nextlayer: layer.NextLayer | HoldLayer, reason: str, message: str, speak_http: bool = True,
                farewell: bytes = b"") -> None:
        """`farewell`: raw bytes (a TLS alert) sent instead of an HTTP answer; no HTTP status is then
        recorded as sent."""
        decision = Decision.deny(reason, message)
        context = nextlayer.context
        conn = self.state.connections.get(context.client.id)
        pin = conn.tunnel if conn else None
        self.state.record(
            event="connection",
            **connection_fields(conn, self.state.scope(conn).sandbox if self.state.engine else None),
            **verdict_fields(decision, status_sent=not farewell),
            host=pin.host.value if pin else None,
            port=pin.port if pin else None,
            sni=context.client.sni,
        )
        page = self.http.page(context, decision) if speak_http and not farewell else None
        nextlayer.layer = RefusalLayer(context, decision, speak_http, farewell, page)
