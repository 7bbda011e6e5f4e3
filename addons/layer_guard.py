"""Decides the protocol layer for every connection the gateway knows how to inspect, and refuses
the rest at once.

mitmproxy's own next_layer falls back to raw TCP, DNS-over-TCP relaying or passthrough in several
cases; here, after a CONNECT only TLS or HTTP/1 may follow, after TLS only HTTP (HTTP/2 when ALPN
said h2), and on the proxy port only HTTP/1 requests. Anything else gets a 400 and a close,
without waiting for a request head that will never come, and without an upstream connection.
"""

from __future__ import annotations

import logging
import re

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers import ClientTLSLayer, HttpLayer, ServerTLSLayer, modes
from mitmproxy.proxy.layers.http import HTTPMode, HttpStream

from gateway.decision import Decision

from .failclosed import fail_closed
from .layers import RefusalLayer, TargetFormHttpLayer
from .state import GatewayState

logger = logging.getLogger("egress")

H2_PREFACE = b"PRI * HTTP/2.0"
_METHOD_PREFIX = re.compile(rb"^[A-Z]{1,20}(?: |$)")


def _looks_like_http1(data: bytes) -> bool:
    """A request line starts with an upper-case method token and a space (or we have seen only the
    start of the token so far); anything else cannot be HTTP/1."""
    return bool(_METHOD_PREFIX.match(data[:21]))


# The layer stacks the gateway knows, by role: the explicit proxy port, a CONNECT tunnel before
# its first byte, and a CONNECT tunnel after the client's TLS handshake.
PROXY_PORT = ("proxy",)
TUNNEL = ("proxy", "http", "stream")
TUNNEL_TLS = ("proxy", "http", "stream", "server_tls", "client_tls")
_ROLES = (
    (modes.HttpProxy, "proxy"),
    (HttpLayer, "http"),
    (HttpStream, "stream"),
    (ServerTLSLayer, "server_tls"),
    (ClientTLSLayer, "client_tls"),
)


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
        self.state = state

    @fail_closed(_refuse_on_error)
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        if nextlayer.layer is not None:
            # mitmproxy's own next_layer ran first (embedded order) and its layers are already on
            # the stack; the decision here replaces them.
            if nextlayer.layer in context.layers:
                del context.layers[context.layers.index(nextlayer.layer) :]
            nextlayer.layer = None
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
        elif shape == TUNNEL_TLS:
            self._inside_tls(nextlayer, data)
        else:
            names = "/".join(type(x).__name__ for x in stack)
            self._refuse(nextlayer, "non_http", f"this connection cannot be inspected ({names})", speak_http=False)

    def _proxy_port(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        if data[:3] == b"PRI":
            self._refuse(nextlayer, "h2c_refused", "HTTP/2 prior knowledge is refused on the proxy port")
        elif starts_like_tls_record(data):
            self._refuse(nextlayer, "non_http", "TLS to the proxy port is not supported; use plain HTTP and CONNECT", speak_http=False)
        elif not _looks_like_http1(data):
            self._refuse(nextlayer, "non_http", "the proxy port speaks HTTP/1 only")
        else:
            nextlayer.layer = TargetFormHttpLayer(nextlayer.context, HTTPMode.regular)

    def _tunnel_start(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        if starts_like_tls_record(data):
            server_tls = ServerTLSLayer(nextlayer.context)
            server_tls.child_layer = ClientTLSLayer(nextlayer.context)
            nextlayer.layer = server_tls
        elif data[:3] == b"PRI":
            self._refuse(nextlayer, "h2c_refused", "cleartext HTTP/2 (prior knowledge) is refused in tunnels")
        elif _looks_like_http1(data):
            nextlayer.layer = HttpLayer(nextlayer.context, HTTPMode.transparent)
        else:
            self._refuse(nextlayer, "non_http", "the tunnel carries neither TLS nor HTTP")

    def _inside_tls(self, nextlayer: layer.NextLayer, data: bytes) -> None:
        alpn = nextlayer.context.client.alpn
        if alpn == b"h2":
            if data.startswith(H2_PREFACE[: len(data)]):
                nextlayer.layer = HttpLayer(nextlayer.context, HTTPMode.transparent)
            else:
                self._refuse(nextlayer, "non_http", "ALPN said h2 but the bytes are not HTTP/2", speak_http=False)
        elif alpn not in (None, b"", b"http/1.1", b"http/1.0"):
            self._refuse(nextlayer, "non_http", "only HTTP is allowed inside TLS", speak_http=False)
        elif data[:3] == b"PRI":
            self._refuse(nextlayer, "h2c_refused", "HTTP/2 without ALPN negotiation is refused")
        elif _looks_like_http1(data):
            nextlayer.layer = HttpLayer(nextlayer.context, HTTPMode.transparent)
        else:
            self._refuse(nextlayer, "non_http", "the TLS stream carries something other than HTTP")

    def _refuse(self, nextlayer: layer.NextLayer, reason: str, message: str, speak_http: bool = True) -> None:
        decision = Decision.deny(reason, message)
        context = nextlayer.context
        conn = self.state.connections.get(context.client.id)
        pin = conn.tunnel if conn else None
        self.state.audit.record(
            event="connection",
            client=conn.client if conn else None,
            mode=conn.mode if conn else None,
            decision="deny",
            reason=reason,
            status=decision.status,
            host=pin.host.value if pin else None,
            port=pin.port if pin else None,
            sni=context.client.sni,
            message=message,
        )
        nextlayer.layer = RefusalLayer(context, decision, speak_http)
