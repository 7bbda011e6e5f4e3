"""Header-level checks every request passes before the policy looks at it.

Pure functions over (name, value) pairs, so the same checks serve HTTP/1 and HTTP/2 and can be
tested without a proxy. Each returns a denial Decision or None.
"""

from __future__ import annotations

from collections.abc import Sequence

from .decision import Decision
from .hostnames import Host, HostError, parse_authority

DEFAULT_PORTS = {"http": 80, "https": 443}
_BAD_VALUE_CHARS = ("\x00", "\r", "\n")


def check_headers(headers: Sequence[tuple[str, str]]) -> Decision | None:
    """Duplicate or malformed Host, control characters, and upgrades other than WebSocket."""
    hosts = [v for k, v in headers if k.lower() == "host"]
    if len(hosts) > 1:
        return Decision.deny("bad_host_header", "more than one Host header")
    for name, value in headers:
        if any(c in value for c in _BAD_VALUE_CHARS) or any(c in name for c in _BAD_VALUE_CHARS + (" ", ":")):
            reason = "bad_host_header" if name.lower() == "host" else "bad_header"
            return Decision.deny(reason, f"control character in header {name[:40]!r}")
    upgrades = [v for k, v in headers if k.lower() == "upgrade"]
    if upgrades:
        tokens = [t.strip().lower() for v in upgrades for t in v.split(",") if t.strip()]
        if tokens != ["websocket"]:
            return Decision.deny("upgrade_refused", "only 'Upgrade: websocket' is allowed")
    if any(k.lower() == "http2-settings" for k, _ in headers):
        return Decision.deny("upgrade_refused", "HTTP2-Settings (h2c upgrade) is refused")
    return None


def authority_matches(value: str, scheme: str, host: Host, port: int) -> bool:
    """Does a Host/:authority value name exactly host:port? Raises HostError when malformed."""
    other_host, other_port = parse_authority(value, DEFAULT_PORTS.get(scheme))
    return other_host.value == host.value and other_port == port


def check_restated(
    values: Sequence[tuple[str, str]], scheme: str, host: Host, port: int
) -> Decision | None:
    """Every (kind, value) — kind 'host' or 'authority' — must name the pinned host and port."""
    for kind, value in values:
        try:
            same = authority_matches(value, scheme, host, port)
        except HostError as exc:
            return Decision.deny("bad_host_header", f"malformed {kind}: {exc}")
        if not same:
            reason = "host_mismatch" if kind == "host" else "authority_mismatch"
            return Decision.deny(
                reason, f"the {kind} {value[:100]!r} is not the pinned destination {host.authority(port)}"
            )
    return None
