"""Hop-by-hop fields of a request the gateway forwards: they were meant for the gateway's hop and
are not sent on (RFC 9110 §7.6.1).

- `TE` names the transfer-codings the *sender* accepts. Forwarded, `TE: gzip` invites the origin
  to answer `Transfer-Encoding: gzip, chunked`: a body that is compressed below the chunked
  framing, which a redactor reading the chunks sees compressed (a secret echoed in it comes back
  untouched). Every `TE` field is dropped, in any spelling, however many; the one exception is
  an HTTP/2 request that asked for `trailers` (gRPC servers built on grpc-core refuse calls without
  `te: trailers`, and it is the only value HTTP/2 allows): it gets exactly `te: trailers`.
- `Connection` nominates fields that are hop-by-hop too. The gateway removes the nominated fields
  the sandbox sent, except the ones forwarding depends on (Host, the framing fields
  Content-Length and Transfer-Encoding, and Upgrade of a WebSocket handshake: removing those
  would change where the request goes or where its body ends), and forwards a `Connection`
  holding only the options `close`, `keep-alive` and `upgrade`. So no nomination ever reaches the
  upstream: a front end there cannot be told to strip a field the gateway set (the injected
  credential, `Accept-Encoding: identity`, Host) after the gateway's checks.
- `Keep-Alive` and `Proxy-Connection` are dropped.

This runs after the decision and before credentials are injected: what the gateway injects is
never subject to the sandbox's nominations.

`Proxy-Authorization` is the credential of the sandbox's hop to the gateway (a proxy token,
gateway/proxyauth.py): it is removed from every request the gateway forwards, absolute-form or in a
tunnel, HTTP/1 or HTTP/2 (`without_proxy_credentials`). That runs after the credential verdict, so a
bound rule still refuses one as a foreign credential (gateway/foreign.py) exactly as before; no
rule can inject one (gateway/credentials.py FORBIDDEN_INJECT_HEADERS).
"""

from __future__ import annotations

from collections.abc import Sequence

Field = tuple[bytes, bytes]

CONNECTION_OPTIONS = frozenset({b"close", b"keep-alive", b"upgrade"})  # kept in a forwarded Connection
ALWAYS_DROPPED = frozenset({b"te", b"keep-alive", b"proxy-connection"})
NEVER_NOMINATED = frozenset({b"host", b"content-length", b"transfer-encoding", b"upgrade", b"connection"})


def _members(value: bytes) -> list[bytes]:
    return [m.strip(b" \t") for m in value.split(b",") if m.strip(b" \t")]


def forwardable(fields: Sequence[Field], http2: bool) -> list[Field] | None:
    """The request's header fields as they may go upstream, or None when nothing changes."""
    options: list[bytes] = []  # Connection members, as spelt
    asks_trailers = False
    for name, value in fields:
        lower = name.lower()
        if lower == b"connection":
            options += _members(value)
        elif lower == b"te":
            asks_trailers = asks_trailers or any(m.split(b";")[0].strip().lower() == b"trailers" for m in _members(value))
    nominated = {o.lower() for o in options} - NEVER_NOMINATED
    kept_options: list[bytes] = []  # each option once, as first spelt (mitmproxy compares "close" as sent)
    for option in options:
        if option.lower() in CONNECTION_OPTIONS and option.lower() not in {o.lower() for o in kept_options}:
            kept_options.append(option)
    out: list[Field] = []
    connection_done = te_done = False
    for name, value in fields:
        lower = name.lower()
        if lower == b"connection":
            if not connection_done and kept_options:
                out.append((name, b", ".join(kept_options)))
            connection_done = True
        elif lower == b"te":
            if http2 and asks_trailers and not te_done:
                out.append((b"te", b"trailers"))
            te_done = True
        elif lower in ALWAYS_DROPPED or lower in nominated:
            continue
        else:
            out.append((name, value))
    return None if out == list(fields) else out


PROXY_CREDENTIALS = b"proxy-authorization"


def without_proxy_credentials(fields: Sequence[Field]) -> list[Field] | None:
    """The fields without any Proxy-Authorization (any spelling, any number), or None when there is none."""
    kept = [(name, value) for name, value in fields if name.lower() != PROXY_CREDENTIALS]
    return None if len(kept) == len(fields) else kept
