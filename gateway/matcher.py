"""Host patterns and the index that finds the rules for a host without scanning every rule.

Exact names and addresses are dict keys; `*.example.com` is a dict keyed by the suffix, probed
once per parent domain of the host (a handful of probes, bounded by the label count); CIDRs are
probed once per distinct prefix length. The cost of a lookup does not grow with the rule count.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from .hostnames import Host


@dataclass(frozen=True)
class HostPattern:
    kind: str  # exact | wildcard | network
    value: str
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None

    @classmethod
    def exact(cls, host: Host) -> "HostPattern":
        return cls("exact", host.value)

    @classmethod
    def wildcard(cls, domain: str) -> "HostPattern":
        return cls("wildcard", domain)

    @classmethod
    def cidr(cls, network) -> "HostPattern":
        return cls("network", str(network), network)

    def __str__(self) -> str:
        return f"*.{self.value}" if self.kind == "wildcard" else self.value

    def matches(self, host: Host) -> bool:
        if self.kind == "exact":
            return host.value == self.value
        if self.kind == "wildcard":
            return not host.is_ip and host.value.endswith("." + self.value)
        return host.ip is not None and host.ip.version == self.network.version and host.ip in self.network


class HostIndex:
    def __init__(self) -> None:
        self._exact: dict[str, list[int]] = {}
        self._wildcard: dict[str, list[int]] = {}
        self._networks: dict[tuple[int, int], dict[int, list[int]]] = {}
        self._prefixes: dict[int, list[int]] = {4: [], 6: []}

    @classmethod
    def build(cls, entries: Iterable[tuple[HostPattern, int]]) -> "HostIndex":
        index = cls()
        for pattern, rule_index in entries:
            index.add(pattern, rule_index)
        return index

    @staticmethod
    def _append(bucket: dict, key, rule_index: int) -> None:
        ids = bucket.setdefault(key, [])
        if rule_index not in ids:
            ids.append(rule_index)

    def add(self, pattern: HostPattern, rule_index: int) -> None:
        if pattern.kind == "exact":
            self._append(self._exact, pattern.value, rule_index)
        elif pattern.kind == "wildcard":
            self._append(self._wildcard, pattern.value, rule_index)
        else:
            net = pattern.network
            key = (net.version, net.prefixlen)
            prefix = int(net.network_address) >> (net.max_prefixlen - net.prefixlen)
            self._append(self._networks.setdefault(key, {}), prefix, rule_index)
            if net.prefixlen not in self._prefixes[net.version]:
                self._prefixes[net.version].append(net.prefixlen)
                self._prefixes[net.version].sort()

    def candidates(self, host: Host) -> list[int]:
        """Indexes of the rules whose hosts cover `host`, in policy order."""
        found: list[int] = list(self._exact.get(host.value, ()))
        if host.ip is None:
            name = host.value
            dot = name.find(".")
            while dot != -1:
                suffix = name[dot + 1 :]
                found.extend(self._wildcard.get(suffix, ()))
                dot = name.find(".", dot + 1)
        else:
            value, bits = int(host.ip), host.ip.max_prefixlen
            for length in self._prefixes[host.ip.version]:
                found.extend(self._networks[(host.ip.version, length)].get(value >> (bits - length), ()))
        if len(found) > 1:
            found = sorted(set(found))
        return found
