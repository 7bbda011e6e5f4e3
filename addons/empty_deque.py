"""One empty deque shared by many owners in place of a deque each, that refuses every write.

CPython gives a deque its first block of 64 slots when it is made: 760 bytes, even empty. Objects
that keep a queue which is nearly always empty (a mitmproxy layer's paused events, an asyncio stream
protocol's drain waiters) start with one of these instead, and make their own where they first
append (addons/layer_memory.py, addons/stream_memory.py). A write to the shared one raises, never
lands in another owner's queue: the connection fails closed instead.
"""

from __future__ import annotations

import collections


class SharedEmptyDeque(collections.deque):
    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("egress gateway: a write to a shared empty deque")

    append = appendleft = extend = extendleft = insert = __iadd__ = _refuse
