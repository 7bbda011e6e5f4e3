"""asyncio's stream protocols make their list of drain waiters only when a writer first waits.

mitmproxy serves every TCP connection, the sandbox's and the upstream's, through an asyncio
StreamReaderProtocol, whose FlowControlMixin made a `collections.deque()` in its constructor for
the writers waiting in `drain()` while the transport's buffer is over its high-water mark: 760
bytes, two per tunnel, empty unless a peer stops reading (bench/tunnel_memory.py --details;
docs/performance.md, "Memory per open SSE stream").

Here a protocol starts with NO_WAITERS, one empty deque shared by all that refuses writes
(addons/empty_deque.py), gets a deque of its own where `_drain_helper` first waits, and lets it go
once no writer waits any more. `resume_writing` and `connection_lost` only iterate the deque, and
see the shared one as the empty deque it used to be.

Two wrappers, tabled in addons/patches.py: `FlowControlMixin.__init__` (asyncio's, then the shared
deque in place of the new one) and `FlowControlMixin._drain_helper` (Python 3.12's, with the deque
made on the first wait and dropped when empty; nothing else in it changed).
"""

from __future__ import annotations

import collections
from asyncio import streams

from .empty_deque import SharedEmptyDeque

NO_WAITERS = SharedEmptyDeque()  # the drain waiters of every protocol no writer waits on


def install() -> None:
    FlowControlMixin = streams.FlowControlMixin
    if getattr(FlowControlMixin._drain_helper, "_egress_lazy_waiters", False):
        return
    init = FlowControlMixin.__init__

    def __init__(self, loop=None) -> None:
        init(self, loop)
        self._drain_waiters = NO_WAITERS

    async def _drain_helper(self):
        """Python 3.12's FlowControlMixin._drain_helper; only where the waiter is kept differs."""
        if self._connection_lost:
            raise ConnectionResetError('Connection lost')
        if not self._paused:
            return
        waiter = self._loop.create_future()
        waiters = self._drain_waiters
        if waiters is NO_WAITERS:
            waiters = self._drain_waiters = collections.deque()
        waiters.append(waiter)
        try:
            await waiter
        finally:
            waiters.remove(waiter)
            if not waiters and self._drain_waiters is waiters:
                self._drain_waiters = NO_WAITERS

    _drain_helper._egress_lazy_waiters = True
    FlowControlMixin.__init__ = __init__
    FlowControlMixin._drain_helper = _drain_helper
