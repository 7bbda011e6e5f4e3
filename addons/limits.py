"""Limits that protect the gateway itself: concurrent connections per sandbox (or per client
address when the policy has no sandboxes), and the sockets a sandbox holds against the worker's
open-file limit (gateway/sockets.py). A client over a limit is closed right after accept, before
any byte is read, with one audit line (`reason: too_many_connections`); an upstream connection
over one is not dialled, and its request is refused 503 `too_many_connections`.

The other limits live where the bytes are: request head size and head time in the gateway's
HTTP/1 server (`egress_max_head_bytes`, `egress_head_timeout`), idle connections in mitmproxy's
`tcp_timeout`, body sizes in mitmproxy's `body_size_limit`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import resource
from collections import Counter

from mitmproxy import ctx

from gateway.decision import Decision, verdict_fields
from gateway.session import PASSTHROUGH
from gateway.sockets import SocketLedger, worker_limit_for

from . import accept_gate, conn_close, fair_share, gc_freeze
from .audit_fields import connection_fields, mode_name
from .options import declare
from .refusals import UPSTREAM_OVER_BUDGET
from .state import GatewayState


def _open_files() -> int:
    """The worker's open-file limit, its soft limit raised to the hard one first (as Go's runtime
    and nginx's `worker_rlimit_nofile` do): a shell's default soft limit of 1,024 would leave a
    worker 760 sockets to share out while the system allows many more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # (an infinite hard limit the kernel caps lower: keep the soft one)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def mode_of_listener(listeners, listening: tuple | None) -> str:
    """The mode of the listener (mode name, its addresses) whose address is `listening`, as the
    audit spells it for a connection (addons/core.py); "regular" if none matches."""
    if listening:
        for mode, addresses in listeners:
            if any(tuple(a[:2]) == tuple(listening[:2]) for a in addresses):
                return mode
    return "regular"


def _listeners():
    """(mode name, listening addresses) of mitmproxy's running proxy servers; only read when a
    connection is refused at accept."""
    master = getattr(ctx, "master", None)
    proxyserver = master.addons.get("proxyserver") if master is not None else None
    found = []
    for instance in getattr(proxyserver, "servers", ()) or ():
        found.append((mode_name(instance.mode), list(instance.listen_addrs)))
    return found


def _relays(conn) -> bool:
    """Whether the connection relays bytes unread (a passthrough tunnel, raw TCP): no HTTP stream of
    its own reports a refused dial."""
    return conn.phase == PASSTHROUGH or any(e.kind == "tcp" for e in conn.established)


