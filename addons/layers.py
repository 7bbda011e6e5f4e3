"""The gateway's HTTP layer, which composes the pieces it runs on a client connection, and its TCP layer.

- `GatewayHttpLayer` is mitmproxy's HttpLayer with a gateway HTTP/1 server under it: requests
  mitmproxy's parser rejects (a malformed host in the request line, broken framing) and errors
  mitmproxy answers itself (upstream failures, validation) are answered in the gateway's format
  (text body, `X-Egress-Reason`) and recorded in the audit log; request heads are size-limited.
  Its pieces: addons/http1_server.py (HTTP/1 clients), addons/http2_server.py (HTTP/2 clients),
  addons/http_stream.py (each request's stream); their refusals: addons/refusals.py.
- `TargetFormHttpLayer` (the explicit proxy port) also makes each request remember its target
  as sent: mitmproxy rewrites absolute-form targets to origin-form before any hook sees them,
  and derives a destination from Host for origin-form requests; the gateway must tell them apart.
- `GatewayTcpLayer`: mitmproxy's TCP layer, bounded.

Connections refused or held without HTTP: addons/refusal_layers.py.
"""

from __future__ import annotations

import time

from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import (
    GetHttpConnection,
    GetHttpConnectionCompleted,
    HttpLayer,
    HttpStream,
    RequestHeaders,
)
from mitmproxy.proxy.layers.http._http3 import Http3Server
from mitmproxy.proxy.layers.http import is_h3_alpn
from mitmproxy.proxy.layers.tcp import TCPLayer

from gateway.options import DEFAULT_HEAD_TIMEOUT, DEFAULT_MAX_HEAD_BYTES, DEFAULT_MAX_IDLE_UPSTREAMS

from . import read_ahead
from .refusals import UPSTREAM_OVER_BUDGET, OnRefusal
from .respond import PageFor
from .http1_server import GatewayHttp1Server
from .http2_server import GatewayHttp2Server
from .http_stream import END_STREAM_ATTR, BodyIdleCheck, BodyLimits, GatewayHttpStream

TARGET_FORM_ATTR = "_egress_target_form"  # "origin" | "absolute" | "authority" | "asterisk"
RAW_AUTHORITY_ATTR = "_egress_raw_authority"
_NONE_ENDED: frozenset = frozenset()  # the ended connections of every layer with none waiting to be dropped


class _NotHeld:
    """Where an event for an upstream connection the layer does not hold goes: nowhere. A stream
    whose client gives up while it believes it talks upstream (its request done, no answer yet)
    tells its upstream connection, even when the gateway answered the request itself and none was
    opened; mitmproxy's layer then found no such connection (KeyError, "mitmproxy has crashed!",
    the client connection dropped; seen under tests/fuzz/test_front_door_fuzz.py)."""

    @staticmethod
    def handle_event(event: events.Event) -> layer.CommandGenerator[None]:
        return iter(())


class _Connections(dict):
    """The HTTP layer's connections. Every upstream connection the layer opens is in it from the
    moment it is opened until it is over and no stream names it (`_forget_ended`): one that is not
    was never opened (the placeholder a request starts with, the original destination in
    transparent mode), and has nothing to be told. (mitmproxy also looks up an injected message's
    server connection here and falls back to the client's on a miss; the gateway injects none.)"""

    def __missing__(self, conn):
        if isinstance(conn, Server):
            return _NotHeld
        raise KeyError(conn)


