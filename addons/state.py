"""Per-connection state shared by the guards: what the connection is pinned to, what it may dial.

Keyed by mitmproxy's client connection id, dropped when the client disconnects. Nothing here
holds mitmproxy objects, so a stale entry can never keep a connection alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.audit import AuditLog
from gateway.decision import Decision
from gateway.engine import Engine, Pin


@dataclass
class ConnectionState:
    client: str
    mode: str
    tunnel: Pin | None = None  # set by an allowed CONNECT; every later request must match it
    poisoned: Decision | None = None  # set when the TLS SNI restated the destination
    # (address, port) -> TLS server name the gateway may dial for this client, added only
    # when a request passed every check.
    admitted: dict[tuple[str, int], str | None] = field(default_factory=dict)


class GatewayState:
    """The one object every guard shares: the engine (swapped whole on reload) and the connections."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.audit: AuditLog = AuditLog(None)
        self.connections: dict[str, ConnectionState] = {}

    def connection(self, client_id: str, peer: str = "?", mode: str = "regular") -> ConnectionState:
        state = self.connections.get(client_id)
        if state is None:
            state = self.connections[client_id] = ConnectionState(peer, mode)
        return state

    def forget(self, client_id: str) -> None:
        self.connections.pop(client_id, None)

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("no policy loaded")
        return self.engine
