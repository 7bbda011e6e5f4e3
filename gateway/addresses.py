"""Which addresses the gateway may dial.

The deny list is an explicit table of CIDRs (never `ipaddress.is_private`, whose meaning moves
between Python versions). IPv6 forms that carry an IPv4 address inside (mapped, compatible,
NAT64, 6to4, Teredo) are judged by that IPv4 address too, so `::ffff:169.254.169.254` is the
metadata service and is refused like it. Lookups cost one dict probe per prefix length present,
whatever the number of ranges.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from .hostnames import IPAddress

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# (CIDR, why) — the built-in list behind `deny_ip_ranges: default`.
DEFAULT_DENY_RANGES: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "carrier-grade NAT (RFC 6598)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local / cloud metadata"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.88.99.0/24", "6to4 relay anycast"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved and broadcast"),
    ("100.100.100.200/32", "cloud metadata (Alibaba)"),
    ("168.63.129.16/32", "cloud metadata (Azure wire server)"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible (deprecated)"),
    ("100::/64", "discard-only"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("2001:db8::/32", "documentation"),
    ("2001:10::/28", "ORCHID"),
    ("3fff::/20", "documentation"),
    ("fc00::/7", "unique local"),
    ("fd00:ec2::/32", "cloud metadata (AWS IPv6)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
)

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_COMPAT = ipaddress.IPv6Network("::/96")
_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")


def embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses that an IPv6 address would reach or stand for."""
    if address.version != 6:
        return []
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _NAT64 or address in _TRANSLATED:
        found.append(low32)
    if address in _COMPAT and int(address) > 1:
        found.append(low32)
    return found


def parse_network(text: str) -> IPNetwork:
    """A CIDR or a bare address (as a /32 or /128); host bits must be zero."""
    return ipaddress.ip_network(text.strip(), strict=True)


@dataclass
class RangeTable:
    """A set of CIDRs with a label each, looked up in O(number of distinct prefix lengths)."""

    _by_len: dict[tuple[int, int], dict[int, tuple[IPNetwork, str]]] = field(default_factory=dict)
    _lengths: dict[int, list[int]] = field(default_factory=lambda: {4: [], 6: []})

    @classmethod
    def of(cls, entries: Iterable[tuple[IPNetwork, str]]) -> "RangeTable":
        table = cls()
        for network, label in entries:
            table.add(network, label)
        return table

    def add(self, network: IPNetwork, label: str) -> None:
        key = (network.version, network.prefixlen)
        bucket = self._by_len.setdefault(key, {})
        prefix = int(network.network_address) >> (network.max_prefixlen - network.prefixlen)
        bucket.setdefault(prefix, (network, label))
        lengths = self._lengths[network.version]
        if network.prefixlen not in lengths:
            lengths.append(network.prefixlen)
            lengths.sort()

    def lookup(self, address: IPAddress, longest: bool = False) -> tuple[IPNetwork, str] | None:
        """The shortest-prefix (or, with longest=True, most specific) range holding the address."""
        bits = address.max_prefixlen
        value = int(address)
        lengths = self._lengths[address.version]
        for length in reversed(lengths) if longest else lengths:
            hit = self._by_len[(address.version, length)].get(value >> (bits - length))
            if hit is not None:
                return hit
        return None

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_len.values())


@dataclass(frozen=True)
class AddressVerdict:
    allowed: bool
    address: IPAddress
    reason: str  # allowed | denied_address | self_address
    detail: str

    def describe(self) -> str:
        return f"{self.address}: {self.detail}"


@dataclass
class AddressGuard:
    """Decides whether one resolved address may be dialled.

    Order: the gateway's own listening sockets are never dialable (proxy loops), then
    `allow_ip_ranges` exempts, then the deny list and the gateway's own addresses refuse.
    """

    deny: RangeTable
    allow: RangeTable
    self_addresses: frozenset[IPAddress] = frozenset()
    listeners: frozenset[tuple[IPAddress, int]] = frozenset()

    def with_self(
        self, addresses: Iterable[IPAddress], listeners: Iterable[tuple[IPAddress, int]]
    ) -> "AddressGuard":
        return AddressGuard(
            self.deny,
            self.allow,
            frozenset(self.self_addresses) | frozenset(addresses),
            frozenset(self.listeners) | frozenset(listeners),
        )

    def _is_listener(self, address: IPAddress, port: int | None) -> bool:
        if port is None:
            return False
        for candidate in (address, *embedded_ipv4(address)):
            if (candidate, port) in self.listeners:
                return True
            for listen_ip, listen_port in self.listeners:
                if listen_port == port and listen_ip.is_unspecified and (
                    candidate in self.self_addresses or candidate.is_loopback
                ):
                    return True
        return False

    def check(self, address: IPAddress, port: int | None = None) -> AddressVerdict:
        candidates = [address, *embedded_ipv4(address)]
        if any(c.is_unspecified for c in candidates):
            # Connecting to 0.0.0.0 or :: reaches this host itself on Linux: never exemptable.
            return AddressVerdict(False, address, "self_address", "is the unspecified address (this host)")
        if self._is_listener(address, port):
            return AddressVerdict(False, address, "self_address", "is the gateway's own listener")
        # Every form of the address (itself and each IPv4 address it embeds) must pass on its own:
        # an exemption for a Teredo server does not exempt the client address in the same IPv6.
        exempted = None
        for candidate in candidates:
            allowed = self.allow.lookup(candidate, longest=True)
            if allowed is not None:
                exempted = exempted or allowed
                continue
            hit = self.deny.lookup(candidate, longest=True)
            if hit is not None:
                via = "" if candidate == address else f" (embeds {candidate})"
                return AddressVerdict(
                    False, address, "denied_address", f"in deny range {hit[0]} ({hit[1]}){via}"
                )
            if candidate in self.self_addresses:
                return AddressVerdict(False, address, "self_address", "is an address of the gateway itself")
        if exempted is not None:
            return AddressVerdict(True, address, "allowed", f"exempted by allow_ip_ranges {exempted[0]}")
        return AddressVerdict(True, address, "allowed", "not in any deny range")


def default_deny_table() -> RangeTable:
    return RangeTable.of((parse_network(cidr), why) for cidr, why in DEFAULT_DENY_RANGES)
