"""Canonical destination names and addresses.

Every name the sandbox sends (CONNECT authority, absolute URL, Host, :authority, SNI) and every
name in a policy goes through `canonical_host`, so that two spellings of one destination always
compare equal and anything ambiguous is refused instead of guessed at. IP literals are parsed the
way getaddrinfo/inet_aton would (decimal, hex, octal, short forms) so that `0x7f.1` cannot slip
past a check that only knows `127.0.0.1`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import idna

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_NAME_LENGTH = 253
MAX_LABEL_LENGTH = 63

# Characters that have no business in a host name and that some parser somewhere treats as a
# separator: userinfo, percent-encoding, path and query starts, backslash, whitespace, and the
# unicode full stops that IDNA 2003 maps to ".".
_FORBIDDEN = set("%@\\/?#[]<>\"'`{}|^ ,;=&+*!$()~") | {"\u3002", "\uff0e", "\uff61"}
_LABEL_RE = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
_NUMERIC_LABEL_RE = re.compile(r"^(?:0[xX][0-9a-fA-F]*|[0-9]+)\Z")
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+\Z")
_OCTAL_DIGITS = re.compile(r"[0-7]+\Z")
_DECIMAL_DIGITS = re.compile(r"[0-9]+\Z")


class HostError(ValueError):
    """A host, port or authority that is malformed or ambiguous; always a 400."""


@dataclass(frozen=True, slots=True)
class Host:
    """A canonical destination host: a lower-case A-label name or an IP address."""

    value: str
    ip: IPAddress | None = None

    @property
    def is_ip(self) -> bool:
        return self.ip is not None

    def __str__(self) -> str:
        return self.value

    def authority(self, port: int) -> str:
        host = f"[{self.value}]" if self.ip is not None and self.ip.version == 6 else self.value
        return f"{host}:{port}"


def parse_ipv4_legacy(text: str) -> ipaddress.IPv4Address:
    """Parse an IPv4 literal with inet_aton's rules: 1 to 4 parts, each decimal, 0-octal or 0x-hex.

    The last part fills the remaining bytes (`127.1` is 127.0.0.1, `2130706433` is 127.0.0.1).
    """
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        raise HostError(f"not an IPv4 address: {text!r}")
    values = []
    for part in parts:
        if not part:
            raise HostError(f"empty part in IPv4 address: {text!r}")
        # Check the characters first: int() also takes signs, '_', spaces and a second prefix.
        if part[:2] in ("0x", "0X") and _HEX_DIGITS.match(part, 2):
            value = int(part[2:], 16)
        elif len(part) > 1 and part[0] == "0" and _OCTAL_DIGITS.match(part, 1):
            value = int(part[1:], 8)
        elif part[0] != "0" and _DECIMAL_DIGITS.match(part) or part == "0":
            value = int(part, 10)
        else:
            raise HostError(f"not an IPv4 address: {text!r}")
        values.append(value)
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (5 - len(values)):
        raise HostError(f"IPv4 address out of range: {text!r}")
    number = 0
    for v in head:
        number = (number << 8) | v
    number = (number << (8 * (5 - len(values)))) | last
    return ipaddress.IPv4Address(number)


def _looks_numeric(name: str) -> bool:
    """True when the last label is a number: such a name can only be an IPv4 literal (WHATWG URL)."""
    last = name.rsplit(".", 1)[-1]
    return bool(_NUMERIC_LABEL_RE.match(last))


def ip_host(address: IPAddress) -> Host:
    return Host(address.compressed, address)


def canonical_host(raw: str) -> Host:
    """Return the canonical form of a host name or IP literal, or raise HostError.

    Canonical names are lower case, without the one optional trailing dot, IDNA A-labels.
    IPv6 literals must be bracketed and carry no zone id; brackets around anything else are refused.
    """
    if not isinstance(raw, str):
        raise HostError("host is not text")
    if not raw:
        raise HostError("empty host")
    if len(raw) > 1024:
        raise HostError("host too long")
    for ch in raw:
        if ord(ch) < 0x21 or ord(ch) == 0x7F or ch in _FORBIDDEN and ch not in "[]":
            raise HostError(f"forbidden character {ch!r} in host")
    if raw.startswith("[") or raw.endswith("]"):
        if not (raw.startswith("[") and raw.endswith("]")):
            raise HostError(f"unbalanced brackets in host {raw!r}")
        inner = raw[1:-1]
        if "[" in inner or "]" in inner:
            raise HostError(f"nested brackets in host {raw!r}")
        try:
            address = ipaddress.IPv6Address(inner)
        except ValueError:
            raise HostError(f"brackets around something that is not an IPv6 address: {raw!r}") from None
        return ip_host(address)
    if "[" in raw or "]" in raw:
        raise HostError(f"brackets inside host {raw!r}")
    if ":" in raw:
        try:
            address = ipaddress.IPv6Address(raw)
        except ValueError:
            raise HostError(f"unexpected ':' in host {raw!r}") from None
        return ip_host(address)

    name = raw[:-1] if raw.endswith(".") else raw
    if not name or name.startswith(".") or ".." in name or name.endswith("."):
        raise HostError(f"empty label in host {raw!r}")
    if not name.isascii():
        try:
            name = idna.encode(name, uts46=True, transitional=False).decode("ascii")
        except (idna.IDNAError, UnicodeError) as exc:
            raise HostError(f"invalid internationalised name {raw!r}: {exc}") from None
    name = name.lower()

    if _looks_numeric(name):
        return ip_host(parse_ipv4_legacy(name))
    if len(name) > MAX_NAME_LENGTH:
        raise HostError("host name longer than 253 characters")
    for label in name.split("."):
        if not _LABEL_RE.match(label):
            raise HostError(f"invalid label {label!r} in host {raw!r}")
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError):
                raise HostError(f"invalid A-label {label!r} in host {raw!r}") from None
    return Host(name)


def parse_port(raw: str) -> int:
    if not raw or not raw.isascii() or not raw.isdigit() or len(raw) > 5:
        raise HostError(f"invalid port {raw!r}")
    port = int(raw)
    if not 1 <= port <= 65535:
        raise HostError(f"port out of range: {raw!r}")
    return port


def parse_authority(raw: str, default_port: int | None = None) -> tuple[Host, int]:
    """Split `host[:port]` (with `[v6]:port`) and canonicalise both halves.

    Without a port, `default_port` is used; if that is None too, the port is required.
    """
    if not isinstance(raw, str) or not raw:
        raise HostError("empty authority")
    if raw.startswith("["):
        end = raw.find("]")
        if end == -1:
            raise HostError(f"unbalanced brackets in authority {raw!r}")
        host_part, rest = raw[: end + 1], raw[end + 1 :]
        if rest and not rest.startswith(":"):
            raise HostError(f"junk after IPv6 literal in authority {raw!r}")
        port_part = rest[1:] if rest else None
    else:
        host_part, sep, port_part_raw = raw.rpartition(":")
        if not sep:
            host_part, port_part = raw, None
        else:
            port_part = port_part_raw
            if ":" in host_part:
                raise HostError(f"IPv6 literal without brackets in authority {raw!r}")
    host = canonical_host(host_part)
    if port_part is None:
        if default_port is None:
            raise HostError(f"authority {raw!r} needs a port")
        return host, default_port
    return host, parse_port(port_part)


def is_ip_literal(value: str) -> bool:
    """Whether a host as a policy writes it (an IPv6 address with or without brackets) is an IP
    address rather than a name."""
    try:
        return canonical_host(value if ":" not in value else f"[{value}]").is_ip
    except HostError:
        return False
