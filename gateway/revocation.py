"""Revocation: is a connection that is already open still allowed under a (new) policy?

A reload replaces the engine at once, and every new connection and every new request is judged by
the new one. What is already established is not judged again by anything that follows: a
WebSocket relays messages, a passthrough tunnel and a raw TCP relay copy bytes, and a kept-alive
tunnel's pinned destination was decided once, at its CONNECT (or SNI, or first Host). So on every
policy change the gateway asks this module, for each such connection, the question a new one would
be asked, with the engine's own checks (the same code `explain` and the guards use):

| kind          | what was established                        | judged again by |
|---------------|---------------------------------------------|-----------------|
| `tunnel`      | an inspected CONNECT tunnel, or a transparent TLS connection pinned by its SNI | `check_destination` on the pinned host and port, the deny list on its pinned addresses, `strict_original_destination` |
| `http`        | a transparent plain-HTTP connection pinned by its first Host | the same |
| `passthrough` | an `inspect: false` tunnel relayed unread   | the same, and the rule that allows it must still be a passthrough rule (else `passthrough_withdrawn`: a new tunnel would be inspected) |
| `tcp`         | a raw TCP relay (`protocol: tcp`)          | `tcp_decision` (`check_tcp`, then the deny list) with the names the gateway's DNS had given the client when it was admitted |
| `websocket`   | an upgraded WebSocket                       | `check_request` on its upgrade request (method, path, scheme, port, method overrides), then the deny list |
| `request`     | a request in flight (its body or its response still streaming), in any mode | the same as a WebSocket: `check_request` on it, then the deny list |

A WebSocket inside a tunnel is judged as both: the tunnel's destination, then its upgrade request.

`rejudge` returns the decision a new connection would get. Report mode is the engine's: a
connection that the new policy's allowlist would refuse, on a rule (or policy) in report mode, is
`would_deny`, i.e. allowed, and stays open (report mode lets through what it would refuse, and says
so); address, pinning and passthrough refusals are never relaxed, as for new connections.

What is *not* judged again: the DNS answer behind a pin (an open connection keeps the address it
dialled; only that address is checked against the new deny list, without a new lookup: no I/O on a
reload) and credentials (an open WebSocket's upgrade had its credential injected once). A request
in flight (an upload or a streaming response under way) is judged again like a new request: a
removed rule stops an endless stream too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decision import Decision
from .engine import Engine, Pin, RequestFacts
from .hostnames import IPAddress
from .policy import Scope

KINDS = ("tunnel", "http", "passthrough", "tcp", "websocket", "request")

# The one revocation cause that is not a refusal reason code: the destination is still allowed, but
# only by an inspecting rule, and the open tunnel is relayed unread.
PASSTHROUGH_WITHDRAWN = "passthrough_withdrawn"


@dataclass(frozen=True)
class Established:
    """One long-lived thing on a client connection, as it was admitted: no proxy types."""

    kind: str  # one of KINDS
    pin: Pin  # the destination it was pinned to (raw TCP: the original IP and port)
    rule: str | None  # the rule that allowed it (the audit line's `rule` when it is revoked)
    client: IPAddress | None  # the client's address: names its sandbox under any policy
    generation: int = 0  # the engine generation that last judged it
    original: IPAddress | None = None  # transparent mode: the address the sandbox dialled
    names: tuple[str, ...] = ()  # raw TCP: names the gateway's DNS answered with this address
    request: RequestFacts | None = None  # websocket: the upgrade request; request: the request itself

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind of established connection {self.kind!r}")
        if self.kind in ("websocket", "request") and self.request is None:
            raise ValueError(f"a {self.kind} needs its request")


def rejudge(engine: Engine, established: Established, scope: Scope | None = None) -> Decision:
    """The decision a new connection like `established` would get from `engine` now: allowed (maybe
    `would_deny`, report mode) or refused, with the refusal's reason code. `scope`: the connection's
    rules under `engine` (gateway/identity.py `scope_of`); by default, its source address's. Pure:
    no I/O, no clock."""
    if scope is None:
        scope = engine.policy.scope_for(established.client)
    pin = established.pin
    if established.kind == "tcp":
        return engine.tcp_decision(pin.address, pin.port, established.names, scope)
    if established.kind in ("websocket", "request"):
        decision = engine.check_request(established.request, scope)
    else:
        decision = engine.check_destination(pin.host, pin.port, scope)
    if not decision.allowed:
        return decision
    refusal = engine.address_refusal(pin.host, pin.addresses, pin.port)
    if refusal is not None:
        return Decision.deny(refusal.reason, refusal.message, decision.rule, refusal.notes)
    if established.original is not None:
        refusal = engine.original_destination_refusal(established.original, pin.host, pin.addresses, decision.rule)
        if refusal is not None:
            return refusal
    if established.kind == "passthrough" and not decision.would_deny and engine.passthrough_rule(decision) is None:
        return Decision(False, PASSTHROUGH_WITHDRAWN,
                        f"rule {decision.rule} allows {pin.host.authority(pin.port)} only inspected; "
                        "this tunnel is relayed unread", decision.rule)
    return decision


def revocation(established: Established, decision: Decision, by: str = "the new policy") -> Decision:
    """The decision an audit line records for an open connection judged again: `deny` with reason
    `revoked` when `decision` refuses it (closed), `would_deny` with reason `revoked` when report
    mode lets it stay; its rule is the one that used to allow the connection. None of these is sent
    as an HTTP status. `by`: what changed (the new policy, or a control API change)."""
    what = f"{established.kind} to {established.pin.host.authority(established.pin.port)}"
    if decision.would_deny:
        return Decision(True, "revoked", f"report mode: {by} would revoke this open {what}: "
                                         f"{decision.message}", established.rule, would_deny=True)
    return Decision(False, "revoked", f"open {what} revoked by {by}: {decision.message}",
                    established.rule)


def failure(established: Established) -> Decision:
    """Re-judging raised: fail closed (the connection is closed, audited with cause internal_error)."""
    return Decision(False, "internal_error", f"the gateway failed while judging this open {established.kind} "
                                             "again under the new policy", established.rule)
