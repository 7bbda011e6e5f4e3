"""Runs a session event (gateway/session.py) on the event loop: each name it asks for is resolved
by the engine's resolver (the one I/O a decision needs), each long-lived thing it made is handed to
the gateway's reload bookkeeping."""

from __future__ import annotations

from gateway import session as sessions
from gateway.engine import Engine
from gateway.session import ClientSession, Step, Steps

from .state import GatewayState


async def drive(steps: Steps, engine: Engine, state: GatewayState, client_id: str, session: ClientSession) -> Step:
    """The caller took the connection's scope just before (no await between): the registry as it
    was then is what the decision was made under, whatever changes while names are resolved."""
    seq = state.registry.seq
    return await sessions.drive(steps, engine.resolved,
                                lambda established: state.establish(client_id, session, established, seq))
