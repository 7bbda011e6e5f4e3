"""Runs a session event (gateway/session.py) on the event loop: each name it asks for is resolved
by the engine's resolver (the one I/O a decision needs), each long-lived thing it made is handed to
the gateway's reload bookkeeping."""

from __future__ import annotations

from gateway.engine import Engine
from gateway.resolver import ResolveError
from gateway.session import ClientSession, NeedAddresses, Step, Steps

from .state import GatewayState


async def drive(steps: Steps, engine: Engine, state: GatewayState, client_id: str, session: ClientSession) -> Step:
    value: object = None
    while True:
        try:
            need = steps.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(need, NeedAddresses):
            try:
                value = await engine.resolver.resolve(need.host)
            except ResolveError as exc:
                value = exc
        else:
            state.establish(client_id, session, need.established)
            value = None
