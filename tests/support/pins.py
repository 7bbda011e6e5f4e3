"""A destination's pin as the connection's session makes it (gateway/session.py asks the engine's
resolver for the addresses, then `Engine.pin_resolved` checks every one), for tests that need a pin
whatever the rules say."""

from __future__ import annotations

import asyncio

from gateway.engine import Engine
from gateway.hostnames import Host, canonical_host


def pin_of(engine: Engine, host: str | Host, port: int = 443):
    """(the address decision, the pin or None) for host:port."""
    name = host if isinstance(host, Host) else canonical_host(host)
    return engine.pin_resolved(name, port, asyncio.run(engine.resolved(name)))