class GatewayHttpLayer(HttpLayer):
    """HttpLayer whose HTTP/1 client side is a `GatewayHttp1Server`."""

    def __init__(self, context, mode, on_refusal: OnRefusal, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 head_timeout: float = DEFAULT_HEAD_TIMEOUT, body_limits: BodyLimits | None = None,
                 page_for: PageFor | None = None):
        super().__init__(context, mode)
        self.connections = _Connections()
        self.on_refusal = on_refusal
        self.page_for = page_for  # how the policy words the servers' refusals (addons/respond.py)
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        self.body_limits = body_limits or BodyLimits()
        self._ended: set | frozenset = _NONE_ENDED  # upstream connections whose close was handled, not yet dropped
        self._recent: dict = {}  # upstream connections, the least recently handed to a stream first

    _idle_wakeup: commands.RequestWakeup | None = None

    def _handle_event(self, event: events.Event):
        if isinstance(event, events.Wakeup) and event.command is self._idle_wakeup:
            self._idle_wakeup = None
            yield from self._check_idle_bodies()
            return
        yield from self._handle(event)
        if self._idle_wakeup is None and self.body_limits.idle_timeout > 0 and self._bodies_under_way():
            self._idle_wakeup = commands.RequestWakeup(self.body_limits.idle_timeout)
            yield self._idle_wakeup

    def _bodies_under_way(self) -> list[float]:
        """When each body under way on this connection last moved."""
        found = []
        for stream in self.streams.values():
            if isinstance(stream, GatewayHttpStream) and (since := stream._idle_since()) is not None:
                found.append(since)
        return found

    def _sandbox_key(self) -> str | None:
        try:
            return self.body_limits.sandbox(self.context) if self.body_limits.sandbox is not None else None
        except Exception:  # fail closed: summed under one key for every client without one
            return "unknown"

    def _check_idle_bodies(self) -> layer.CommandGenerator[None]:
        """Each stream whose body went without a byte for the idle timeout ends (it decides how);
        then the timer is set for the next one due, while any stream is left."""
        timeout = self.body_limits.idle_timeout
        now = time.monotonic()
        for stream in list(self.streams.values()):
            since = stream._idle_since() if isinstance(stream, GatewayHttpStream) else None
            if since is not None and now - since >= timeout:
                yield from self.event_to_child(stream, BodyIdleCheck())
        due = self._bodies_under_way()
        if due and timeout > 0:
            self._idle_wakeup = commands.RequestWakeup(max(timeout - (now - min(due)), 0.05))
            yield self._idle_wakeup

    def _handle(self, event: events.Event):
        if isinstance(event, events.Start):
            make = self.body_limits.account
            if is_h3_alpn(self.context.client.alpn):
                server = Http3Server(self.context.fork())
            elif self.context.client.alpn == b"h2":
                server = GatewayHttp2Server(self.context.fork(), self.on_refusal, self.streams,
                                            self._sandbox_key(), make(self.context) if make is not None else None,
                                            self.page_for)
            else:
                server = GatewayHttp1Server(self.context.fork(), self.on_refusal, self.max_head_bytes,
                                            self.head_timeout, self._sandbox_key(), self.streams,
                                            make(self.context) if make is not None else None, self.page_for)
            self.connections.setdefault(self.context.client, server)
            yield from self.event_to_child(self.connections[self.context.client], event)
            return
        yield from super()._handle_event(event)
        if isinstance(event, events.ConnectionClosed) and event.connection is not self.context.client:
            if self._ended is _NONE_ENDED:  # (a set of its own only while one waits to be dropped)
                self._ended = set()
            self._ended.add(event.connection)
            self._forget_ended()

    def _forget_ended(self) -> None:
        """Drop upstream connections that are over: mitmproxy keeps every one it opened for a client
        connection until the client leaves (each with its TLS layer, HTTP client and last request
        and response), and scans them all for every request. An HTTP/2 client's requests to an
        HTTP/1 origin each take a connection of their own, and an origin that closes after a
        response makes the next request open another: one long client connection grew without
        bound. Only connections whose close event has been handled are dropped (no event can name
        them again); those that failed stay (mitmproxy answers the next request for the same
        destination with their error), and so do those a stream or a waiting request still names."""
        if not self._ended:
            return
        in_use = {stream.context.server for stream in self.streams.values()}
        for conn in list(self._ended):
            if conn.state is ConnectionState.CLOSED and conn not in in_use and conn not in self.waiting_for_establishment:
                self._ended.discard(conn)
                if conn.error is None:
                    self.connections.pop(conn, None)
        if not self._ended:
            self._ended = _NONE_ENDED

    def get_connection(self, event: GetHttpConnection, *, reuse: bool = True) -> layer.CommandGenerator[None]:
        """No upstream connection for a stream the client already reset: mitmproxy opens one per
        waiting stream when an HTTP/2 client's requests go to an HTTP/1 upstream."""
        stream = self.command_sources.get(event)
        reset = stream.client_reset() if isinstance(stream, GatewayHttpStream) else None
        if reset is not None:
            self.command_sources.pop(event)
            yield from self.event_to_child(stream, GetHttpConnectionCompleted(event, (None, reset)))
            return
        self._forget_ended()  # those a stream still named when they closed
        self._forget_over_budget()
        yield from super().get_connection(event, reuse=reuse)
        yield from self._close_idle_past_limit(stream)

    def _forget_over_budget(self) -> None:
        """A dial the socket budget refused (addons/limits.py) says nothing of its destination, but
        mitmproxy answers every later request for a destination with the error of a connection to
        it that failed: an HTTP/2 client's requests kept getting 503 `too_many_connections` on that
        connection after the sandbox's other connections had closed (review 38), a tunnel's
        too. Such a connection is forgotten, so the next request asks the budget again."""
        for conn in [c for c in self.connections if c.error and UPSTREAM_OVER_BUDGET in c.error]:
            if conn not in self.waiting_for_establishment:
                del self.connections[conn]
        server = self.context.server
        if server.error and UPSTREAM_OVER_BUDGET in server.error and not server.connected:
            server.error = None

    def _close_idle_past_limit(self, stream) -> layer.CommandGenerator[None]:
        """Keep at most `egress_max_idle_upstreams_per_connection` idle upstream connections: mitmproxy
        keeps one open per destination for reuse and never closes an idle one, so plain-HTTP requests
        on one proxy connection, each to another destination, held a socket and ~12 KB each for as
        long as the client stayed (review 19: 10,600 sockets from one sandbox, other sandboxes' dials
        then failed with EMFILE). The least recently used idle ones are closed; a later request to
        their destination opens a new connection."""
        for conn in [c for c in self._recent if c not in self.connections]:
            del self._recent[conn]
        for conn in self.connections:
            if conn is not self.context.client and conn not in self._recent:
                self._recent[conn] = None
        server = getattr(getattr(stream, "context", None), "server", None)
        if server in self._recent:  # handed to a stream: now the most recently used
            del self._recent[server]
            self._recent[server] = None
        limit = max(1, int(getattr(self.context.options, "egress_max_idle_upstreams_per_connection",
                                   DEFAULT_MAX_IDLE_UPSTREAMS)))
        if len(self._recent) <= limit:
            return
        in_use = {s.context.server for s in self.streams.values()}
        idle = [c for c in self._recent if c.connected and c not in in_use and c not in self.waiting_for_establishment]
        for conn in idle[:max(0, len(idle) - limit)]:
            del self._recent[conn]
            yield commands.CloseConnection(conn)

    def make_stream(self, stream_id: int) -> layer.CommandGenerator[None]:
        stream = self.streams[stream_id] = self.stream_class(self.context.fork(), stream_id)
        stream.on_refusal = self.on_refusal
        stream.body_limits = self.body_limits
        # What HttpStream's cached_property `mode` finds (its parent's mode), set as a plain attribute:
        # a cached_property writes into the instance's __dict__, which gave every stream a dict of
        # its own (addons/instance_layout.py).
        stream.mode = self.mode
        yield from self.event_to_child(self.streams[stream_id], events.Start())

    stream_class: type[HttpStream] = GatewayHttpStream


