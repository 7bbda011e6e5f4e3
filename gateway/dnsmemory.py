"""What the gateway's own DNS told each client, so raw TCP rules can name hosts.

A `protocol: tcp` rule may list a name; a raw TCP connection to an address is then allowed only if
the gateway's DNS answered that name with that address *to that client* recently. Bounded in size
and in time (entries expire), and the bound is shared fairly between sandboxes:

- Each (client, answered address) pair is one entry, kept in its owner's part (the sandbox the
  client belongs to). When the memory is full, the entry that goes is the least recently answered
  of the owner that holds the most, so a sandbox resolving many names (each answer of a CDN name is
  several entries) evicts its own answers first, never those of a sandbox that holds fewer. One
  shared least-recently-used table let a sandbox inside its DNS budget (13,000 names of 8 addresses
  at 190 a second) push another sandbox's answer out in 69 s, and that sandbox's raw TCP
  connections were then refused `no_rule` (review 37).
- An entry keeps at most MAX_NAMES_PER_ENTRY names (many names of one wildcard rule answered with
  one address), its expired ones pruned as it is answered again: before, such an entry grew for as
  long as it was refreshed (720,000 names, 117 MiB, after an hour at 200 answers a second, and every
  raw TCP decision to that address walked them all: 28 ms).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from .hostnames import IPAddress

DEFAULT_TTL_SECONDS = 600.0
DEFAULT_MAX_ENTRIES = 100_000
MAX_NAMES_PER_ENTRY = 64

_Key = tuple[str, str]  # (client address, answered address)


class DnsMemory:
    def __init__(self, ttl: float = DEFAULT_TTL_SECONDS, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic, max_names: int = MAX_NAMES_PER_ENTRY):
        self.ttl = ttl
        self.max_entries = max(1, int(max_entries))
        self.max_names = max(1, int(max_names))
        self.clock = clock
        # Each owner's entries, least recently answered first; each entry's names, oldest first.
        self._parts: dict[Hashable, OrderedDict[_Key, dict[str, float]]] = {}
        self._owner_of: dict[_Key, Hashable] = {}
        self._size = 0
        # The owners by how many entries each holds, and the most any holds: sizes move by one at a
        # time, so the owner holding the most is found in constant time, however many there are.
        self._by_size: dict[int, dict[Hashable, None]] = {}
        self._top = 0

    def __len__(self) -> int:
        return self._size

    def held(self, owner: Hashable) -> int:
        """How many entries `owner` holds."""
        return len(self._parts.get(owner, ()))

    def remember(self, client: IPAddress, name: str, addresses: Iterable[IPAddress],
                 owner: Hashable | None = None) -> None:
        """The gateway's DNS answered `name` with `addresses` to `client` (of sandbox `owner`;
        None: the client address is its own owner)."""
        owner = client.compressed if owner is None else owner
        now = self.clock()
        expires = now + self.ttl
        for address in addresses:
            key = (client.compressed, address.compressed)
            names = self._take(key)
            names.pop(name, None)
            names[name] = expires
            if len(names) > self.max_names:
                for stale in [n for n, at in names.items() if at <= now]:
                    del names[stale]
                while len(names) > self.max_names:
                    del names[next(iter(names))]  # the oldest answered
            self._put(key, owner, names)
        while self._size > self.max_entries:
            self._evict(owner)

    def names_for(self, client: IPAddress, address: IPAddress) -> set[str]:
        key = (client.compressed, address.compressed)
        owner = self._owner_of.get(key)
        if owner is None:
            return set()
        names = self._parts[owner][key]
        now = self.clock()
        live = {name for name, expires in names.items() if expires > now}
        if not live:
            self._take(key)
        return live

    # -- bookkeeping ---------------------------------------------------------------------------

    def _take(self, key: _Key) -> dict[str, float]:
        """The entry out of whichever part holds it (its owner may change as it is answered again:
        a reloaded policy, a registered sandbox), with its names; or a new entry's."""
        owner = self._owner_of.pop(key, None)
        if owner is None:
            return {}
        part = self._parts[owner]
        names = part.pop(key)
        self._size -= 1
        self._resized(owner, len(part) + 1, len(part))
        if not part:
            del self._parts[owner]
        return names

    def _put(self, key: _Key, owner: Hashable, names: dict[str, float]) -> None:
        part = self._parts.get(owner)
        if part is None:
            part = self._parts[owner] = OrderedDict()
        part[key] = names
        self._owner_of[key] = owner
        self._size += 1
        self._resized(owner, len(part) - 1, len(part))

    def _resized(self, owner: Hashable, old: int, new: int) -> None:
        if old:
            bucket = self._by_size[old]
            del bucket[owner]
            if not bucket:
                del self._by_size[old]
        if new:
            self._by_size.setdefault(new, {})[owner] = None
            self._top = max(self._top, new)
        while self._top and self._top not in self._by_size:
            self._top -= 1

    def _evict(self, inserting: Hashable) -> None:
        """One entry out: the least recently answered of the owner holding the most (another than
        `inserting` where several hold as many). An owner within its even share of the memory is
        never the one: the memory is over full, so some owner holds more."""
        victim = None
        for owner in self._by_size[self._top]:
            victim = owner
            if owner != inserting:
                break
        part = self._parts[victim]
        self._take(next(iter(part)))
