"""A ledger of the bytes the gateway holds in memory on behalf of a client: buffered request and
response bodies, decoded bodies, anything else that grows with what a peer sends.

One hostile sandbox must not take the memory of the others: every buffer is charged, before it
grows, to its connection and to its sandbox, each with a limit. A reservation that would pass
either limit is refused and nothing is charged; the caller then streams instead of buffering, or
refuses the message (`buffer_budget`). Pure and O(1) per call: no mitmproxy, no I/O.

    ledger = Ledger(per_connection=32 << 20, per_sandbox=128 << 20)
    account = ledger.account("client-id", "sandbox:ci")   # one buffer (a stream's body)
    if not account.reserve(len(chunk)): ...               # over budget: nothing was charged
    account.close()                                       # the buffer is gone: everything back

An HTTP/2 connection (or anything else) can use the same ledger: one account per stream, closed
when the stream ends; `drop_connection` closes every account of a connection that went away.
"""

from __future__ import annotations

import threading
from collections import Counter

DEFAULT_PER_CONNECTION = 32 * 1024 * 1024  # also caps a bound response decoded whole (gateway/decompress.py: 64 MiB)
DEFAULT_PER_SANDBOX = 128 * 1024 * 1024

# What a decoded request head keeps in memory, as measured with a real h2 client (review 14: 1,798
# HTTP/2 streams, each a 55 KB header block of 190 fields, took +291 MiB, ~165 KB a stream): its
# bytes about twice over (h2's header list, then mitmproxy's Headers) and a few hundred bytes of
# objects per field (tuples, bytes headers, the list slots).
HEAD_BYTE_COST = 2
HEAD_FIELD_COST = 384


def head_cost(size: int, fields: int) -> int:
    """The bytes a request head of `size` bytes (its fields' names and values, method, target) and
    `fields` header fields is charged while the gateway holds it."""
    return HEAD_BYTE_COST * size + HEAD_FIELD_COST * fields


class Ledger:
    """Bytes held per connection and per sandbox, against their limits (None or 0: no limit)."""

    def __init__(self, per_connection: int | None = DEFAULT_PER_CONNECTION,
                 per_sandbox: int | None = DEFAULT_PER_SANDBOX):
        self.per_connection = per_connection or None
        self.per_sandbox = per_sandbox or None
        self.connections: Counter[str] = Counter()
        self.sandboxes: Counter[str] = Counter()
        # Open accounts of a connection, for drop_connection: a dict as an ordered set (a set of five
        # is 728 bytes, a dict of five 224; a stream holds five, for as long as it is open).
        self._accounts: dict[str, dict[Account, None]] = {}
        self.released = 0  # bytes of buffers freed since start (addons/gc_freeze.py collects every so many)
        # A decoder on a pool thread may charge a later zstd frame's window (addons/decode_pool.py)
        # while the loop charges other buffers of the same sandbox: the counters change under a lock.
        self._lock = threading.Lock()

    def account(self, connection: str, sandbox: str) -> "Account":
        account = Account(self, connection, sandbox)
        self._accounts.setdefault(connection, {})[account] = None
        return account

    def room(self, connection: str, sandbox: str) -> int | None:
        """How many more bytes a buffer of this connection may take (None: no limit)."""
        rooms = [limit - used for limit, used in ((self.per_connection, self.connections[connection]),
                                                   (self.per_sandbox, self.sandboxes[sandbox]))
                 if limit is not None]
        return max(min(rooms), 0) if rooms else None

    def _reserve(self, connection: str, sandbox: str, n: int) -> bool:
        if n == 0:
            return True
        with self._lock:
            if (self.per_connection is not None and self.connections[connection] + n > self.per_connection) or (
                    self.per_sandbox is not None and self.sandboxes[sandbox] + n > self.per_sandbox):
                return False
            self.connections[connection] += n
            self.sandboxes[sandbox] += n
            return True

    def _release(self, connection: str, sandbox: str, n: int, freed: bool = True) -> None:
        with self._lock:
            if freed:
                self.released += n
            for counter, key in ((self.connections, connection), (self.sandboxes, sandbox)):
                counter[key] -= n
                if counter[key] <= 0:
                    del counter[key]  # an idle key costs nothing

    def _hold(self, connection: str, sandbox: str, n: int) -> None:
        with self._lock:
            self.connections[connection] += n
            self.sandboxes[sandbox] += n

    def _closed(self, account: "Account") -> None:
        accounts = self._accounts.get(account.connection)
        if accounts is not None:
            accounts.pop(account, None)
            if not accounts:
                del self._accounts[account.connection]

    def drop_connection(self, connection: str) -> None:
        """The connection is gone: whatever its buffers still held is released."""
        for account in list(self._accounts.get(connection, ())):
            account.close()
        self._accounts.pop(connection, None)

    def held(self, connection: str | None = None, sandbox: str | None = None) -> int:
        if connection is not None:
            return self.connections[connection]
        if sandbox is not None:
            return self.sandboxes[sandbox]
        return sum(self.sandboxes.values())


class Account:
    """One buffer's share of the ledger. `reserve` before the buffer grows; `release` when part of
    it is handed on; `close` when it is gone (idempotent: a closed account reserves nothing)."""

    __slots__ = ("ledger", "connection", "sandbox", "held", "closed", "__weakref__")

    def __init__(self, ledger: Ledger, connection: str, sandbox: str):
        self.ledger = ledger
        self.connection = connection
        self.sandbox = sandbox
        self.held = 0
        self.closed = False

    def reserve(self, n: int) -> bool:
        if n < 0:
            raise ValueError("a reservation is a number of bytes (>= 0)")
        if self.closed or not self.ledger._reserve(self.connection, self.sandbox, n):
            return False
        self.held += n
        return True

    def hold(self, n: int) -> None:
        """Bytes already held that cannot be refused (e.g. written to a socket the peer does not
        read): counted even past the limits, so that new buffers find no room while they last."""
        if n > 0 and not self.closed:
            self.held += n
            self.ledger._hold(self.connection, self.sandbox, n)

    def release(self, n: int | None = None, freed: bool = True) -> None:
        """Give back `n` bytes (None: all held). `freed`: they were memory now let go; not so for
        room reserved ahead and handed to what fills it (a request's room for its answer's head):
        the ledger's `released` counts memory freed, and each 128 MiB of it costs a walk of every
        live object (addons/gc_freeze.py: up to 1.4 s with ~1,000 connections open). Counted, the
        8 KiB room of each small request was ~3/4 of what the count said was freed."""
        n = self.held if n is None else max(min(n, self.held), 0)
        if n:
            self.held -= n
            self.ledger._release(self.connection, self.sandbox, n, freed)

    def close(self) -> None:
        if not self.closed:
            self.release()
            self.closed = True
            self.ledger._closed(self)

    def room(self) -> int | None:
        return 0 if self.closed else self.ledger.room(self.connection, self.sandbox)
