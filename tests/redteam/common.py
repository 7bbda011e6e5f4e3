"""Shared pieces of the red-team suite: the attack categories, the `attack(...)` marker helper, and
small assertions that every attack ends with.

Every attack is a real exchange with a running gateway. The oracle is on the upstream side: a
forbidden upstream must not have seen anything at all, not even a TCP connection (the recording
servers count accepted connections separately from requests). Where a secret is configured, the
client side is searched for every form of it (tests.credentials.clients.leaks).
"""

from __future__ import annotations

import pytest

# category -> one line, in the order the summary table prints them
CATEGORIES: dict[str, str] = {
    "restating": "destination restating (SNI, Host, :authority, absolute-form, keep-alive, coalescing)",
    "connect": "CONNECT edge cases (ports, malformed authorities, userinfo, nesting, own ports)",
    "host-header": "Host header shapes (duplicates, folding, NUL, dots, case, ports, IPv6, empty)",
    "h2": "HTTP/2 header injection, downgrade splitting and rapid reset",
    "hostnames": "host name tricks (suffixes, confusables, IDNA, encodings, userinfo, backslash)",
    "ip": "IP encodings and special ranges (metadata, CGNAT, mapped/NAT64/6to4/Teredo)",
    "dns": "DNS (rebinding, exfiltration through names, DoH/DoT)",
    "tls": "TLS (bad upstream certificates, ECH, ALPN, fragmented ClientHello)",
    "smuggling": "request smuggling (CL/TE, duplicate CL, obs-fold, bare LF, Expect, chunk extensions)",
    "upgrade": "protocol upgrades (h2c, unsolicited 101, WebSocket to denied paths)",
    "non-http": "non-HTTP egress (SSH, raw TCP, TLS in TLS, QUIC/UDP)",
    "credentials": "credential exfiltration (echo, TRACE, redirects, spelling, placeholders, query)",
    "paths": "path and method policy evasion (traversal, encodings, params, overrides)",
    "self": "self-protection (proxy loops, own addresses and ports, 0.0.0.0, metrics port)",
    "revocation": "open connections after a policy change (WebSockets, passthrough, HTTP/2, reload races, sandboxes)",
}


class _Attack(list):
    """A list of marks (usable as `pytestmark = attack(...)`) that is also a decorator."""

    def __call__(self, function):
        for mark in reversed(self):
            function = mark(function)
        return function


def attack(category: str) -> _Attack:
    """The marks of one red-team case: `redteam`, `attack(category)` and `rt_<category>` (so that
    `-m rt_dns` selects one category)."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown attack category {category!r}")
    return _Attack([pytest.mark.redteam, pytest.mark.attack(category),
                    getattr(pytest.mark, marker_name(category))])


def marker_name(category: str) -> str:
    return "rt_" + category.replace("-", "_")


# --- oracles ----------------------------------------------------------------------------------


def nothing_reached(servers: dict[str, object], context: object = None) -> None:
    """None of these recorders (label -> server with .touched/.connections and .settle()) saw
    anything, a connection still in an accept queue included (each is fenced first)."""
    for server in servers.values():
        server.settle()
    touched = {label: getattr(server, "connections", "?") for label, server in servers.items() if touched_(server)}
    assert not touched, f"forbidden upstream(s) reached (label: connections): {touched}" + (
        f"; {context!r}"[:1500] if context is not None else "")


def touched_(server) -> bool:
    """A recorder saw something (a connection, a datagram, a request head)."""
    if hasattr(server, "touched"):
        return bool(server.touched)
    return bool(getattr(server, "connections", 0) or getattr(server, "heads", None))


def status_of(response) -> int | None:
    return getattr(response, "status", None) or getattr(response, "status_code", None)


def reason_of(response) -> str | None:
    if hasattr(response, "egress_reason"):
        return response.egress_reason
    headers = getattr(response, "headers", {})
    return headers.get("x-egress-reason") if isinstance(headers, dict) else None
