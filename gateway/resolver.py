"""Name resolution done by the gateway itself, once per pin.

`static_hosts` first (like /etc/hosts, from the policy), then the system resolver through
getaddrinfo with a timeout. The caller checks every address returned and dials one of exactly
those, so a second lookup (DNS rebinding) never happens between the check and the connect.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket

from .hostnames import Host, IPAddress

DEFAULT_TIMEOUT = 5.0
# Threads only for name lookups; more than the loop's default pool, since a lookup that hangs
# holds its thread until the system resolver gives up (its own timeouts, not ours).
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="egress-dns")


class ResolveError(Exception):
    pass


class Resolver:
    def __init__(self, static_hosts: dict[str, tuple[IPAddress, ...]] | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.static_hosts = dict(static_hosts or {})
        self.timeout = timeout
        self._in_flight: dict[tuple[str, int], asyncio.Future] = {}

    async def resolve(self, host: Host, version: int | None = None) -> tuple[IPAddress, ...]:
        """Every address of the host (only IPv4 or IPv6 ones with version=4/6)."""
        if host.ip is not None:
            found: tuple[IPAddress, ...] = (host.ip,)
        elif host.value in self.static_hosts:
            found = self.static_hosts[host.value]
        else:
            found = await self._lookup(host, version)
        if version is not None:
            found = tuple(a for a in found if a.version == version)
        return found

    def _finished(self, key: tuple[str, int], future: asyncio.Future) -> None:
        self._in_flight.pop(key, None)
        if not future.cancelled():
            future.exception()  # seen: a lookup that failed after everyone stopped waiting is no error

    async def _lookup(self, host: Host, version: int | None) -> tuple[IPAddress, ...]:
        family = {4: socket.AF_INET, 6: socket.AF_INET6}.get(version, socket.AF_UNSPEC)
        loop = asyncio.get_running_loop()
        key = (host.value, family)
        # One lookup per name in flight, on the resolver's own threads: a getaddrinfo that hangs
        # cannot be cancelled, and must not starve other names (or the loop's default executor).
        pending = self._in_flight.get(key)
        if pending is None:
            pending = loop.run_in_executor(
                _EXECUTOR, socket.getaddrinfo, host.value, None, family, socket.SOCK_STREAM, socket.IPPROTO_TCP
            )
            self._in_flight[key] = pending
            pending.add_done_callback(lambda f, k=key: self._finished(k, f))
        try:
            infos = await asyncio.wait_for(asyncio.shield(pending), self.timeout)
        except TimeoutError:
            raise ResolveError(f"resolving {host.value} timed out after {self.timeout:g}s") from None
        except (OSError, UnicodeError) as exc:
            raise ResolveError(f"cannot resolve {host.value}: {exc}") from None
        addresses: list[IPAddress] = []
        for family, *_rest, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            text = sockaddr[0].split("%", 1)[0]
            address = ipaddress.ip_address(text)
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise ResolveError(f"{host.value} has no IPv4 or IPv6 address")
        return tuple(addresses)