def target_form(request) -> str | None:
    return getattr(request, TARGET_FORM_ATTR, None)


def raw_authority(request) -> str | None:
    return getattr(request, RAW_AUTHORITY_ATTR, None)


def end_stream(request) -> bool | None:
    """Whether the request's head ended it; None when no gateway HTTP layer saw it."""
    return getattr(request, END_STREAM_ATTR, None)


class GatewayTcpLayer(TCPLayer):
    """mitmproxy's TCP layer for a `protocol: tcp` rule's connections, bounded: it kept every read
    in `flow.messages` for the life of the connection (a long stream grew the worker without end),
    and read on while each read's `tcp_message` hook ran (addons/read_ahead.py)."""

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().handle_event(event)
        read_ahead.settle(self)

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().relay_messages(event)
        if self.flow is not None and len(self.flow.messages) > 1:
            del self.flow.messages[:-1]  # every hook has seen them; only the last is kept


class _TargetFormStream(GatewayHttpStream):
    def state_wait_for_request_headers(self, event: RequestHeaders) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestHeaders):
            request = event.request
            authority = request.data.authority.decode("utf-8", "surrogateescape")
            if request.method == "CONNECT":
                form = "authority"
            elif request.data.path == b"*":
                form = "asterisk"
            elif authority and not (request.is_http2 or request.is_http3):
                form = "absolute"
            elif request.is_http2 or request.is_http3:
                form = "absolute" if authority else "origin"
            else:
                form = "origin"
            setattr(request, TARGET_FORM_ATTR, form)
            setattr(request, RAW_AUTHORITY_ATTR, authority)
        return (yield from super().state_wait_for_request_headers(event))


class TargetFormHttpLayer(GatewayHttpLayer):
    stream_class = _TargetFormStream
