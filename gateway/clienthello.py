"""What a TLS ClientHello must look like before its connection is relayed unread (passthrough).

An intercepted connection is safe whatever the ClientHello says: the gateway terminates the TLS
and dials the pinned name itself. A passthrough connection is not: the upstream server reads this
very ClientHello and picks the site it serves from it. So the name the gateway checked must be
the only name the upstream can read:

- exactly one server_name extension, holding exactly one host_name entry, equal (byte for byte,
  before canonicalisation) to the SNI the gateway checked: a second entry or a second extension
  is where a parser differential between the gateway and the upstream would hide;
- no Encrypted ClientHello (the real name is encrypted: the checked SNI is only the outer, public
  name) and no draft ESNI;
- no extension type twice (RFC 8446 4.2 forbids it; servers differ in which copy they take).

Works on the (type, data) extension pairs any TLS parser yields; no mitmproxy types here.
"""

from __future__ import annotations

from collections.abc import Iterable

from .decision import Decision

SERVER_NAME = 0x0000
ECH = 0xFE0D  # encrypted_client_hello (RFC 9849)
ESNI = 0xFFCE  # draft encrypted_server_name, still sent by some old clients
HOST_NAME = 0


def server_names(data: bytes) -> list[tuple[int, bytes]] | None:
    """The (name_type, name) entries of a server_name extension, or None if it is malformed."""
    if len(data) < 2:
        return None
    total = int.from_bytes(data[:2], "big")
    if total != len(data) - 2:
        return None
    entries, at = [], 2
    while at < len(data):
        if at + 3 > len(data):
            return None
        name_type, length = data[at], int.from_bytes(data[at + 1 : at + 3], "big")
        at += 3
        if at + length > len(data):
            return None
        entries.append((name_type, data[at : at + length]))
        at += length
    return entries


def check_passthrough_hello(sni: str | None, extensions: Iterable[tuple[int, bytes]]) -> Decision | None:
    """None when the ClientHello may be relayed unread; else the refusal."""
    extensions = list(extensions)
    types = [ext_type for ext_type, _ in extensions]
    if ECH in types or ESNI in types:
        return Decision.deny("ech_refused", "a passthrough connection cannot use Encrypted ClientHello: "
                             "the name the upstream would serve is hidden from the gateway")
    if len(set(types)) != len(types):
        return Decision.deny("bad_client_hello", "the TLS ClientHello repeats an extension")
    if not sni:
        return Decision.deny("sni_required", "a passthrough connection needs a TLS SNI naming the destination")
    found = [data for ext_type, data in extensions if ext_type == SERVER_NAME]
    entries = server_names(found[0]) if len(found) == 1 else None
    if entries is None or len(entries) != 1 or entries[0][0] != HOST_NAME:
        return Decision.deny("bad_client_hello", "the TLS server_name extension must hold exactly one host name")
    if entries[0][1] != sni.encode("ascii", "replace"):
        return Decision.deny("bad_client_hello", "the TLS server_name extension does not say what was checked")
    return None
