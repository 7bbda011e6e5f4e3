"""The address of one of the gateway's own listeners (`--metrics`, `--control`): HOST:PORT, the
host an IP address, read one way for both."""

from __future__ import annotations

import ipaddress
import re

from .hostnames import IPAddress


def parse_listen(spec: str, forms: str = "HOST:PORT or [IPV6]:PORT") -> tuple[IPAddress, int]:
    """HOST:PORT or [IPV6]:PORT, HOST an IP address (or `localhost`); PORT 0 picks a free port.
    `forms`: what the error says was expected (the caller may take other forms too)."""
    match = re.fullmatch(r"\[([^\]]+)\]:(\d{1,5})|([^:\[\]]+):(\d{1,5})", spec.strip())
    if not match:
        raise ValueError(f"{spec!r}: expected {forms}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{spec!r}: the host must be an IP address") from None
    if port > 65535:
        raise ValueError(f"{spec!r}: port out of range")
    return address, port
