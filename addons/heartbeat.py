"""A once-a-second task for the addons that keep something up to date (health, audit, gauges)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger("egress")

HEARTBEAT_SECONDS = 1.0


def every_second(tick: Callable[[], None], name: str) -> asyncio.Task:
    """Run `tick` now and then every HEARTBEAT_SECONDS until the task is cancelled; a tick that
    raises is logged and the next one still runs (a broken gauge must not stop health checks)."""
    async def beat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            _safely(tick, name)
    _safely(tick, name)
    return asyncio.get_running_loop().create_task(beat(), name=name)


def _safely(tick: Callable[[], None], name: str) -> None:
    try:
        tick()
    except Exception:  # noqa: BLE001  (never stop the heartbeat)
        logger.exception("egress gateway: %s failed", name)
