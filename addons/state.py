"""State shared by the guards: the engine, and each client connection's session
(gateway/session.py ClientSession: what the connection is pinned to, what it may dial).

Sessions are keyed by mitmproxy's client connection id, dropped when the client disconnects.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from gateway.audit import AuditLog
from gateway.budget import Account, Ledger
from gateway.decision import Decision
from gateway.dnsmemory import DnsMemory
from gateway.engine import Engine
from gateway.hostnames import IPAddress
from gateway.identity import scope_of
from gateway.policy import DEFAULT_SANDBOX_ID, Policy, Scope
from gateway.registry import Registry, client_address
from gateway.redact import Redactor, SecretMemory
from gateway.revocation import Established
from gateway.session import ClientSession

from .signals import SignalHub


def _peer_address(peername: tuple | None):
    """The client's IP from its peer name (a scope id dropped), or None."""
    if not peername:
        return None
    try:
        return ipaddress.ip_address(str(peername[0]).split("%", 1)[0])
    except ValueError:
        return None


class GatewayState:
    """The one object every guard shares: the engine (swapped whole on reload) and the connections."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.audit: AuditLog = AuditLog(None)
        self.connections: dict[str, ClientSession] = {}
        self.by_address: dict[IPAddress, set[str]] = {}  # client address -> ids of its open connections
        self.by_sandbox: dict[str, set[str]] = {}  # sandbox a token named -> ids of its open connections
        self.dns_memory = DnsMemory()
        self.placeholder_key: bytes | None = None  # HMAC key for placeholders, from the confdir
        # Called with every recorded decision (the audit entry plus private keys starting with
        # "_", e.g. "_decision_seconds"); metrics subscribe here.
        self.decision_listeners: list[Callable[[dict[str, Any]], None]] = []
        # Told (kind, seconds) for every policy check; see Engine.timings.
        self.timing_listeners: list[Callable[[str, float], None]] = []
        # Told of every engine installed (start-up and each reload), after it is in place.
        self.install_listeners: list[Callable[[Engine], None]] = []
        # Told (client id, connection) when a connection became long-lived under an engine that is no
        # longer the current one (decided while a reload happened): it must be judged again now.
        self.stale_listeners: list[Callable[[str, ClientSession, bool], None]] = []  # (.., registry moved)
        # Called by RequestGuard for every allowed request before its audit line, with (flow, decision,
        # scope, engine, injected secret names): a refusal to answer instead, or None
        # (addons/rate_limits.py).
        self.request_limiters: list[Callable[..., Decision | None]] = []
        # Called first for EVERY request head (and CONNECT) a sandbox sends, allowed or not, before
        # any decision work, with (connection, scope): a refusal, or None (the per-sandbox request
        # rate, addons/rate_limits.py). A flood of requests the rules deny costs its sender too.
        self.request_gates: list[Callable[..., Decision | None]] = []
        self.dns_gates: list[Callable[..., Decision | None]] = []  # each DNS-mode query (addons/rate_limits.py)
        # Told (sandbox, rule, "upload" | "download", bytes) for bytes counted against policy limits.
        self.usage_listeners: list[Callable[[str | None, str | None, str, int], None]] = []
        self.wait_listeners: list[Callable[[str | None, float], None]] = []  # a read waited for its sandbox's loop share
        self._generation = 0
        # Sockets of the gateway's own besides the proxy listeners (the metrics port): every engine
        # installed refuses them as destinations.
        self.extra_listeners: list[tuple[IPAddress, int]] = []
        self.signals = SignalHub()  # SIGHUP: audit log reopen, policy reload
        # Every secret value held (current, past, and those of requests in flight): what the
        # response redactor, the log filter, the audit scrubber and refusal pages all redact.
        self.secret_memory = SecretMemory()
        self._secrets_seen: tuple | None = None
        # Bytes buffered per connection and per sandbox (limits set by addons/budget.py).
        self.buffers = Ledger()
        # Sandboxes the platform registered through the control API, and their grants (addons/control.py
        # keeps it; every scope lookup consults it). Shared with each engine for grants' transient rules.
        self.registry = Registry()
        # Told of every Change applied to the registry (gateway/registry.py), after it is in place: open
        # connections from its addresses judged again (addons/revocation.py), windows dropped (rate_limits).
        self.registry_listeners: list[Callable[..., None]] = []

    def sandbox_key(self, conn: ClientSession | None, scope: Scope | None = None) -> str:
        """What a per-sandbox budget counts against (connections, rates, buffers, the loop's share):
        the sandbox, or the client address when the policy has no sandboxes section. With proxy
        tokens, a connection not named yet (at accept, before its CONNECT's token is read) by its
        address, its source range or a registration counts against its address, not against the
        `default` entry every token-named sandbox would share (review 23: one client without a token
        held the cap, or drained the connection rate, of them all)."""
        policy = self.engine.policy if self.engine is not None else None
        if policy is not None and policy.sandboxes is not None:
            scope = scope or self.scope(conn)
            if (policy.tokens is not None and conn is not None and conn.identity is None
                    and scope.sandbox in (None, DEFAULT_SANDBOX_ID)):
                return f"address:{conn.address}"
            return f"sandbox:{scope.sandbox}"
        return f"address:{conn.address if conn is not None else None}"

    def buffer_account_of(self, client) -> Account:
        """A new share of the buffer ledger for a buffer of this mitmproxy client."""
        return self.buffers.account(client.id, self.sandbox_key(self.connections.get(client.id)))

    def buffer_account(self, context) -> Account:
        """A new share of the buffer ledger for a buffer of this layer context's client."""
        client = context.client
        return self.buffers.account(client.id, self.sandbox_key(self.connections.get(client.id)))

    def redactor(self) -> Redactor | None:
        """The one redactor: every value the store holds now, every value held before (bounded),
        and every value a request in flight carried. None while no secret was ever held."""
        store = self.engine.secrets if self.engine is not None else None
        if store is not None and store.sources:
            values = store.known_values()  # refreshes file-backed values (one stat each)
            key = (id(store), store.generation)
            if key != self._secrets_seen:
                self.secret_memory.remember(values)
                self._secrets_seen = key
        redactor = self.secret_memory.redactor()
        return redactor or None

    def install(self, engine: Engine) -> None:
        """Make `engine` (policy, resolver, secrets) the one every guard uses. One assignment, and
        each hook takes the engine once, so a request is judged wholly by the old or the new one."""
        if self.extra_listeners:
            engine.guard = engine.guard.with_self((), self.extra_listeners)
        engine.timings = self._timing if self.timing_listeners else None
        engine.grant_rules = self.registry.grant_rules  # type: ignore[assignment]
        if not engine.generation:  # the same engine installed again (configure) keeps its number
            self._generation += 1
            engine.generation = self._generation
        self.engine = engine
        for listener in self.install_listeners:
            try:
                listener(engine)
            except Exception:
                logging.getLogger("egress").exception("egress gateway: install listener failed")

    def apply_registry(self, op: dict):
        """Apply one control op (gateway/registry.py `Registry.apply`) and tell every listener: the
        registry is changed first, so everything they judge is judged by the new state."""
        change = self.registry.apply(op)
        for listener in self.registry_listeners:
            try:
                listener(change)
            except Exception:
                logging.getLogger("egress").exception("egress gateway: registry listener failed")
        return change

    def establish(self, client_id: str, conn: ClientSession, established: Established,
                  registry_seq: int | None = None) -> None:
        """A guard made something long-lived on this connection, judged by the engine of generation
        `established.generation`, under the registry as it was after `registry_seq` ops (None: not
        looked at). If a reload installed another engine, or the control API changed the registry,
        while that decision was under way (a CONNECT waiting for DNS, an upgrade waiting for its
        101), it is judged again at once: no connection slips past a reload or a revocation by
        being decided during it (review 26: a grant revoked during the DNS wait left 29 of 30
        tunnels open for good)."""
        conn.establish(established)
        moved = registry_seq is not None and registry_seq != self.registry.seq
        if self.engine is not None and (moved or established.generation != self.engine.generation):
            for listener in self.stale_listeners:
                try:
                    listener(client_id, conn, moved)
                except Exception:
                    logging.getLogger("egress").exception("egress gateway: stale listener failed")

    def count_usage(self, sandbox: str | None, rule: str | None, direction: str, count: int) -> None:
        for listener in self.usage_listeners:
            try:
                listener(sandbox, rule, direction, count)
            except Exception:  # a metrics bug must never change a decision
                logging.getLogger("egress").exception("egress gateway: usage listener failed")

    def _timing(self, kind: str, seconds: float) -> None:
        for listener in self.timing_listeners:
            try:
                listener(kind, seconds)
            except Exception:
                logging.getLogger("egress").exception("egress gateway: timing listener failed")

    def record(self, **fields: Any) -> dict[str, Any]:
        """Record one decision: one audit line, and every listener told."""
        if not self.decision_listeners and not self.audit.enabled:
            return fields  # no audit log, no metrics: nothing to build on the hot path
        private = {k: fields.pop(k) for k in [k for k in fields if k.startswith("_")]}
        engine = self.engine
        self.audit.sandboxed = engine is not None and engine.policy.sandboxes is not None
        entry = self.audit.record(**fields)
        if self.decision_listeners:
            event = entry | private
            for listener in self.decision_listeners:
                try:
                    listener(event)
                except Exception:  # a metrics bug must never change a decision
                    logging.getLogger("egress").exception("egress gateway: decision listener failed")
        return entry

    def connection(self, client_id: str, peername: tuple | None = None, mode: str = "regular") -> ClientSession:
        state = self.connections.get(client_id)
        if state is None:
            peer = f"{peername[0]}:{peername[1]}" if peername else "?"
            state = self.connections[client_id] = ClientSession(peer, mode, _peer_address(peername))
            if state.address is not None:
                self.by_address.setdefault(client_address(state.address), set()).add(client_id)
        return state

    def identified(self, client_id: str, conn: ClientSession) -> None:
        """`conn` proved it is a sandbox (a token): indexed by that sandbox id for `connections_of`."""
        self.by_sandbox.setdefault(conn.identity.sandbox, set()).add(client_id)

    def connections_from(self, addresses) -> list[tuple[str, ClientSession]]:
        """The open connections from these client addresses (a registry change judges only them)."""
        found = []
        for address in addresses:
            for client_id in list(self.by_address.get(client_address(address), ())):
                conn = self.connections.get(client_id)
                if conn is not None:
                    found.append((client_id, conn))
        return found

    def connections_of(self, sandbox: str, addresses=()) -> list[tuple[str, ClientSession]]:
        """The open connections a registry change to `sandbox` may touch: those from its addresses
        (named by the registration), and those whose token named `sandbox` (a registration with
        or without addresses gives them its grants). Each once."""
        found = self.connections_from(addresses)
        ids = self.by_sandbox.get(sandbox)
        if ids:
            seen = {client_id for client_id, _ in found}
            for client_id in list(ids):
                conn = self.connections.get(client_id)
                if conn is not None and client_id not in seen:
                    found.append((client_id, conn))
        return found

    def sandbox_key_of_peer(self, peername: tuple | None) -> str:
        """`sandbox_key` for a client known only by its peer address (a connection being accepted)."""
        return self.sandbox_key(self.session_of_peer(peername))

    @staticmethod
    def session_of_peer(peername: tuple | None, mode: str = "regular") -> ClientSession:
        """A session for a connection known only by its peer address, not registered (one refused
        as it is accepted, before mitmproxy has a client for it)."""
        peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        return ClientSession(peer, mode, _peer_address(peername))

    def scope(self, conn: ClientSession | None) -> Scope:
        """The rules this client may use under the current policy (looked up per decision, so a
        reloaded policy or a control API change applies at once): by its identity if it proved one,
        else by the sandbox registered for its address (gateway/registry.py), else by its address."""
        return self.scope_under(self.require_engine().policy, conn)

    def scope_under(self, policy: Policy, conn: ClientSession | None) -> Scope:
        """`scope` under a given policy (an engine taken once by a hook)."""
        if conn is None:
            return policy.scope_for(None)
        return scope_of(policy, conn.address, conn.identity, self.registry)

    def forget(self, client_id: str) -> None:
        conn = self.connections.pop(client_id, None)
        if conn is not None and conn.address is not None:
            _discard(self.by_address, client_address(conn.address), client_id)
        if conn is not None and conn.identity is not None:
            _discard(self.by_sandbox, conn.identity.sandbox, client_id)

    def gate(self, conn: ClientSession, scope: Scope) -> Decision | None:
        """The first refusal of `request_gates` for a request head, or None."""
        for gate in self.request_gates:
            if (refusal := gate(conn, scope)) is not None:
                return refusal
        return None

    def dns_gate(self, conn: ClientSession, scope: Scope) -> Decision | None:
        """The first refusal of `dns_gates` for a DNS-mode query, or None."""
        for gate in self.dns_gates:
            if (refusal := gate(conn, scope)) is not None:
                return refusal
        return None

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("no policy loaded")
        return self.engine


def _discard(index: dict, key, client_id: str) -> None:
    """`client_id` out of `index[key]`, and the key out once its set is empty (bounded indexes)."""
    ids = index.get(key)
    if ids is not None:
        ids.discard(client_id)
        if not ids:
            del index[key]
