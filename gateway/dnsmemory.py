"""What the gateway's own DNS told each client, so raw TCP rules can name hosts.

A `protocol: tcp` rule may list a name; a raw TCP connection to an address is then allowed only if
the gateway's DNS answered that name with that address *to that client* recently. Bounded in size
(least recently used entries go first) and in time (entries expire).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from .hostnames import IPAddress

DEFAULT_TTL_SECONDS = 600.0
DEFAULT_MAX_ENTRIES = 100_000


class DnsMemory:
    def __init__(self, ttl: float = DEFAULT_TTL_SECONDS, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], dict[str, float]] = OrderedDict()

    def remember(self, client: IPAddress, name: str, addresses: Iterable[IPAddress]) -> None:
        expires = self.clock() + self.ttl
        for address in addresses:
            key = (client.compressed, address.compressed)
            names = self._entries.pop(key, {})
            names[name] = expires
            self._entries[key] = names
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def names_for(self, client: IPAddress, address: IPAddress) -> set[str]:
        key = (client.compressed, address.compressed)
        names = self._entries.get(key)
        if not names:
            return set()
        now = self.clock()
        live = {name for name, expires in names.items() if expires > now}
        if not live:
            del self._entries[key]
        return live
