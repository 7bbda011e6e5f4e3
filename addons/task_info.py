"""A connection's tasks keep their names, not mitmproxy's debug attributes beside them.

mitmproxy 12.3 gives every task it starts (a connection's handler and reader, an upstream's, a
hook's) two attributes, `created` and `client`, for its SIGUSR1 task dump
(`mitmproxy.utils.debug.dump_info`, `asyncio_utils.task_repr`). Setting them makes the task an
instance dict: ~300 bytes with the time, for each of the four to five tasks an open stream keeps for
its whole life (~1.2 KB of ~100: bench/tunnel_memory.py --sse; docs/performance.md). The gateway
never registers that dump (only mitmproxy's own command-line tools do), and nothing else reads
them. The name stays: asyncio prints it in every warning about a task ("Task exception was never
retrieved", a pending task destroyed), and mitmproxy's names carry the upstream's address.

One replacement, tabled in addons/patches.py: `asyncio_utils.set_task_debug_info`, which
`create_task` and `set_current_task_debug_info` look up in their module at each call.
"""

from __future__ import annotations

import asyncio

from mitmproxy.utils import asyncio_utils


def set_task_debug_info(task: asyncio.Task, *, name: str, client: tuple | None = None) -> None:
    """mitmproxy's (12.3), the name only."""
    task.set_name(name)


def install() -> None:
    asyncio_utils.set_task_debug_info = set_task_debug_info
