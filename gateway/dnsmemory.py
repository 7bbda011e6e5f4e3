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
- What is shared out is weight as well as entries: an entry weighs one plus its names, and the memory
  holds at most DEFAULT_MAX_WEIGHT (29-96 MiB, by how long and how shared the names are; review 39). Bounded by entries only, 100,000 entries of 64 names
  were 194-250 MiB, and one sandbox whose resolver answers 4,000 addresses a name filled it in ~8 s
  (review 38). Whichever bound is over, the owner holding the most of *that* gives an entry back:
  chosen by weight while the entries bound was over, an owner within its share of the entries lost
  answers because its few entries carried more names (a hypothesis find).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from .hostnames import IPAddress

DEFAULT_TTL_SECONDS = 600.0
DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_MAX_WEIGHT = 300_000  # entries plus their names
MAX_NAMES_PER_ENTRY = 64

_Key = tuple[str, str]  # (client address, answered address)


class DnsMemory:
    def __init__(self, ttl: float = DEFAULT_TTL_SECONDS, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic, max_names: int = MAX_NAMES_PER_ENTRY,
                 max_weight: int = DEFAULT_MAX_WEIGHT):
        self.ttl = ttl
        self.max_entries = max(1, int(max_entries))
        self.max_names = max(1, int(max_names))
        # At least one full entry: below it, a lone owner's newest answer was evicted as it was given.
        self.max_weight = max(1 + self.max_names, int(max_weight))
        self.clock = clock
        # Each owner's entries, least recently answered first; each entry's names, oldest first.
        self._parts: dict[Hashable, OrderedDict[_Key, dict[str, float]]] = {}
        self._owner_of: dict[_Key, Hashable] = {}
        self._size = 0  # entries
        self._weight = 0  # entries and their names
        self._weights: dict[Hashable, int] = {}  # each owner's
        # The owners ranked by weight and by entries: the bound that is over decides which owner
        # gives an entry back (by weight alone, an owner holding few entries of many names lost
        # them to another's flood of entries, although it held less than its share of the entries).
        self._by_weight = _Ranking()
        self._by_entries = _Ranking()

    def __len__(self) -> int:
        return self._size

    def held(self, owner: Hashable) -> int:
        """How many entries `owner` holds."""
        return len(self._parts.get(owner, ()))

    def weight(self, owner: Hashable | None = None) -> int:
        """What `owner` (None: the memory) holds: its entries and their names."""
        return self._weight if owner is None else self._weights.get(owner, 0)

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
        while self._size > self.max_entries or self._weight > self.max_weight:
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
        self._reweigh(owner, -(1 + len(names)))
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
        self._reweigh(owner, 1 + len(names))

    def _reweigh(self, owner: Hashable, change: int) -> None:
        old = self._weights.get(owner, 0)
        new = old + change
        self._weight += change
        if new:
            self._weights[owner] = new
        else:
            self._weights.pop(owner, None)
        self._by_weight.move(owner, old, new)
        entries = len(self._parts.get(owner, ()))
        self._by_entries.move(owner, entries - (1 if change > 0 else -1), entries)

    def _evict(self, inserting: Hashable) -> None:
        """One entry out: the least recently answered of the owner that holds the most of what is
        over its bound (entries, else weight), another than `inserting` where several hold as much.
        An owner within its even share of that bound is never the one: the memory is over it, so
        some owner holds more."""
        ranking = self._by_entries if self._size > self.max_entries else self._by_weight
        victim = ranking.heaviest(inserting)
        part = self._parts[victim]
        self._take(next(iter(part)))


class _Ranking:
    """Owners by a count that moves by a bounded step at a time (an entry, or its weight): the
    owner holding the most is found without sorting. Not quite constant time: a count's dict keeps
    the slots of owners that left it until it is resized, and `heaviest` walks them (review 45:
    ~4 us with 10,000 owners, ~85 us with 100,000, which `max_entries` bounds)."""

    __slots__ = ("_buckets", "_top")

    def __init__(self) -> None:
        self._buckets: dict[int, dict[Hashable, None]] = {}
        self._top = 0

    def move(self, owner: Hashable, old: int, new: int) -> None:
        if old:
            bucket = self._buckets[old]
            del bucket[owner]
            if not bucket:
                del self._buckets[old]
        if new:
            self._buckets.setdefault(new, {})[owner] = None
            self._top = max(self._top, new)
        while self._top and self._top not in self._buckets:
            self._top -= 1

    def heaviest(self, besides: Hashable) -> Hashable:
        """The owner holding the most; another than `besides` where several hold as much."""
        victim = None
        for owner in self._buckets[self._top]:
            victim = owner
            if owner != besides:
                break
        return victim
