"""Registered sandboxes: which sandbox a source address is *now*, as the platform says, and the
grants each holds. Node-local, in memory, pure (the caller passes the clock).

The platform registers a sandbox (`id`, its source addresses, a `profile`: an entry of the policy's
`sandboxes:`, a TTL, labels); from then on every decision for a connection from one of those
addresses is judged as that sandbox by its profile's rules and limits, plus its grants, until it is
deregistered or its TTL runs out. A registration overrides the policy's static `sandboxes:`
address table for its addresses. An address belongs to one registered sandbox at a time.

A registration may name no address: a sandbox that proves who it is with a proxy token (its `sub`
is the registration's id). Its grants then reach every connection whose token names that sandbox
and the registration's profile (`scope_of_sandbox`); the token, not the registration, decides
whether the connection is let in at all.

Every change is an *op* (a JSON-able dict: `register`, `deregister`, `grant`, `revoke`), made
once by the control service (gateway/control.py, which validates it) and applied with `apply`,
here and on every worker's copy (gateway/control_fanout.py): the copies stay equal because they
apply the same ops in the same order. `apply` never refuses an op the service made; it does the
bookkeeping (the address index, the deadline heap) and says which addresses changed, so the
caller judges the open connections from those addresses again (revocation).

Decisions ask `scope(policy, address, now)`: one dict lookup, then a cached Scope (rebuilt when
the policy object changes, a grant or the registration changes, or the earliest of its deadlines
passes, so an expired grant stops deciding at that instant even before the timer removes it).
Nothing here grows with the number of sandboxes per decision.
"""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
import re
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .grants import Grant, GrantRules, compile_grants, envelope_refusal
from .hostnames import IPAddress
from .policy import Policy, Scope

SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,511}\Z")  # a token sub is at most 512
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}\Z")
MAX_ADDRESSES = 16
MAX_LABELS = 16
MAX_LABEL_VALUE = 256


@dataclass(slots=True)
class Registration:
    id: str
    addresses: tuple[IPAddress, ...]
    profile: str
    expires: float  # monotonic: what decides
    expires_at: float  # wall clock: what the API shows
    by: str
    labels: dict[str, str] = field(default_factory=dict)
    registered_at: float = 0.0  # wall clock
    grants: dict[str, Grant] = field(default_factory=dict)
    # (policy, scope, valid until): the Scope decisions use, rebuilt when any of it is stale
    cache: tuple | None = None

    def describe(self) -> dict:
        return {"id": self.id, "source_ips": [a.compressed for a in self.addresses], "profile": self.profile,
                "expires_at": self.expires_at, "registered_at": self.registered_at, "by": self.by,
                "labels": dict(self.labels), "grants": len(self.grants)}

    def to_op(self) -> dict:
        return {"id": self.id, "source_ips": [a.compressed for a in self.addresses], "profile": self.profile,
                "expires": self.expires, "expires_at": self.expires_at, "by": self.by, "labels": dict(self.labels),
                "registered_at": self.registered_at}


@dataclass(frozen=True)
class Change:
    """What one applied op changed: the addresses whose open connections must be judged again,
    and what was removed (for the audit line of an expiry)."""

    op: str
    sandbox: str
    addresses: frozenset[IPAddress] = frozenset()
    grant: str | None = None
    removed: bool = False  # the sandbox (or grant) is gone (deregister, revoke, expire)
    grants_dropped: int = 0
    why: str | None = None  # "expired" when a TTL ran out

    def describe(self) -> str:
        """What changed, for the message of a connection it revoked."""
        what = {"register": f"the registration of sandbox {self.sandbox}",
                "deregister": f"the deregistration of sandbox {self.sandbox}",
                "grant": f"grant {self.grant} to sandbox {self.sandbox}",
                "revoke": f"the removal of grant {self.grant} of sandbox {self.sandbox}"}[self.op]
        return what + (" (its TTL ran out)" if self.why == "expired" else "")


_RULE_SETS: dict[frozenset, frozenset] = {}