class ConnectionLimiter:
    def __init__(self, state: GatewayState):
        conn_close.install()  # a connection is released only after its socket is closed
        conn_close.on_linger("socket budget", self._lingers)
        accept_gate.install()  # ...and counted, or refused, as soon as it is accepted
        self.state = state
        self.open: Counter[str] = Counter()
        self._keys: dict[str, str] = {}
        self.sockets = SocketLedger(worker_limit_for(_open_files()))
        self._upstreams: dict[str, tuple[str, str]] = {}  # server connection id -> (sandbox key, client id)
        self._client_upstreams: dict[str, set[str]] = {}  # client id -> its server connections counted
        accept_gate.set_gate(accept_gate.Gate(self._accept_refusal, self._counted_ahead, self._uncounted,
                                              self._refused_at_accept))

    def load(self, loader):
        declare(loader, "egress_max_connections_per_sandbox", "egress_max_idle_upstreams_per_connection",
                "egress_max_upstream_connections_per_sandbox")

    def configure(self, updated: set[str]) -> None:
        if "egress_max_upstream_connections_per_sandbox" in updated:
            self.sockets.upstream_limit = max(0, int(ctx.options.egress_max_upstream_connections_per_sandbox))

    def _key(self, conn) -> str:
        return self.state.sandbox_key(conn)

    def _accept_refusal(self, peername: tuple) -> tuple[str, str | None]:
        """(the sandbox, why it may not hold another socket now) for a connection being accepted."""
        key = self.state.sandbox_key_of_peer(peername)
        return key, self.sockets.client_refusal(key)

    def _counted_ahead(self, key: str) -> None:
        self.sockets.opened(key, upstream=False)

    def _uncounted(self, key: str) -> None:
        self.sockets.closed(key, upstream=False)

    def _refused_at_accept(self, peername: tuple, refusal: str, listening: tuple | None = None) -> None:
        mode = mode_of_listener(_listeners(), listening)
        self._record_refusal(self.state.session_of_peer(peername, mode),
                             Decision.deny("too_many_connections", refusal))

    def client_connected(self, client):
        accept_gate.claim(fair_share.serving())  # (counted since its accept: counted here from now on)
        conn = self.state.connection(client.id, client.peername)
        key = self._key(conn)
        limit = ctx.options.egress_max_connections_per_sandbox
        over_share = self.sockets.client_refusal(key)
        if (limit and self.open[key] >= limit) or over_share:
            client.error = "egress gateway: too many connections"
            refusal = Decision.deny("too_many_connections", over_share or
                                    f"{self.open[key]} connections already open for {key} (limit {limit})")
            self._record_refusal(conn, refusal)  # closed at accept: no HTTP status is sent
            return
        self.open[key] += 1
        self._keys[client.id] = key
        self.sockets.opened(key, upstream=False)

    def client_disconnected(self, client):
        key = self._keys.pop(client.id, None)
        if key is not None:
            self.open[key] -= 1
            if self.open[key] <= 0:
                del self.open[key]
            self.sockets.closed(key, upstream=False)
        for server_id in self._client_upstreams.pop(client.id, ()):  # (its upstreams end with it)
            self._release(server_id)
        if not self._keys:
            self._schedule_trim()

    def server_connect(self, data) -> None:
        """An upstream connection is about to be dialled: counted against its sandbox, or not
        dialled when the sandbox holds its upstream cap, or its share of a worker whose sockets
        are taken (before, each sandbox could hold 1,000 x 9 sockets and a few exhausted the
        worker: accept() and every dial then failed for all)."""
        if data.server.error:
            return  # refused already (addons/upstream_guard.py)
        conn = self.state.connections.get(data.client.id)
        key = self._key(conn) if conn is not None else None
        if key is None:
            return
        refusal = self.sockets.upstream_refusal(key)
        if refusal is not None:
            # mitmproxy reports it on the stream (addons/refusals.py: 503, its line says which budget).
            data.server.error = f"{UPSTREAM_OVER_BUDGET}: {refusal}"
            if _relays(conn):
                # A relay (passthrough, raw TCP) has no stream to answer and audit the refusal: its
                # client only saw the connection end, and only the gateway log said why (review 38).
                self._record_refusal(conn, Decision.deny("too_many_connections", refusal))
            return
        self.sockets.opened(key, upstream=True)
        self._upstreams[data.server.id] = (key, data.client.id)
        self._client_upstreams.setdefault(data.client.id, set()).add(data.server.id)

    def _record_refusal(self, conn, refusal: Decision) -> None:
        """A `connection` line for a refusal no HTTP status reports."""
        sandbox = self.state.scope(conn).sandbox if self.state.engine is not None else None  # None: null
        self.state.record(event="connection", **connection_fields(conn, sandbox),
                          **verdict_fields(refusal, status_sent=False))

    def _lingers(self, handler, writer, gone) -> None:
        """One of the connection's sockets, closed, still sends what was queued (addons/conn_close.py):
        its descriptor stays counted against the sandbox until it is gone. Released with its
        connection, four sandboxes whose clients never read took a worker to EMFILE (review 40)."""
        client = handler.client
        key = self._keys.get(client.id)
        if key is None:
            conn = self.state.connections.get(client.id)
            if conn is None:
                return
            key = self._key(conn)
        self.sockets.lingers(key)
        gone.add_done_callback(lambda _: self.sockets.gone(key))

    def server_connect_error(self, data) -> None:
        self._release(data.server.id)

    def server_disconnected(self, data) -> None:
        self._release(data.server.id)

    def _release(self, server_id: str) -> None:
        counted = self._upstreams.pop(server_id, None)
        if counted is None:
            return
        key, client_id = counted
        self.sockets.closed(key, upstream=True)
        held = self._client_upstreams.get(client_id)
        if held is not None:
            held.discard(server_id)
            if not held:
                del self._client_upstreams[client_id]

    def _schedule_trim(self) -> None:
        """When the last connection closes, give memory back: closed connections leave reference
        cycles only a full collection frees, and glibc keeps freed memory unless asked to trim
        (measured: 1,000 tunnels left RSS at its ~240 MiB peak until both were done)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if getattr(self, "_trim", None) is None or self._trim.cancelled() or self._trim.when() < loop.time():
            self._trim = loop.call_later(1.0, self._trim_memory)

    def _trim_memory(self) -> None:
        if self._keys:
            return  # busy again
        gc_freeze.thaw_all()  # (what died frozen too: addons/gc_freeze.py freezes survivors)
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: the collection alone still frees the objects
        logging.getLogger("egress").debug("egress gateway: idle, memory trimmed")
