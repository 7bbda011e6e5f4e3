"""One handler per signal, any number of subscribers: SIGHUP reopens the audit log *and* reloads
the policy, and neither part has to know about the other."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("egress")


class SignalHub:
    """One handler per signal, any number of subscribers (called on the event loop, in order; one
    failing does not stop the others). `state.signals` is the gateway's hub."""

    def __init__(self) -> None:
        self._subscribers: dict[int, list[Callable[[], Any]]] = defaultdict(list)
        self._installed: set[int] = set()

    def subscribe(self, signum: int, callback: Callable[[], Any]) -> None:
        self._subscribers[signum].append(callback)

    def unsubscribe(self, signum: int, callback: Callable[[], Any]) -> None:
        if callback in self._subscribers[signum]:
            self._subscribers[signum].remove(callback)

    def dispatch(self, signum: int) -> None:
        name = signal.Signals(signum).name
        for callback in list(self._subscribers[signum]):
            try:
                result = callback()
                if asyncio.iscoroutine(result):
                    asyncio.get_running_loop().create_task(result)
            except Exception:
                logger.exception("egress gateway: %s handler %r failed", name, callback)

    def install(self, loop: asyncio.AbstractEventLoop, signums: Iterable[int] = (signal.SIGHUP,)) -> None:
        for signum in signums:
            if signum not in self._installed:
                loop.add_signal_handler(signum, self.dispatch, signum)
                self._installed.add(signum)

    def installed(self, signum: int) -> bool:
        return signum in self._installed
