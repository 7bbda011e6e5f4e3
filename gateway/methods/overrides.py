"""Method overrides in a request head: the names a header, query or body field overrides the method
under, the methods a value names, and what the audit line records of them (`Override`,
`overrides`, `described`); the conventions are in the package's docstring."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..foreign import QUERY_SPLIT, fully_unquoted, query_key
from ..policy import FORBIDDEN_METHODS

OVERRIDE_HEADERS = ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override")
# Query parameters, form fields and top-level JSON keys (compared as query names are).
OVERRIDE_FIELDS = ("_method", "_method_override", "_HttpMethod", "X-HTTP-Method-Override", "X-HTTP-Method",
                   "X-Method-Override")
# Query parameters that are an override only when their value is a registered method name.
GENERIC_FIELDS = ("method",)



def override_header_key(name: str) -> str:
    """A header name as CGI-style servers file it: PHP's built-in server, Apache's and others'
    CGI/FastCGI environments turn every character that is not a letter or digit into `_`
    (`X.HTTP.Method.Override` is HTTP_X_HTTP_METHOD_OVERRIDE), so every such character is `-` here."""
    return re.sub(r"[^0-9a-z]", "-", name.strip().lower())


HEADER_KEYS = frozenset(override_header_key(n) for n in OVERRIDE_HEADERS)
FIELD_KEYS = frozenset(query_key(n) for n in OVERRIDE_FIELDS)
GENERIC_KEYS = frozenset(query_key(n) for n in GENERIC_FIELDS)
if not all("method" in k for k in FIELD_KEYS | GENERIC_KEYS):  # field_overrides' fast path relies on it
    raise RuntimeError("every override field name must contain 'method'")

# The IANA HTTP Method Registry, and the unregistered methods servers and caches act on.
KNOWN_METHODS = frozenset({
    "ACL", "BASELINE-CONTROL", "BIND", "CHECKIN", "CHECKOUT", "CONNECT", "COPY", "DELETE", "GET", "HEAD",
    "LABEL", "LINK", "LOCK", "MERGE", "MKACTIVITY", "MKCALENDAR", "MKCOL", "MKREDIRECTREF", "MKWORKSPACE",
    "MOVE", "OPTIONS", "ORDERPATCH", "PATCH", "POST", "PRI", "PROPFIND", "PROPPATCH", "PUT", "QUERY",
    "REBIND", "REPORT", "SEARCH", "TRACE", "UNBIND", "UNCHECKOUT", "UNLINK", "UNLOCK", "UPDATE",
    "UPDATEREDIRECTREF", "VERSION-CONTROL",
    "PURGE", "BAN", "TRACK", "M-SEARCH", "NOTIFY", "SUBSCRIBE", "UNSUBSCRIBE", "SOURCE",
})

NOT_A_METHOD = "(not a method name)"
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")  # RFC 9110 token: what a method is
# Distinct methods one override value may name: past it the value counts as naming no method (refused
# whatever the rule allows; no client names 65 methods), so a sandbox cannot make the gateway build,
# judge and describe thousands of them for one header.
MAX_ELEMENTS = 64

SOURCES = {"header": "header", "query": "query parameter", "form": "form field", "json": "JSON key"}


@dataclass(frozen=True)
class Override:
    """One method an override names. `method` is upper case, or None when the value under an
    override name is not a method token (refused whatever the rule allows)."""

    source: str  # header | query | form | json
    name: str  # as sent (cut to 64 characters)
    method: str | None

    @property
    def where(self) -> str:
        return f"{SOURCES[self.source]} {self.name}"

    def describe(self) -> str:
        """`header X-HTTP-Method-Override: DELETE` (the audit line's `method_override` entries)."""
        return f"{self.where}: {self.method or NOT_A_METHOD}"


def _elements(value: str) -> list[str | None]:
    """The methods a value names (upper case; None for an element that is not a method token)."""
    out: dict[str | None, None] = {}  # distinct, in order: a repeated element judges the same
    for element in dict.fromkeys(value.split(",")):
        element = element.strip(" \t\r\n\f\v")
        if not element:
            continue
        out[element.upper() if element.isascii() and _TOKEN.match(element) else None] = None
        if len(out) > MAX_ELEMENTS:
            out = dict.fromkeys(list(out)[:MAX_ELEMENTS] + [None])
            break
    return list(out)


def field_overrides(source: str, name: str, value: str, generic: bool = False) -> list[Override]:
    """Overrides one query/form/JSON field carries (none when its name is not an override name).
    `generic`: also the names that count only with a registered method as value (query only)."""
    if name.isascii() and "%" not in name and "+" not in name and "method" not in name.lower():
        return []  # not decoded, so query_key cannot make "method" appear: the common case, read fast
    key = query_key(name)
    shown = name[:64]
    if key in FIELD_KEYS:
        return [Override(source, shown, m) for m in _elements(fully_unquoted(value))]
    if generic and key in GENERIC_KEYS:
        return [Override(source, shown, m) for m in _elements(fully_unquoted(value)) if m in KNOWN_METHODS]
    return []


def header_overrides(headers: Iterable[tuple[str, str]]) -> list[Override]:
    found: dict[Override, None] = {}
    for name, value in headers:
        if override_header_key(name) in HEADER_KEYS:
            found.update(dict.fromkeys(Override("header", name[:64], m) for m in _elements(value)))
            if len(found) > MAX_ELEMENTS:
                return _capped(found, Override("header", name[:64], None))
    return list(found)


def _capped(found: dict[Override, None], past: Override) -> list[Override]:
    """MAX_ELEMENTS distinct overrides, then one naming no method (refused whatever the rule allows)."""
    return list(found)[:MAX_ELEMENTS] + [past]


def query_overrides(target: str) -> list[Override]:
    query = target.partition("#")[0].partition("?")[2]
    found: dict[Override, None] = {}
    if not query:
        return []
    # Looser than any server: ';' splits too. A repeated field judges the same: read once.
    for piece in dict.fromkeys(QUERY_SPLIT.split(query)):
        name, equals, value = piece.partition("=")
        if equals:
            found.update(dict.fromkeys(field_overrides("query", name, value, generic=True)))
            if len(found) > MAX_ELEMENTS:
                return _capped(found, Override("query", name[:64], None))
    return list(found)


def overrides(headers: Iterable[tuple[str, str]], target: str) -> tuple[Override, ...]:
    """Every distinct method override in the request's headers and target, in order (a repeated
    one judges the same: `GET,GET,...` is one override, however often it is repeated)."""
    return tuple(dict.fromkeys(header_overrides(headers) + query_overrides(target)))


DESCRIBED_CAP = 16  # `method_override` entries an audit line or a message lists; then "+N more"


def described(found: Iterable[Override], cap: int = DESCRIBED_CAP) -> list[str]:
    """The audit line's `method_override` entries: distinct, at most `cap`, then `+N more` (the
    sandbox chooses how many it sends; every one is judged, only `cap` are written)."""
    distinct = list(dict.fromkeys(o.describe() for o in found))
    if len(distinct) <= cap:
        return distinct
    return distinct[:cap] + [f"+{len(distinct) - cap} more"]


def refused(found: Iterable[Override], allows: Callable[[str], bool]) -> Override | None:
    """The first override naming a method `allows` refuses (or no method at all), else None."""
    for override in found:
        if override.method is None or not allows(override.method):
            return override
    return None


def forbidden(found: Iterable[Override]) -> Override | None:
    """The first override naming TRACE, TRACK or CONNECT (never allowed, never relaxed)."""
    return next((o for o in found if o.method in FORBIDDEN_METHODS), None)


def parse_described(entries: Sequence[str]) -> list[tuple[str, str]]:
    """The header overrides of an audit line's `method_override` entries, back as header pairs
    (replay re-decides them)."""
    headers = []
    for entry in entries:
        if isinstance(entry, str) and entry.startswith("header "):
            name, sep, value = entry[len("header "):].partition(": ")
            if sep and name:
                headers.append((name, value))
    return headers


def described_query_overrides(entries: Sequence[str]) -> list[Override]:
    """The query overrides of an audit line's `method_override` entries. The recorded path is
    capped (gateway/audit.py), so its query may have lost them: replay judges these as recorded."""
    found = []
    prefix = SOURCES["query"] + " "
    for entry in entries:
        if isinstance(entry, str) and entry.startswith(prefix):
            name, sep, value = entry[len(prefix):].rpartition(": ")
            if sep and name:
                method = None if value == NOT_A_METHOD else value.strip().upper()
                if method is not None and not (method.isascii() and _TOKEN.match(method)):
                    method = None
                found.append(Override("query", name, method))
    return found
