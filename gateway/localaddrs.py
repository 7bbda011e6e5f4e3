"""The gateway's own addresses, so that no policy can make it dial itself.

Read from the kernel (Linux /proc) once at start-up; on other systems only the listening
addresses are known, which the caller adds anyway.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from .hostnames import IPAddress


def _ipv4_local(fib_trie: str) -> set[ipaddress.IPv4Address]:
    found: set[ipaddress.IPv4Address] = set()
    last: str | None = None
    for line in fib_trie.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped == "/32 host LOCAL" and last:
            try:
                found.add(ipaddress.IPv4Address(last))
            except ValueError:
                pass
    return found


def _ipv6_local(if_inet6: str) -> set[ipaddress.IPv6Address]:
    found: set[ipaddress.IPv6Address] = set()
    for line in if_inet6.splitlines():
        fields = line.split()
        if fields and len(fields[0]) == 32:
            try:
                found.add(ipaddress.IPv6Address(int(fields[0], 16)))
            except ValueError:
                pass
    return found


def local_addresses(proc: Path = Path("/proc/net")) -> frozenset[IPAddress]:
    addresses: set[IPAddress] = set()
    try:
        addresses |= _ipv4_local((proc / "fib_trie").read_text())
    except OSError:
        pass
    try:
        addresses |= _ipv6_local((proc / "if_inet6").read_text())
    except OSError:
        pass
    return frozenset(addresses)