def _interned(rule_ids: frozenset[str]) -> frozenset[str]:
    """One frozenset per distinct set of rule ids: 100,000 sandboxes of one profile with the same
    grant share one (a handful of profiles and grantable rules make a handful of sets)."""
    if len(_RULE_SETS) > 4096:
        _RULE_SETS.clear()
    return _RULE_SETS.setdefault(rule_ids, rule_ids)


def client_address(address: IPAddress | None) -> IPAddress | None:
    """An IPv4-mapped IPv6 client counts as its IPv4 address (as the static table does)."""
    if address is not None and address.version == 6 and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_address(text: object) -> IPAddress:
    """One source address (not a range: a registration names a sandbox's own addresses)."""
    if not isinstance(text, str):
        raise ValueError("an address is a string")
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address (a registration takes single addresses, not ranges)") \
            from None
    # Addresses no client connection ever comes from (review 24: such a registration silently
    # matched nothing, and its sandbox fell back to the static table): a scoped IPv6 address (the
    # peer is matched without its zone), unspecified, broadcast, multicast.
    if getattr(address, "scope_id", None) or address.is_unspecified or address.is_multicast or (
            address.version == 4 and address == ipaddress.IPv4Address("255.255.255.255")):
        raise ValueError(f"{text!r} is not an address a sandbox connects from")
    return client_address(address)


