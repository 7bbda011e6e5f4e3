"""Limits that protect the gateway itself: concurrent connections per sandbox (or per client
address when the policy has no sandboxes). A client over the limit is closed right after accept,
before any byte is read, with one audit line (`reason: too_many_connections`).

The other limits live where the bytes are: request head size and head time in the gateway's
HTTP/1 server (`egress_max_head_bytes`, `egress_head_timeout`), idle connections in mitmproxy's
`tcp_timeout`, body sizes in mitmproxy's `body_size_limit`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections import Counter

from mitmproxy import ctx

from gateway.decision import Decision, verdict_fields

from . import conn_close, gc_freeze
from .audit_fields import connection_fields
from .options import declare
from .state import GatewayState


class ConnectionLimiter:
    def __init__(self, state: GatewayState):
        conn_close.install()  # a connection is released only after its socket is closed
        self.state = state
        self.open: Counter[str] = Counter()
        self._keys: dict[str, str] = {}

    def load(self, loader):
        declare(loader, "egress_max_connections_per_sandbox", "egress_max_idle_upstreams_per_connection")

    def _key(self, conn) -> str:
        return self.state.sandbox_key(conn)

    def client_connected(self, client):
        conn = self.state.connection(client.id, client.peername)
        key = self._key(conn)
        limit = ctx.options.egress_max_connections_per_sandbox
        if limit and self.open[key] >= limit:
            client.error = "egress gateway: too many connections"
            refusal = Decision.deny("too_many_connections",
                                    f"{self.open[key]} connections already open for {key} (limit {limit})")
            # Closed at accept: no HTTP status is sent.
            sandbox = self.state.scope(conn).sandbox if self.state.engine is not None else None  # None: null
            self.state.record(event="connection", **connection_fields(conn, sandbox),
                              **verdict_fields(refusal, status_sent=False))
            return
        self.open[key] += 1
        self._keys[client.id] = key

    def client_disconnected(self, client):
        key = self._keys.pop(client.id, None)
        if key is not None:
            self.open[key] -= 1
            if self.open[key] <= 0:
                del self.open[key]
        if not self._keys:
            self._schedule_trim()

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
