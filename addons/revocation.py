"""Revocation reaches open connections: on every policy change, each established connection is
judged again by the new engine (gateway/revocation.py decides; this addon only keeps the registry
and closes), and the ones it no longer allows are closed at both ends, with one audit line
(`event: connection`, `reason: revoked`) counted in `egress_revoked_connections_total{kind}`.

The registry is `GatewayState.connections`: each ClientSession lists what became long-lived on it
(`established`: pinned tunnels, passthrough and raw TCP relays, WebSockets), filled by the guards
when they admit it, and the whole entry goes when the client disconnects (EgressCore): bounded by
the open connections, nothing to leak. Nothing is done per request: a reload walks the open
connections once (O(open connections)), and a WebSocket is registered once, when it opens.

Closing a connection: mitmproxy 12.3 has one handler per client connection
(`proxyserver.connections[client.id]`, a ProxyConnectionHandler) holding every socket of it in
`transports` (the client's and each upstream's). The client's reader task is cancelled, as
mitmproxy's own idle timeout does, so nothing more the client sent is read and forwarded; and every
socket is aborted at once (TCP reset, unsent buffers dropped), so the upstream's side closes even
where the layers (a TCP relay, a WebSocket) would only have half-closed it. The connection's state
is also poisoned (every later request on it is refused with `revoked`) and its admitted upstream
addresses dropped, so no new upstream socket can open for it in the moment before it is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from mitmproxy import ctx, http

from gateway.decision import Decision, verdict_fields
from gateway.engine import Engine
from gateway.revocation import Established, failure, rejudge, revocation

from .audit_fields import connection_fields
from .failclosed import fail_closed
from .state import ClientSession, GatewayState

logger = logging.getLogger("egress")

FACTS = "egress_facts"  # flow.metadata: the RequestFacts a request was judged by (request guard)
GENERATION = "egress_generation"  # flow.metadata: the engine generation that judged it
REGISTRY_SEQ = "egress_registry_seq"  # flow.metadata: the registry's op count when its scope was taken


def close_client(client_id: str) -> bool:
    """Close every socket of one client connection now (see the module docstring). False when
    mitmproxy no longer knows the connection (it is already closing)."""
    master = getattr(ctx, "master", None)
    proxyserver = master.addons.get("proxyserver") if master is not None else None
    handler = proxyserver.connections.get(client_id) if proxyserver is not None else None
    if handler is None:
        return False
    client_io = handler.transports.get(handler.client)
    if client_io is not None and client_io.handler is not None:
        client_io.handler.cancel("egress gateway: revoked by a policy change")
    for io in list(handler.transports.values()):
        writer = io.writer
        transport = getattr(writer, "transport", None)
        with contextlib.suppress(Exception):
            if transport is not None:
                transport.abort()
            elif writer is not None:
                writer.close()
    return True


def _revoke_on_error(self: "Revoker", flow: http.HTTPFlow, error: Exception) -> None:
    conn = self.state.connections.get(flow.client_conn.id)
    if conn is not None:
        conn.poison(Decision.deny("internal_error", "the gateway failed while registering this WebSocket"))
    flow.kill()
    self.closer(flow.client_conn.id)


class Revoker:
    def __init__(self, state: GatewayState, closer=close_client):
        self.state = state
        self.closer = closer
        self._by = "the new policy"  # what changed, in a revocation's message
        self._swept = 0  # the engine generation the open connections were last judged by
        # client id -> flow id -> the flow of each registered request: a stream can die without any
        # hook saying so (an HTTP/2 reset after its answer), so dead ones are pruned by liveness
        self._flows: dict[str, dict[str, http.HTTPFlow]] = {}
        state.install_listeners.append(self.sweep)
        state.stale_listeners.append(self.judge)
        state.registry_listeners.append(self.registry_changed)

    # --- what becomes long-lived here: WebSockets (the guards register the rest) -------------------

    @fail_closed(_revoke_on_error)
    def websocket_start(self, flow: http.HTTPFlow) -> None:
        """The upgrade went through: register the WebSocket with the request it was judged by (the
        upgrade request's facts and engine generation, kept by the request guard)."""
        conn = self.state.connections.get(flow.client_conn.id)
        facts = flow.metadata.get(FACTS)
        pin = flow.metadata.get("egress_pin")
        decision = flow.metadata.get("egress_decision")
        if conn is None or facts is None or pin is None or decision is None:
            raise RuntimeError("a WebSocket opened without the decision that allowed its upgrade")
        # (Inside a tunnel, the tunnel's own entry carries its destination checks.)
        established = Established("websocket", pin, decision.rule, conn.address, flow.metadata.get(GENERATION, 0),
                                  request=facts)
        self.state.establish(flow.client_conn.id, conn, established, flow.metadata.get(REGISTRY_SEQ, -1))

    # --- requests in flight: registered while they last, so a reload judges an endless stream ------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """An allowed request (after the request guard): in flight until its response ends or it
        fails. One list entry per open request on the connection; nothing is judged here."""
        decision = flow.metadata.get("egress_decision")
        facts, pin = flow.metadata.get(FACTS), flow.metadata.get("egress_pin")
        conn = self.state.connections.get(flow.client_conn.id)
        if (conn is None or flow.response is not None or decision is None or not decision.allowed
                or facts is None or pin is None):
            return
        self._prune(flow.client_conn.id, conn)
        self._flows.setdefault(flow.client_conn.id, {})[flow.id] = flow
        self.state.establish(flow.client_conn.id, conn, Established(
            "request", pin, decision.rule, conn.address, flow.metadata.get(GENERATION, 0), request=facts),
            flow.metadata.get(REGISTRY_SEQ, -1))

    def client_disconnected(self, client) -> None:
        self._flows.pop(client.id, None)

    def _prune(self, client_id: str, conn: ClientSession) -> None:
        """Forget the registered requests whose streams are over, whichever way they ended."""
        flows = self._flows.get(client_id)
        if not flows:
            return
        dead = [f for f in flows.values() if not f.live]
        for flow in dead:
            self._finished(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        """The request's body is through; the request is over if its response is too (an early one)."""
        if flow.response is not None and flow.response.timestamp_end is not None:
            self._finished(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        """The response is through; the request is over if its body is too (else at `request`)."""
        if flow.request.timestamp_end is not None:
            self._finished(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._finished(flow)

    def _finished(self, flow: http.HTTPFlow) -> None:
        flows = self._flows.get(flow.client_conn.id)
        if flows is not None:
            flows.pop(flow.id, None)
        conn = self.state.connections.get(flow.client_conn.id)
        facts = flow.metadata.get(FACTS)
        if conn is not None and facts is not None:
            conn.finish_request(facts)

    # --- judging ---------------------------------------------------------------------------------

    def sweep(self, engine: Engine) -> None:
        """A new engine is in place: judge every open connection by it. O(open connections)."""
        if engine.generation == self._swept:
            return  # the same engine installed again (an option changed): nothing to judge anew
        self._swept = engine.generation
        for client_id, conn in list(self.state.connections.items()):
            if conn.established:
                try:
                    self.judge(client_id, conn)
                except Exception:  # one connection's failure must not spare the ones after it
                    logger.exception("egress gateway: judging open connection %s failed; it is closed", conn.client)
                    if conn.poisoned is not None and not conn.established:
                        continue  # revoked and closed already: only its line failed
                    conn.revoke(Decision.deny("internal_error", "the gateway failed while judging this "
                                                                "connection after a policy change"))
                    self.closer(client_id)

    def registry_changed(self, change) -> None:
        """A control API change (a registration, a deregistration, a grant added, removed or run
        out): every open connection from the addresses it touched, and every one whose token named
        the sandbox, is judged again by the current engine under the new registry, whatever engine
        judged it last, and closed if no longer allowed. O(those connections), not O(every open one)."""
        if self.state.engine is None:
            return
        self._by = change.describe()
        try:
            self._judge_all(self.state.connections_of(change.sandbox, change.addresses))
        finally:
            self._by = "the new policy"

    def _judge_all(self, connections) -> None:
        for client_id, conn in connections:
            if not conn.established:
                continue
            try:
                self.judge(client_id, conn, force=True)
            except Exception:
                logger.exception("egress gateway: judging open connection %s failed; it is closed", conn.client)
                if conn.poisoned is not None and not conn.established:
                    continue
                conn.revoke(Decision.deny("internal_error", "the gateway failed while judging this "
                                                            "connection after a control change"))
                self.closer(client_id)

    def judge(self, client_id: str, conn: ClientSession, force: bool = False) -> bool:
        """Judge one connection by the current engine; close it if anything on it is no longer
        allowed. True when it stays open. `force`: judge even what this engine judged already (the
        registry changed, not the policy)."""
        engine = self.state.engine
        self._prune(client_id, conn)  # a dead stream is nothing to revoke
        if engine is None or not conn.established:
            return True
        if conn.poisoned is not None:
            conn.keep_established([])  # refused already: nothing of it reaches an upstream
            return False
        reported: tuple[Established, Decision] | None = None
        judged = []
        for established in conn.established:
            if established.generation == engine.generation and not force:
                judged.append(established)
                continue
            try:
                decision = rejudge(engine, established, self.state.scope_under(engine.policy, conn))
            except Exception:
                logger.exception("egress gateway: judging an open connection failed; it is closed")
                decision = failure(established)
            if not decision.allowed:
                self._revoke(client_id, conn, established, decision, engine)
                return False
            if decision.would_deny and reported is None:
                reported = (established, decision)
            judged.append(dataclasses.replace(established, generation=engine.generation))
        conn.keep_established(judged)
        if reported is not None:  # report mode: stays open, one line says what enforcing would close
            self._record(conn, *reported, engine, _kind(conn, reported[0]), _request(conn))
        return True

    def _revoke(self, client_id: str, conn: ClientSession, established: Established, decision: Decision,
                engine: Engine) -> None:
        kind = _kind(conn, established)
        request = _request(conn)
        conn.revoke(revocation(established, decision, self._by))  # anything still arriving is refused, nothing admitted
        try:
            self._record(conn, established, decision, engine, kind, request)  # the line first, then the effect
            logger.info("egress gateway: revoked open %s %s -> %s (rule %s): %s", kind, conn.client,
                        established.pin.host.authority(established.pin.port), established.rule, decision.reason)
        finally:  # an audit line that cannot be written (a full disk) never keeps the connection open
            if not self.closer(client_id):
                logger.info("egress gateway: revoked connection %s was already closing", conn.client)

    def _record(self, conn: ClientSession, established: Established, decision: Decision, engine: Engine,
                kind: str | None = None, request=None) -> None:
        """One `event: connection` line: the connection (client, sandbox, mode, kind), where it went
        (host, port, address; a WebSocket's upgrade request), the rule that used to allow it, the
        verdict (`revoked`, deny or would_deny) and `cause`, the new policy's reason code."""
        pin = established.pin
        request = request or established.request
        fields = connection_fields(conn, self.state.scope_under(engine.policy, conn).sandbox)
        fields |= verdict_fields(revocation(established, decision, self._by), status_sent=False)
        fields |= {
            "host": pin.host.value, "port": pin.port, "address": pin.address.compressed,
            "method": request.method if request else None, "scheme": request.scheme if request else None,
            "path": request.target if request else None,
            "kind": kind or _kind(conn, established), "cause": decision.reason,
        }
        if established.kind == "tcp":
            fields["protocol"] = "tcp"
        self.state.record(event="connection", **fields)


def _request(conn: ClientSession):
    """A WebSocket's upgrade request, for the line of the connection that carries it."""
    return next((e.request for e in conn.established if e.kind == "websocket"), None)


def _kind(conn: ClientSession, established: Established) -> str:
    """A connection that carries a WebSocket is one, whichever of its parts the new policy refused."""
    return "websocket" if any(e.kind == "websocket" for e in conn.established) else established.kind