class Registry:
    """The registered sandboxes of this node, their grants and deadlines."""

    def __init__(self) -> None:
        self._by_id: dict[str, Registration] = {}
        self._by_address: dict[IPAddress, str] = {}
        self._deadlines: list[tuple[float, str, str]] = []  # (when, sandbox, grant id or "")
        self._sorted: list[str] | None = None  # ids in order, for paging (rebuilt lazily)
        self.grant_count = 0
        self.seq = 0  # ops applied (the fan-out's sequence number)
        self.grant_rules: dict[str, object] = {}  # transient rule id -> Rule (Engine.rule looks here)

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    # --- lookups --------------------------------------------------------------------------------------

    def get(self, sandbox: str) -> Registration | None:
        return self._by_id.get(sandbox)

    def owner(self, address: IPAddress) -> str | None:
        return self._by_address.get(client_address(address))

    def addresses_of(self, sandbox: str) -> frozenset[IPAddress]:
        reg = self._by_id.get(sandbox)
        return frozenset(reg.addresses) if reg is not None else frozenset()

    def scope(self, policy: Policy, address: IPAddress | None, now: float) -> Scope | None:
        """The Scope of the registered sandbox `address` belongs to now, or None (not registered,
        or its TTL has run out)."""
        if address is None or not self._by_address:
            return None
        sandbox = self._by_address.get(client_address(address))
        if sandbox is None:
            return None
        return self._scope_of(policy, self._by_id[sandbox], now)

    def scope_of_sandbox(self, policy: Policy, sandbox: str, profile: str, now: float) -> Scope | None:
        """The Scope of registered sandbox `sandbox` if it is registered now with `profile`, else
        None. For a connection whose token proved it is `sandbox` (gateway/identity.py): the
        registration's grants reach it only when the token names the profile they were granted
        under, so a grant never crosses from one envelope into another."""
        reg = self._by_id.get(sandbox)
        if reg is None or reg.profile != profile:
            return None
        return self.scope_of_registration(policy, sandbox, now)

    def _scope_of(self, policy: Policy, reg: Registration, now: float) -> Scope | None:
        if reg.expires <= now:
            return None
        cache = reg.cache
        if cache is not None and cache[0] is policy and now < cache[2]:
            return cache[1]
        scope, until = self._build(policy, reg, now)
        reg.cache = (policy, scope, until)
        return scope

    def scope_of_registration(self, policy: Policy, sandbox: str, now: float) -> Scope | None:
        """The Scope of registered sandbox `sandbox` now, by its id (whatever its addresses, none
        included), or None (not registered, or its TTL has run out). The same cached Scope `scope`
        gives its addresses' connections: `explain` for the sandbox decides as its traffic does."""
        reg = self._by_id.get(sandbox)
        return self._scope_of(policy, reg, now) if reg is not None else None

    @staticmethod
    def _build(policy: Policy, reg: Registration, now: float) -> tuple[Scope, float]:
        entry = policy.sandboxes_by_id.get(reg.profile) if policy.sandboxes is not None else None
        until = reg.expires
        if entry is None:  # a reload removed the profile: no rule at all
            return Scope(reg.id, frozenset(), None), until
        active = []
        for grant in reg.grants.values():
            if grant.expires > now and envelope_refusal(grant, entry.grantable, policy.rules_by_id) is None:
                active.append(grant)
                until = min(until, grant.expires)
        if not active:
            return Scope(reg.id, entry.rule_ids, entry.id), until
        granted = compile_grants(active, entry.rule_ids)
        return Scope(reg.id, _interned(entry.rule_ids | granted.rule_ids), entry.id, granted), until

    def granted(self, policy: Policy, sandbox: str, now: float) -> GrantRules | None:
        reg = self._by_id.get(sandbox)
        scope = self._scope_of(policy, reg, now) if reg is not None else None
        return scope.granted if scope is not None else None  # type: ignore[return-value]

    def page(self, after: str | None, limit: int, keep: Callable[[Registration], bool] = lambda r: True
             ) -> tuple[list[Registration], str | None]:
        """Up to `limit` registrations in id order after `after` that `keep` accepts, and the cursor of
        the next page (None at the end). A filtered page scans at most 100 x `limit` entries, so one
        request costs a bounded amount whatever the filter: the cursor then says where it stopped."""
        if self._sorted is None:
            self._sorted = sorted(self._by_id)
        ids = self._sorted
        start = bisect_right(ids, after) if after is not None else 0
        found: list[Registration] = []
        scanned = 0
        i = start
        while i < len(ids) and len(found) < limit and scanned < 100 * limit:
            reg = self._by_id.get(ids[i])
            if reg is not None and keep(reg):
                found.append(reg)
            scanned += 1
            i += 1
        return found, (ids[i - 1] if i < len(ids) and i > start else None)

    def all(self) -> Iterable[Registration]:
        return self._by_id.values()

    # --- changes ---------------------------------------------------------------------------------------

    def apply(self, op: dict) -> Change:
        """Apply one op the control service made (see the module docstring)."""
        kind = op["op"]
        self.seq += 1
        if kind == "register":
            change = self._register(op["registration"])
        elif kind == "deregister":
            change = self._deregister(op["id"])
        elif kind == "grant":
            change = self._grant(Grant.from_op(op["grant"]))
        elif kind == "revoke":
            change = self._revoke(op["sandbox"], op["grant"])
        else:
            raise ValueError(f"unknown op {kind!r}")
        if op.get("why"):
            change = dataclasses.replace(change, why=op["why"])
        return change

    def _register(self, data: dict) -> Change:
        addresses = tuple(parse_address(a) for a in data["source_ips"])
        old = self._by_id.get(data["id"])
        touched = set(addresses)
        grants: dict[str, Grant] = {}
        dropped = 0
        if old is not None:
            touched |= set(old.addresses)
            for address in old.addresses:
                if self._by_address.get(address) == old.id:
                    del self._by_address[address]
            if old.profile == data["profile"]:
                grants = old.grants
            else:  # another envelope: the grants made under the old one go
                dropped = len(old.grants)
                self._forget_grants(old)
        else:
            self._sorted = None
        reg = Registration(data["id"], addresses, data["profile"], float(data["expires"]), float(data["expires_at"]),
                           data["by"], dict(data.get("labels") or {}), float(data.get("registered_at") or 0.0), grants)
        for address in addresses:
            self._by_address[address] = reg.id
        self._by_id[reg.id] = reg
        self._push(reg.expires, reg.id, "")
        return Change("register", reg.id, frozenset(touched), grants_dropped=dropped)

    def _forget_grants(self, reg: Registration) -> None:
        for grant in reg.grants.values():
            self.grant_rules.pop(grant.rule_id, None)
        self.grant_count -= len(reg.grants)
        reg.grants = {}

    def _deregister(self, sandbox: str) -> Change:
        reg = self._by_id.pop(sandbox, None)
        if reg is None:
            return Change("deregister", sandbox)
        for address in reg.addresses:
            if self._by_address.get(address) == sandbox:
                del self._by_address[address]
        dropped = len(reg.grants)
        self._forget_grants(reg)
        self._sorted = None
        return Change("deregister", sandbox, frozenset(reg.addresses), removed=True, grants_dropped=dropped)

    def _grant(self, grant: Grant) -> Change:
        reg = self._by_id.get(grant.sandbox)
        if reg is None:
            return Change("grant", grant.sandbox, grant=grant.id)
        if grant.id not in reg.grants:
            self.grant_count += 1
        reg.grants = {**reg.grants, grant.id: grant}
        reg.cache = None
        if grant.rule is None:
            from .grants import transient_rule

            self.grant_rules[grant.rule_id] = transient_rule(grant, 0)
        self._push(grant.expires, reg.id, grant.id)
        return Change("grant", reg.id, frozenset(reg.addresses), grant=grant.id)

    def _revoke(self, sandbox: str, grant_id: str) -> Change:
        reg = self._by_id.get(sandbox)
        if reg is None or grant_id not in reg.grants:
            return Change("revoke", sandbox, grant=grant_id)
        grant = reg.grants[grant_id]
        reg.grants = {k: v for k, v in reg.grants.items() if k != grant_id}
        reg.cache = None
        self.grant_count -= 1
        self.grant_rules.pop(grant.rule_id, None)
        return Change("revoke", sandbox, frozenset(reg.addresses), grant=grant_id, removed=True)

    def _push(self, when: float, sandbox: str, grant_id: str) -> None:
        """A deadline into the heap; entries made stale by a re-registration or a removal are
        dropped when the heap holds more than twice what is live (bounded memory under heartbeats)."""
        heapq.heappush(self._deadlines, (when, sandbox, grant_id))
        if len(self._deadlines) > 2 * (len(self._by_id) + self.grant_count) + 1024:
            self._deadlines = [d for d in self._deadlines if self._live(*d)]
            heapq.heapify(self._deadlines)

    # --- time ------------------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When the earliest registration or grant runs out (stale heap entries are dropped here)."""
        while self._deadlines:
            when, sandbox, grant_id = self._deadlines[0]
            if self._live(when, sandbox, grant_id):
                return when
            heapq.heappop(self._deadlines)
        return None

    def _live(self, when: float, sandbox: str, grant_id: str) -> bool:
        reg = self._by_id.get(sandbox)
        if reg is None:
            return False
        if not grant_id:
            return reg.expires == when
        grant = reg.grants.get(grant_id)
        return grant is not None and grant.expires == when

    def due(self, now: float) -> list[dict]:
        """The ops that end what has run out by `now` (`deregister` / `revoke`, each marked
        `"why": "expired"`), in deadline order; the caller applies them like any other op (so the
        workers see them as ops too)."""
        ops: list[dict] = []
        seen: set[tuple[str, str]] = set()
        while (when := self.next_deadline()) is not None and when <= now:
            _, sandbox, grant_id = heapq.heappop(self._deadlines)
            if (sandbox, grant_id) in seen:
                continue
            seen.add((sandbox, grant_id))
            if grant_id:
                ops.append({"op": "revoke", "sandbox": sandbox, "grant": grant_id, "why": "expired"})
            else:
                ops.append({"op": "deregister", "id": sandbox, "why": "expired"})
        return ops

    # --- a restarted worker's copy ------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Everything, as ops: a new copy applies them in order and equals this one."""
        ops = []
        for reg in self._by_id.values():
            ops.append({"op": "register", "registration": reg.to_op()})
            ops.extend({"op": "grant", "grant": g.to_op()} for g in reg.grants.values())
        return {"seq": self.seq, "ops": ops}

    def restore(self, snapshot: dict) -> None:
        for op in snapshot["ops"]:
            self.apply(op)
        self.seq = int(snapshot["seq"])

