"""The method a request is judged by: the method on the wire and every method override in it.

Web frameworks and large APIs let a request name another method than the one it is sent with, for
clients (HTML forms, old proxies, App Engine, Flash) that can only send GET and POST:

| convention | who honours it |
|---|---|
| header `X-HTTP-Method-Override` | Google APIs and GData, OneDrive/Microsoft Graph, Django REST framework (on any method), Rack/Rails, Symfony/Laravel, Express `method-override`, ASP.NET Core, Yii, CakePHP, Slim, Ktor, gorilla/handlers, Scalatra, Catalyst |
| header `X-HTTP-Method` | OData and SharePoint, Express `method-override` (configured), ArangoDB |
| header `X-Method-Override` | Express `method-override` (configured), ArangoDB |
| query or form field `_method` (any case: `_METHOD` is Slim's) | Rails/Rack (form body; older Rack also the query), Laravel and Symfony (body, then query), Spring `HiddenHttpMethodFilter` (query and form), Express `method-override` (query or body), gorilla (`FormValue`: query and body), Trillium, Scalatra, CakePHP, Yii, PAGI |
| JSON key `_method` / `_METHOD` | Laravel (its input bag is the JSON body), Slim (parsed body), Express getters reading `req.body._method` |
| query field `_method_override` | Haskell wai-extra |
| query field `method` | Akka HTTP `overrideMethodWithParameter("method")` (its documented name) |

Some honour an override only on POST, some on any method (DRF, ArangoDB, Ktor, Akka, Yii's header,
phapi's GET overrides), so the gateway judges overrides on every method: a request is allowed only
if its wire method **and every method any override names** are allowed by the rule. Overrides are
never stripped and let through: a server may read the same field from the body, where the gateway
cannot strip it without rewriting the body.

Spellings, as upstreams read them: header names case-insensitively with every non-alphanumeric
character as `-` (CGI, WSGI and PHP turn `X_HTTP_Method_Override` and `X.HTTP.Method.Override`
into `HTTP_X_HTTP_METHOD_OVERRIDE`); query and form names like
gateway/foreign.py (percent-decoded, case-folded, `.`, `-` and space as `_`, `[...]` array suffixes
dropped). Values are percent-decoded (query and form), trimmed and upper-cased (frameworks upper-case
overrides), split at commas (Express takes the first element of `GET, DELETE`, others the whole):
every element counts. A value under one of the override names that is not a method token at all
(`DELETE;x`, a NUL, non-ASCII) is refused too: no client needs one, and what a server makes of it is
not knowable. An empty value is no override. The generic name `method` (query only) counts only when
its value is a registered method name (`?method=flickr.photos.search` is an API's own parameter).

Pure: `overrides` finds them in headers and the request target; `refused` says which one the rule
does not allow; `BodyScanner` (below) finds them in urlencoded, multipart and JSON bodies, fed
chunk by chunk, read as a superset of every framework's reading (or says why it cannot: `problem`).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from .foreign import DECODE_ROUNDS, QUERY_SPLIT, fully_unquoted, query_key
from .steps import run_steps
from .policy import FORBIDDEN_METHODS

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
VALUE_CAP = 512  # bytes of a field value kept; a longer value is not a method name
NAME_CAP = 512  # bytes of a body field name kept; a longer name that may hold an override is refused
# A longer name is not read, yet frameworks shorten names: PHP cuts one at its first NUL and drops
# leading spaces, Rack drops leading and trailing brackets (`_method` + 600 NULs is PHP's `_method`).
# So an over-long form name that could hold an override key once shortened (it holds "method" in any
# case, a `%` that could spell it, or a byte some declared charset reads more into) is an override
# naming no method: refused as uncheckable, as an over-long value under an override name is.
# Only a name that starts with an override key (after what PHP and Rack drop from the front:
# whitespace, brackets, and the escapes that spell them) can be shortened into one, so binary data
# read as a form (a gzip body as sent) is not refused for a long run without `&`. The first
# LONG_HEAD bytes are kept to tell; past a padding run that long, "method" or `%` anywhere counts.
_LONG_SUSPECT = re.compile(rb"%|[Mm][Ee][Tt][Hh][Oo][Dd]")


def _long_suspect(piece: bytes) -> bool:
    """`_LONG_SUSPECT.search(piece)`, at memchr speed: a sandbox's long name is scanned byte by
    byte by the regex engine at ~10 MB/s of form reading, 25 ms of the event loop per 256 KiB read."""
    if b"%" in piece:
        return True
    return (b"d" in piece or b"D" in piece) and b"method" in piece.lower()  # (no copy for most bytes)

_PADDING = re.compile(rb"[\x09-\x0d\x1c-\x20+\[\]\x80-\xff%0-9A-Fa-f]*+")
LONG_HEAD = 4096
# Fields (or multipart parts) one reading reads in full, one by one: every field when no fast path
# covers its charsets (EBCDIC, UTF-16/32, punycode: `_NameFilter.for_charsets`), else the distinct
# fields the fast path could not rule out (names that look like an override's). Each costs every
# charset's decoding and query_key, so past this many the body is refused as uncheckable rather
# than hold the event loop for seconds. No client sends 1000 fields named like `_method`; PHP reads
# 1000 fields in all by default (max_input_vars), Tomcat 1000 (maxParameterCount).
SLOW_FIELDS_CAP = 1000

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


# --- bodies ---------------------------------------------------------------------------------------
#
# A body is read as a SUPERSET of what any mainstream framework could read a `_method` field from
# (docs/policy.md "Method overrides"): every plausible reading of its Content-Type, every plausible
# charset, the bytes as sent and decoded, multipart as liberally as PHP and Rack. A reading that
# finds an override the rule does not allow refuses the body; a body the gateway cannot read under
# some plausible reading (an unknown charset, a Content-Encoding that does not decode) is refused as
# uncheckable (`BodyScanner.problem`).


class BodyTooLarge(ValueError):
    """A compressed body decodes past the decoder's budget: it cannot be checked."""


READINGS_CAP = 6  # distinct boundaries (or charsets) one Content-Type may name; more is refused
CODINGS_CAP = 3  # stacked Content-Encodings decoded; more is refused
_ESCAPES_PROBE = bytes(range(128)) + b"\\u005f\\x5f+AF8-~{_~}\x1b$B_\x1b(B&#95;"


def _codec(name: str) -> str | None:
    """Python's codec for a declared charset, or None when Python has no such text encoding."""
    name = name.strip().strip("\"'").strip().lower()
    name = {"ucs-2": "utf-16", "ucs2": "utf-16", "ucs-4": "utf-32", "ucs4": "utf-32", "unicode": "utf-16",
            "unicodefffe": "utf-16-be", "unicodefeff": "utf-16-le", "x-utf-16le-bom": "utf-16-le",
            "x-utf-32le-bom": "utf-32-le", "x-utf-16be-bom": "utf-16-be", "x-utf-32be-bom": "utf-32-be"}.get(name, name)
    try:
        info = codecs.lookup(name)
    except (LookupError, ValueError):
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None


_WIDE = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")


def _ascii_transparent(codec: str) -> bool:
    """Does every ASCII byte read as itself, whatever surrounds it (UTF-8, Latin-1, windows-125x,
    Shift_JIS, GBK...)? Then the bytes as sent are a reading of the text already. Not so for
    EBCDIC, UTF-16/32, UTF-7, ISO-2022, HZ or Python's escape codecs."""
    try:
        return codecs.decode(_ESCAPES_PROBE, codec) == _ESCAPES_PROBE.decode("latin-1")
    except Exception:
        return False


@dataclass
class BodyPlan:
    """How a request body is read, from its Content-Type values (`plan_body`)."""

    form: bool = False
    json: bool = False
    multipart: bool = False
    boundaries: tuple[bytes, ...] = ()
    charsets: tuple[str, ...] = ()  # codecs (not ASCII-transparent) the text may be in: decoded readings
    wide: bool = False  # a UTF-16/32 charset was declared
    problem: str | None = None  # why a body of this type cannot be checked

    @property
    def parses(self) -> bool:
        return self.form or self.json or self.multipart

    @property
    def field_charsets(self) -> tuple[str, ...]:
        """What field names and values are decoded as, besides UTF-8 (Tomcat splits a form at the
        ASCII `&` and `=` bytes and decodes each name with the declared charset)."""
        return self.charsets + (_WIDE if self.wide else ())


_CT_FORM = "application/x-www-form-urlencoded"
_PARAM = r"\s*=\s*(\"[^\"]*\"?|'[^']*'?|[^;,\s]*)"
_CHARSET = re.compile(r"charset" + _PARAM, re.IGNORECASE)


def _boundaries(value: str) -> list[str]:
    """Every boundary any parser could take from a Content-Type value: after each `boundary`
    anywhere in it (PHP: the next `=` after the word), quoted or not, cut at `;` / `,` (PHP, Rack)
    or at whitespace too (RFC 2046)."""
    found: list[str] = []
    lower = value.lower()
    start = lower.find("boundary")
    while start >= 0:
        equals = value.find("=", start + len("boundary"))
        if equals < 0:
            break
        rest = value[equals + 1:]
        for text in {rest, rest.lstrip()}:
            if text.startswith('"'):
                inner = text[1:]
                found.append(inner.split('"', 1)[0])  # PHP and Rack: up to the next quote
                m = re.match(r'((?:[^"\\]|\\.)*)', inner)  # RFC quoted-string, escapes undone
                found.append(re.sub(r"\\(.)", r"\1", m.group(1)))
                found.append(re.split(r"[;,]", text, maxsplit=1)[0].strip('"'))  # Rack's "?([^";,]+)"?
            else:
                cut = re.split(r"[;,]", text, maxsplit=1)[0]
                found += [cut, cut.rstrip(), re.split(r"[;,\s]", text, maxsplit=1)[0]]
        start = lower.find("boundary", start + 1)
    return found


def plan_body(content_types: Sequence[str]) -> BodyPlan:
    """The readings of a body with these Content-Type values (none at all: Rack parses it as a
    form; some JSON parsers do not look at the type). Liberal on purpose: the media type is cut at
    `;`, `,` or whitespace by one server or another (a prefix test covers them all), `/json` or
    `+json` anywhere makes Laravel read JSON, `boundary` is found anywhere (PHP)."""
    plan = BodyPlan()
    if not content_types:
        plan.form = plan.json = True
        return plan
    values = list(content_types) + ([", ".join(content_types)] if len(content_types) > 1 else [])
    boundaries: list[str] = []
    charsets: list[str] = []
    for value in values:
        for piece in [value, *value.split(",")]:
            media = piece.strip().lower()
            plan.form |= media.startswith(_CT_FORM) or not media
            plan.multipart |= media.startswith("multipart/")
            plan.json |= "json" in media
        if "multipart/" in value.lower():
            boundaries += _boundaries(value)
        charsets += [m.group(1) for m in _CHARSET.finditer(value)]
    if plan.multipart:
        plan.boundaries = tuple(dict.fromkeys(b.encode("utf-8", "surrogateescape") for b in boundaries if b))
    decoded: list[str] = []
    for name in dict.fromkeys(c.strip().strip("\"'").strip() for c in charsets):
        if not name:
            continue
        codec = _codec(name)
        if codec is None:
            if plan.form or plan.multipart:
                plan.problem = f"its charset {name[:40]!r} is not one the gateway can read"
            continue
        if codec.startswith(("utf-16", "utf-32")):
            plan.wide = True
        elif not _ascii_transparent(codec):
            decoded.append(codec)
    plan.charsets = tuple(dict.fromkeys(decoded))
    if len(plan.boundaries) > READINGS_CAP or len(plan.charsets) > READINGS_CAP:
        plan.problem = "its Content-Type names too many boundaries or charsets"
    return plan


def _unquoted_bytes(raw: bytes) -> bytes:
    raw = raw.replace(b"+", b" ")
    for _ in range(DECODE_ROUNDS):
        decoded = unquote_to_bytes(raw)
        if decoded == raw:
            break
        raw = decoded
    return raw


def _texts(raw: bytes, charsets: Sequence[str], percent: bool, value: bool = False) -> list[str]:
    """A field name's or value's text under UTF-8 and under each charset (percent escapes decoded
    to bytes first, as Django and Tomcat do), distinct, UTF-8 first (a UTF-8 name is left as sent:
    query_key decodes it)."""
    texts = [raw.decode("utf-8", "replace")]
    if percent and value:
        texts = [fully_unquoted(texts[0])]
    for charset in charsets:
        try:
            texts.append((_unquoted_bytes(raw) if percent else raw).decode(charset, "replace"))
        except Exception:
            continue
    return list(dict.fromkeys(texts))


def _override_names(raw: bytes, charsets: Sequence[str], percent: bool = True) -> list[str]:
    return [t for t in _texts(raw, charsets, percent) if _may_be_key(t) and query_key(t) in FIELD_KEYS]


# --- the scan's fast paths ------------------------------------------------------------------------
#
# A body of a million tiny fields (`a=b&a=b&...`) must not cost a million trips through `query_key`:
# the scan runs on the event loop every sandbox shares. Every override key contains "method", and no
# character but the ASCII letters casefolds to a piece of a contiguous "method" (U+1E96 and U+1E97
# casefold to a letter and a combining mark, U+FB05 and U+FB06 to "st"), so a text can only be an
# override name if, once its percent-escapes are decoded, it holds "method" in ASCII letters of any
# case. The tests below are necessary conditions only (never the verdict): whatever passes them goes
# through the full reading, as before. tests/unit/test_method_scan_fast.py checks them against the
# unabridged scanner (bench/lib/methods_reference.py).

_MAYBE_KEY = re.compile(r"%|[Mm][Ee][Tt][Hh][Oo][Dd]")


def _may_be_key(text: str) -> bool:
    """False only when `query_key(text)` cannot be an override key: without a `%` its unquoting
    only turns `+` into spaces, so it needs "method" spelled out."""
    return _MAYBE_KEY.search(text) is not None


# An override key, once query_key has read it, is "method" after `_`, a space, `.`, `-` or `[` (or
# after "http": `_HttpMethod`), then maybe the same and "override", then the end of the name or what
# query_key drops (whitespace, a NUL, brackets): `_KEYISH`, in ASCII letters of any case (no other
# character casefolds into these words; checked by the tests). `_SPELLING` is every character such
# a match is made of, and so every character percent-escapes can spell it with (`%` and the hex
# digits too). Decoding only the escapes that yield one of them leaves every other escape (and so
# every `&`, `;` and `=` a field is split at) as it was, yet spells out every match the full
# decoding would: an escape is `%` and two hex digits, and a character that is neither never
# takes part in one.
_KEYISH_WORD = (rb"(?:[ ._\-\[+]|[Hh][Tt][Tt][Pp])[Mm][Ee][Tt][Hh][Oo][Dd]"
                 rb"(?:[ ._\-\[+][Oo][Vv][Ee][Rr][Rr][Ii][Dd][Ee])?")
_KEYISH_END = rb"\x09-\x0d\x1c-\x20\[\]\x00+\x80-\xff"  # what may follow: the name ends, or query_key drops it
_KEYISH = re.compile(_KEYISH_WORD + rb"(?![^" + _KEYISH_END + rb"&;=])")
# Tighter, where every character query_key strips from the front of a name (whitespace, then
# brackets) is ASCII or a byte >= 0x80 (UTF-8, the charsets of `_IDENTITY` but the double-byte ones,
# whose U+3000 has an ASCII second byte): the word at the start of a field, after `_` (or its
# spellings) or `x` and a separator, maybe "http" and another; `_http` before "method" too.
_KEY_SEP = rb"[ ._\-\[+]"
_KEY_AT_START = re.compile(
    rb"(?<![^&])[\x09-\x0d\x1c-\x20+\[\]\x80-\xff]*(?:" + _KEY_SEP + rb"(?:[Hh][Tt][Tt][Pp])?|[Xx]" + _KEY_SEP
    + rb"(?:[Hh][Tt][Tt][Pp]" + _KEY_SEP + rb")?)[Mm][Ee][Tt][Hh][Oo][Dd](?:" + _KEY_SEP
    + rb"[Oo][Vv][Ee][Rr][Rr][Ii][Dd][Ee])?(?![^" + _KEYISH_END + rb"&;=])")
_SPELLING = (b"%0123456789ABCDEFabcdef" + b"MmTtHhOoPpVvRrIiXx" + b" ._-[]+\x00" + bytes(range(0x09, 0x0e))
             + bytes(range(0x1c, 0x20)))
# Bytes that make some charset read more into a text than its bytes as ASCII (`_IDENTITY` below).
_TRIGGERS = b"+~\\\x1b\x0e\x0f"


def _escapes(chars: bytes) -> dict[bytes, bytes]:
    out = {}
    for c in chars:
        for form in ("%%%02x" % c, "%%%02X" % c):
            out[form.encode()] = bytes([c])
    return out


_ESCAPE_OF = _escapes(_SPELLING + _TRIGGERS)
# Every escape: an ASCII one not in _ESCAPE_OF is kept as it is; a non-ASCII one (`%C2%A0`, a piece
# of U+00A0 that query_key strips after decoding) becomes the byte 0x80, which the classes around
# the word accept as they accept raw non-ASCII bytes. It is no hex digit, `%`, `&`, `;` or `=`, as
# the decoded byte is not, so it neither makes nor breaks an escape or a field boundary.
_SPELLED = re.compile(rb"%[0-9A-Fa-f][0-9A-Fa-f]")
_HIGH = b"\x80"


def _spelled_escape(m: re.Match) -> bytes:
    escape = m[0]
    return _ESCAPE_OF.get(escape, escape) if escape[1] < 0x38 else _HIGH  # 0x38: "8"


def _spelled(data: bytes, rounds: int) -> bytes:
    """`data` with the escapes of `_SPELLING` and `_TRIGGERS` decoded (and every non-ASCII escape
    as 0x80), `rounds` times over."""
    for _ in range(rounds):
        if b"%" not in data:
            break
        decoded = _SPELLED.sub(_spelled_escape, data)
        if len(decoded) == len(data):
            break
        data = decoded
    return data


# Charsets (not ASCII-transparent, `_ascii_transparent`) whose text holds an ASCII character only
# where the bytes hold that same byte, unless one of these bytes is there: UTF-7 (`+` opens base64),
# HZ (`~{`, and `~` + newline vanishes), ISO-2022 (escape sequences, SO/SI), the escape codecs
# (backslashes), Shift_JIS-2004 and JIS X 0213 (only 0x5C and 0x7E read otherwise; a double-byte
# character is never ASCII). Every other such charset (EBCDIC, UTF-16/32, punycode) has no fast path.
_IDENTITY: dict[str, bytes] = {
    "utf-7": b"+", "hz": b"~", "unicode-escape": b"\\", "raw-unicode-escape": b"\\",
    "iso2022_jp": b"\x1b\x0e\x0f", "iso2022_jp_1": b"\x1b\x0e\x0f", "iso2022_jp_2": b"\x1b\x0e\x0f",
    "iso2022_jp_2004": b"\x1b\x0e\x0f", "iso2022_jp_3": b"\x1b\x0e\x0f", "iso2022_jp_ext": b"\x1b\x0e\x0f",
    "iso2022_kr": b"\x1b\x0e\x0f", "shift_jis_2004": b"", "shift_jisx0213": b"",
}


_DOUBLE_BYTE = ("shift_jis_2004", "shift_jisx0213")
if not all(_KEY_AT_START.search(k.encode()) and _KEYISH.search(k.encode()) for k in FIELD_KEYS | set(OVERRIDE_FIELDS)):
    raise RuntimeError("the body scan's fast paths must know every override field name")


class _NameFilter:
    """Which of many complete urlencoded fields could have an override name under every reading
    `_texts` gives a name (UTF-8 as sent, then each charset after percent-decoding), found with a
    few passes over all of them at once. `None` from `for_charsets` when some charset has no such
    test: then every field is read in full."""

    # The last answer: the readings of an ASCII body through UTF-7, HZ or ISO-2022 are its bytes
    # again, and each asks about the same fields (the question is pure, the answer is reused).
    _last: tuple[bytes, int, bytes, list[int]] = (b"", 0, b"", [])

    def __init__(self, rounds: int, triggers: bytes, loose: bool = False):
        self._rounds = rounds
        self._trigger_bytes = triggers + (b"L" if loose else b"")  # (the cache key)
        self._words = _KEYISH if loose else _KEY_AT_START
        self._triggers = re.compile(b"[" + re.escape(triggers) + b"]") if triggers else None

    @classmethod
    def for_charsets(cls, charsets: Sequence[str]) -> "_NameFilter | None":
        if any(c not in _IDENTITY for c in charsets):
            return None
        # A charset's text is percent-decoded again by query_key: twice the rounds.
        return cls(2 * DECODE_ROUNDS if charsets else DECODE_ROUNDS, b"".join(_IDENTITY[c] for c in charsets),
                   loose=any(c in _DOUBLE_BYTE for c in charsets))

    def candidates(self, fields: bytes) -> list[int]:
        """Indexes (in `fields.split(b"&")`, `fields` with `;` as `&`) of the fields that may be one."""
        last = _NameFilter._last
        if last[1] == self._rounds and last[2] == self._trigger_bytes and last[0] == fields:
            return last[3]
        out = self._candidates(fields)
        _NameFilter._last = (fields, self._rounds, self._trigger_bytes, out)
        return out

    # A name past NAME_CAP (raw bytes) and its `=`: kept when it may hold an override (`_LONG_SUSPECT`),
    # so that `_Form._step` refuses it. The decoded text lines up with no raw offset: counted apart.
    _LONG = re.compile(rb"(?<![^&])[^&=]{%d,}=" % (NAME_CAP + 1))

    def _candidates(self, fields: bytes) -> list[int]:
        text = _spelled(fields, self._rounds)
        hits = [m.start() for m in self._words.finditer(text)]
        long, at, index = [], 0, 0
        for m in self._LONG.finditer(fields):
            if _long_suspect(m[0]):
                index += fields.count(b"&", at, m.start())
                at = m.start()
                long.append(index)
        if self._triggers is not None:
            hits += [m.start() for m in self._triggers.finditer(text)]
            hits.sort()
        out: list[int] = []
        index, counted = 0, 0
        for hit in hits:
            index += text.count(b"&", counted, hit)
            counted = hit
            start = text.rfind(b"&", 0, hit) + 1
            if text.find(b"=", start, hit) >= 0:
                continue  # in the value: values are judged only under an override name
            if not out or out[-1] != index:
                out.append(index)
        return sorted(set(out).union(long)) if long else out


def _judged(source: str, names: Sequence[str], raw: bytes, charsets: Sequence[str], percent: bool) -> list[Override]:
    """The overrides a field under override names carries: its value read every way its name was."""
    if not names:
        return []
    name = names[0][:64]
    if len(raw) > VALUE_CAP:
        return [Override(source, name, None)]
    found: list[Override] = []
    for text in _texts(raw, charsets, percent, value=True):
        found += [Override(source, name, m) for m in _elements(text)]
    return list(dict.fromkeys(found))


def _first(data: bytes, a: bytes, b: bytes) -> int:
    """The index of the first `a` or `b` in `data`, or -1."""
    i, j = data.find(a), data.find(b)
    return j if i < 0 else i if j < 0 else min(i, j)


_MEMO_CAP = 256  # distinct names (and values under override names) a form parser remembers


class _Form:
    """application/x-www-form-urlencoded (and a body without Content-Type, which Rack parses as a
    form): `name=value` fields split at `&` (and `;`, looser than any server).

    The complete fields inside a chunk are not walked one by one: `_NameFilter` picks, in a few
    passes over all of them, those whose name could be an override name, and only those are read
    (`_step`, the same reading as for the field a chunk starts or ends in). A field it leaves out
    would have been read as no override and skipped, so the findings are the same."""

    _SEMI = bytes.maketrans(b";", b"&")

    def __init__(self, charsets: Sequence[str] = ()) -> None:
        self._charsets = tuple(charsets)
        self._state = "name"  # name | value | skip
        self._name = bytearray()
        self._value = bytearray()
        self._names: list[str] = []
        self._filter = _NameFilter.for_charsets(self._charsets)
        self._fields = 0  # read one by one, without a fast path
        self._full = 0  # distinct fields the fast path could not rule out, read in full
        self.problem: str | None = None
        # A field repeated a million times (`_method=GET&...`) is read once: both are pure.
        self._names_of: dict[bytes, list[str]] = {}
        self._judged_of: dict[tuple, list[Override]] = {}
        self._field_of: dict[bytes, list[Override]] = {}
        # The over-long name in progress: may it hold an override (`_LONG_SUSPECT`), and its last
        # bytes (a "method" split across chunks). Every distinct refusal is reported once.
        self._long_suspect = False
        self._long_tail = b""
        self._long_head = bytearray()
        self._long_length = 0
        self._long_found: set[Override] = set()
        self._long_triggers = b"".join(_IDENTITY[c] for c in self._charsets) if self._filter is not None else b""

    def _suspect(self, piece: bytes) -> bool:
        if self._filter is None:
            return True  # a charset read only field by field (EBCDIC, UTF-16/32): any bytes may spell it
        return _long_suspect(piece) or any(t in piece for t in self._long_triggers)

    def _long_verdict(self, length: int) -> bool:
        """May the over-long name now ended (its first LONG_HEAD bytes in `_long_head`) be an override?"""
        if not self._long_suspect:
            return False  # no "method", `%` or trigger anywhere
        if self._filter is None or self._long_triggers or self._filter._words is not _KEY_AT_START:
            return True
        head = bytes(self._long_head)
        if length > len(head) and _PADDING.match(head).end() > len(head) - NAME_CAP:
            return True  # padding too long to see past
        return _KEY_AT_START.match(_spelled(head, self._filter._rounds)) is not None

    def _long_name(self, piece: bytes) -> None:
        """`piece` of a name already past NAME_CAP (the kept bytes were looked at before)."""
        if not self._long_suspect and piece:
            # the piece, and where it meets the last one's tail (a "method" split across chunks)
            self._long_suspect = self._suspect(piece) or self._suspect(self._long_tail + piece[:5])
            self._long_tail = (self._long_tail + piece)[-5:] if len(piece) < 5 else piece[-5:]

    def feed(self, data: bytes, found: list[Override]) -> None:
        if self.problem is not None:
            return
        if self._filter is None:
            self._fields += data.count(b"&") + data.count(b";")
            if self._fields > SLOW_FIELDS_CAP:
                self.problem = _TOO_MANY
                return
            self._step(data, found)
            return
        first = _first(data, b"&", b";")
        if first < 0:
            self._step(data, found)
            return
        last = max(data.rfind(b"&"), data.rfind(b";"))
        self._step(data[: first + 1], found)  # the field in progress ends here
        if last > first:
            fields = data[first + 1: last].translate(self._SEMI)
            pieces = fields.split(b"&")
            for index in self._filter.candidates(fields):
                self._field(pieces[index], found)
                if self.problem is not None:
                    return
        self._step(data[last + 1:], found)

    def _step(self, data: bytes, found: list[Override]) -> None:
        # `;` separates as `&` does and is kept in no name or value: one byte to look for, with
        # bytes.find (memchr) rather than a regex class, which reads ~20x slower. Each find's result
        # is kept until passed, so that a chunk of many fields is still read in one pass.
        if b";" in data:
            data = data.translate(self._SEMI)
        pos, end = 0, len(data)
        amp = equals = -2  # the next `&` / `=` at or after pos (-1: none left; -2: not looked for)
        while pos < end:
            if amp != -1 and amp < pos:
                amp = data.find(b"&", pos)
            if self._state == "name":
                if equals != -1 and equals < pos:
                    equals = data.find(b"=", pos, amp if amp >= 0 else end)
                    if equals < 0 and amp >= 0:
                        equals = -2  # none before this `&`: look again past it
                stop = min(i for i in (amp, equals, end) if i >= 0)
                more = stop < end
                if len(self._name) <= NAME_CAP:
                    room = NAME_CAP + 1 - len(self._name)
                    self._name += data[pos:min(stop, pos + room)]
                    if len(self._name) > NAME_CAP:
                        self._long_name(bytes(self._name))
                        self._long_name(data[pos + room:stop])
                        self._long_head += self._name
                        self._long_head += data[pos + room:stop][: LONG_HEAD - len(self._long_head)]
                        self._long_length = len(self._name) + stop - pos - room
                else:
                    self._long_name(data[pos:stop])
                    if len(self._long_head) < LONG_HEAD:
                        self._long_head += data[pos:stop][: LONG_HEAD - len(self._long_head)]
                    self._long_length += stop - pos
                if not more:
                    return
                pos = stop + 1
                if data[stop] == ord("=") and len(self._name) <= NAME_CAP:
                    self._names = self._override_names(bytes(self._name))
                    self._state = "value" if self._names else "skip"
                elif data[stop] == ord("="):
                    self._state = "skip"
                    if self._long_verdict(self._long_length):
                        refused = Override("form", bytes(self._name[:64]).decode("utf-8", "replace"), None)
                        if refused not in self._long_found and len(self._long_found) < MAX_ELEMENTS:
                            self._long_found.add(refused)
                            found.append(refused)
                self._name.clear()
                self._long_suspect, self._long_tail, self._long_length = False, b"", 0
                self._long_head.clear()
            else:
                stop = amp if amp >= 0 else end
                more = amp >= 0
                if self._state == "value" and len(self._value) <= VALUE_CAP:
                    self._value += data[pos:stop][: VALUE_CAP + 1 - len(self._value)]
                if not more:
                    return
                pos = stop + 1
                self._close(found)

    def _field(self, field: bytes, found: list[Override]) -> None:
        """One whole field (no `&` or `;`), read from the `name` state back to it: what it yields
        depends on its bytes only."""
        if b"=" not in field:
            return  # a name alone is no field: `_step` drops it
        judged = self._field_of.get(field)
        if judged is None:
            self._full += 1
            if self._full > SLOW_FIELDS_CAP:
                self.problem = _TOO_MANY
                return
            if len(field) > NAME_CAP + VALUE_CAP + 2:
                self._step(field + b"&", found)
                return
            if len(self._field_of) >= _MEMO_CAP:
                self._field_of.clear()
            judged = self._field_of[field] = []
            self._step(field + b"&", judged)
        found += judged

    def _override_names(self, name: bytes) -> list[str]:
        names = self._names_of.get(name)
        if names is None:
            if len(self._names_of) >= _MEMO_CAP:
                self._names_of.clear()
            names = self._names_of[name] = _override_names(name, self._charsets)
        return names

    def _close(self, found: list[Override]) -> None:
        if self._state == "value":
            key = (tuple(self._names), bytes(self._value))
            judged = self._judged_of.get(key)
            if judged is None:
                if len(self._judged_of) >= _MEMO_CAP:
                    self._judged_of.clear()
                judged = self._judged_of[key] = _judged("form", self._names, key[1], self._charsets, percent=True)
            found += judged
        self._state = "name"
        self._value.clear()
        self._name.clear()
        self._long_suspect, self._long_tail, self._long_length = False, b"", 0
        self._long_head.clear()

    def finish(self, found: list[Override]) -> None:
        if self.problem is None:
            self._close(found)

    @property
    def pending(self) -> bool:
        return self._state == "value"


_TOO_MANY_STEPS = ("its JSON has too many keys or nested values the gateway must read one by one (escaped or "
                   "named like an override, or nested more than 8 levels)")
_HEADERS_TOO_LONG = "a multipart part's header block is too long to tell whether it is a method override field"
_TOO_MANY = (f"it has more than {SLOW_FIELDS_CAP} fields the gateway must read one by one (named like an "
             f"override, or in a charset it can only read so: EBCDIC, UTF-16/32)")


class _Multipart:
    """multipart/form-data (and the other multipart types Rack parses): every part whose
    Content-Disposition names an override field, read at least as liberally as PHP and Rack:

    - delimiters are found anywhere (not only at the start of a line), and a close-delimiter does
      not end the body (PHP goes on to the next delimiter);
    - a part's header block ends at the first empty line, `\\r\\n` or bare `\\n` ones in any mix;
    - its header lines are read folded as PHP does (a line that starts with whitespace or has no
      colon continues the previous one, joined without a space), as RFC 5322 does (joined with a
      space) and line by line; `content-disposition` is looked for anywhere in them (Rack's
      pattern is not anchored);
    - `name` is taken double-quoted (escapes undone or not), single-quoted (PHP), unquoted, or
      RFC 2231-encoded, and also from the header block decoded in each declared charset.

    With `boundary=None` the boundary is taken from the body's first line (`--X`): a Content-Type
    whose boundary a server reads differently from every reading above still has its parts read."""

    HEADER_CAP = 64 * 1024
    SNIFF_CAP = 1024
    _NAME = re.compile(r"""(?:^|[;,\s])name\s*(\*?)\d*\*?\s*=\s*("(?:[^"\\]|\\.)*"?|"[^"]*"?|'[^']*'?|[^;,\s]*)""",
                       re.IGNORECASE)
    _BLANK = re.compile(rb"(?:^|\n)\r?\n")

    def __init__(self, boundary: bytes | None, charsets: Sequence[str] = (), known: Sequence[bytes] = ()) -> None:
        self._delimiter = b"--" + boundary if boundary is not None else None
        self._known = tuple(known)
        self._charsets = tuple(charsets)
        self._fast = _NameFilter.for_charsets(self._charsets) is not None
        self._triggers = b"".join(_IDENTITY[c] for c in self._charsets) if self._fast else b""
        self._parts = self._parts_pattern()
        # `*`: RFC 2231 continuations spell a name in pieces (`name*0="_me"; name*1="thod"`).
        self._plain_block = re.compile(b"(?:[^%*\\\\Mm" + re.escape(self._triggers) + b"]|[Mm](?![Ee][Tt][Hh][Oo][Dd]))*+")
        self._buf = bytearray()
        self._state = "preamble"  # sniff | preamble | after_delimiter | headers | value | skip | done
        if boundary is None:
            self._state = "sniff"
        self._names: list[str] = []
        self._value = bytearray()
        self.problem: str | None = None  # why the caller must refuse the body (part headers beyond HEADER_CAP...)
        self._slow_parts = 0

    def feed(self, data: bytes, found: list[Override]) -> None:
        if self._state == "done":
            return
        self._buf += data
        while self._step(found):
            pass

    def _sniff(self) -> bool:
        buf = self._buf
        newline = buf.find(b"\n")
        if newline < 0:
            if len(buf) > self.SNIFF_CAP:
                self._state = "done"
                buf.clear()
            return False
        line = bytes(buf[:newline]).rstrip(b"\r \t")
        if line.endswith(b"--") and len(line) > 4:
            line = line[:-2]
        boundary = line[2:]
        if not line.startswith(b"--") or not boundary or boundary in self._known:
            self._state = "done"  # not multipart-looking, or a declared boundary's parser reads it
            buf.clear()
            return False
        self._delimiter, self._state = b"--" + boundary, "preamble"
        self._parts = self._parts_pattern()
        return True

    def _step(self, found: list[Override]) -> bool:
        """Consume what can be consumed from the buffer; False when more input is needed."""
        if self._state == "sniff":
            return self._sniff()
        buf, delimiter = self._buf, self._delimiter
        if self._state in ("preamble", "skip") and self._parts is not None and (m := self._parts.match(buf)):
            del buf[: m.end()]  # whole parts that name no override field: read as `skip` would
            self._state = "skip"
            return True
        if self._state in ("preamble", "skip", "value"):
            at = buf.find(delimiter)
            keep = len(delimiter) - 1
            if at < 0:
                if self._state == "value" and len(self._value) <= VALUE_CAP:
                    take = max(len(buf) - keep, 0)
                    self._value += buf[:take][: VALUE_CAP + 1 - len(self._value)]
                del buf[: max(len(buf) - keep, 0)]
                return False
            if self._state == "value":
                if len(self._value) <= VALUE_CAP:
                    self._value += buf[:at][: VALUE_CAP + 1 - len(self._value)]
                self._close_value(found)
            del buf[: at + len(delimiter)]
            self._state = "after_delimiter"
            if self._parts is None:
                self._slow_parts += 1
                if self._slow_parts > SLOW_FIELDS_CAP:
                    self.problem, self._state = _TOO_MANY, "done"
                    buf.clear()
                    return False
            return True
        if self._state == "after_delimiter":
            if len(buf) < 2:
                return False
            if buf[:2] == b"--":  # a close-delimiter: PHP reads parts after it all the same
                del buf[:2]
                self._state = "skip"
                return True
            newline = buf.find(b"\n")
            if newline < 0:
                if len(buf) > self.HEADER_CAP:
                    self.problem, self._state = _HEADERS_TOO_LONG, "done"
                return False
            del buf[: newline + 1]
            self._state = "headers"
            return True
        if self._state == "headers":
            m = self._BLANK.search(buf)
            if m is None:
                if len(buf) > self.HEADER_CAP:
                    self.problem, self._state = _HEADERS_TOO_LONG, "done"
                return False
            self._names = self._part_names(bytes(buf[: m.start()]))
            del buf[: m.end()]
            self._state = "value" if self._names else "skip"
            return True
        return False

    def _parts_pattern(self) -> re.Pattern | None:
        """Whole parts as `_step` reads them from `preamble` or `skip` (up to the next delimiter, a
        close-delimiter's `--` or the rest of the delimiter's line, a header block up to its first
        empty line) whose header block cannot name an override field: no `%`, backslash or charset
        trigger (`_IDENTITY`), and no "method" even with its line breaks dropped (PHP joins a
        folded line without them). One match skips any number of them."""
        if not self._fast or self._delimiter is None:
            return None
        method = rb"[\r\n]*+".join(b"[%s%s]" % (c.upper(), c) for c in (bytes([b]) for b in b"method"))
        plain = b"[^\n%*\\\\Mm" + re.escape(self._triggers) + b"]"
        block = b"(?:" + plain + b"|[Mm](?!" + method[len(b"[Mm]"):] + b")|\n(?!\r?\n))*+\n\r?\n"
        # Atomic: the first delimiter is the one `_step` stops at; a part that does not match must
        # end the run there, never be skipped over to a later delimiter.
        first = re.escape(self._delimiter[:1])  # alternatives that cannot both match: no retrying
        return re.compile(b"(?>(?>(?:[^" + first + b"]++|" + first + b")*?" + re.escape(self._delimiter)
                          + b")(?:--|[^\n]*+\n(?:\r?\n|" + block + b")))+", re.DOTALL)

    def _part_names(self, block: bytes) -> list[str]:
        if self._parts is not None:
            if self._plain_block.fullmatch(block.replace(b"\r", b"").replace(b"\n", b"")):
                return []  # what `_parts_pattern` passes over: no "method", `%`, backslash or trigger
            self._slow_parts += 1
            if self._slow_parts > SLOW_FIELDS_CAP:
                self.problem, self._state = _TOO_MANY, "done"
                self._buf.clear()
                return []
        names: list[str] = []
        for text in _texts(block, self._charsets, percent=False):
            names += [n for n in _disposition_names(text, self._NAME) if query_key(n) in FIELD_KEYS]
        return list(dict.fromkeys(names))

    def _close_value(self, found: list[Override]) -> None:
        found += _judged("form", self._names, bytes(self._value), self._charsets, percent=False)
        self._value.clear()

    @property
    def pending(self) -> bool:
        return self._state == "value"

    def finish(self, found: list[Override]) -> None:
        if self._state == "value":  # no closing delimiter: a lenient parser still has the field
            if len(self._value) <= VALUE_CAP:
                self._value += self._buf[: VALUE_CAP + 1 - len(self._value)]
            self._close_value(found)
        self._state = "done"


def _header_lines(headers: str) -> list[str]:
    """A part's header lines read three ways: as PHP folds them, as RFC 5322 unfolds them, and
    one physical line at a time."""
    physical = [line.removesuffix("\r") for line in headers.split("\n")]
    php: list[str] = []
    rfc: list[str] = []
    for line in physical:
        starts_header = bool(line) and not line[0].isspace() and ":" in line
        if starts_header or not php:
            php.append(line)
        else:
            php[-1] += line  # PHP appends a continuation (or colon-less) line as it is
        if starts_header or not rfc:
            rfc.append(line)
        else:
            rfc[-1] += " " + line.strip()
    return list(dict.fromkeys(php + rfc + physical))


def _disposition_names(headers: str, pattern: re.Pattern) -> list[str]:
    names = []
    for line in _header_lines(headers):
        lower = line.lower()
        at = lower.find("content-disposition")
        if at < 0:
            continue
        value = line[at + len("content-disposition"):]
        value = value.split(":", 1)[1] if ":" in value else value
        for m in pattern.finditer(value):
            raw = m.group(2).strip()
            variants = [raw]
            if raw[:1] and raw[0] in "\"'":  # ("" is in every string: `name=` alone crashed the scan)
                quote = raw[0]
                inner = raw[1:].removesuffix(quote) if len(raw) > 1 else ""
                variants = [inner, re.sub(r"\\(.)", r"\1", inner), inner.split(quote, 1)[0]]
            else:  # Rack's token stops at any tspecial
                variants.append(re.split(r"[()<>@,;:\\\"/\[\]?={}\s]", raw, maxsplit=1)[0])
            if m.group(1):  # name*=utf-8''%5Fmethod (RFC 2231 / 5987)
                variants = [v.split("'", 2)[-1] for v in variants]
            names += variants
        names += _continued_names(value)
    return list(dict.fromkeys(names))


# A plain piece is a quoted-string (or PHP's single quotes, or a token); an extended one (`name*1*=`)
# is a token, its first one `charset'language'` first.
_CONTINUATION = re.compile(r"""(?:^|[;,\s])name\s*\*\s*(\d+)\s*(?:(\*)\s*=\s*("[^"]*"?|[^;,\s]*)|"""
                           r"""=\s*("(?:[^"\\]|\\.)*"?|'[^']*'?|[^;,\s]*))""", re.IGNORECASE)


def _continued_names(value: str) -> list[str]:
    """RFC 2231 continuations (`name*0="_me"; name*1="thod"`, `name*0*=utf-8''%5Fme; name*1*=thod`),
    joined as Werkzeug joins them: in the order sent and in the order of their numbers, the
    extended (`*`) pieces percent-decoded in the first piece's charset (and UTF-8, Latin-1)."""
    pieces = []
    for m in _CONTINUATION.finditer(value):
        raw = (m.group(3) if m.group(2) else m.group(4)).strip()
        if m.group(2):
            raw = raw.strip('"')
        elif raw[:1] in ("\"", "'"):
            raw = raw[1:].removesuffix(raw[0]) if len(raw) > 1 else ""
            raw = re.sub(r"\\(.)", r"\1", raw)
        pieces.append((int(m.group(1)[:6]), bool(m.group(2)), raw))
    if not pieces:
        return []
    charset = "utf-8"
    first = min(pieces, key=lambda p: p[0])
    if first[1] and first[2].count("'") >= 2:
        charset = first[2].split("'", 1)[0] or "utf-8"
    names = []
    for order in (pieces, sorted(pieces, key=lambda p: p[0])):
        for codec in dict.fromkeys((_codec(charset) or "utf-8", "utf-8", "latin-1")):
            joined = b""
            for index, extended, raw in order:
                if extended:
                    if raw.count("'") >= 2 and index == first[0]:
                        raw = raw.split("'", 2)[2]
                    joined += unquote_to_bytes(raw)
                else:
                    joined += raw.encode("utf-8", "surrogateescape")
            try:
                names.append(joined.decode(codec, "replace"))
            except Exception:
                names.append(joined.decode("utf-8", "replace"))
    return names


class _Json:
    """A JSON body: the keys of the top-level object (where Laravel and Slim read `_method`). The
    scan jumps from one structural character to the next, so long strings (a model prompt) cost
    one regex search each."""

    _STRUCT = re.compile(rb'["{}\[\],:]')
    _IN_STRING = re.compile(rb'["\\]')
    _SPACE = b" \t\r\n"
    # Fast paths, each over bytes the step-by-step scan would read to the same end: inside a nested
    # value, everything but brackets and whole strings (no key is read there); at the top level,
    # whole `"key": value,` members whose key cannot be an override key (no escape, `%` or NUL, so
    # its text is its bytes, and no `_KEYISH` word in it) and whose value is scalars and strings.
    # Possessive: a string that does not end in this chunk is given up at once, not retried.
    _STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
    # Balanced brackets (of any kind: the depth count does not match kinds either), strings in them
    # skipped whole, to _NESTED levels: one regex step for `[]`, `{"a":1}`, `[[0.1,0.2],[0.3]]`.
    _STR = rb'"(?:[^"\\]++|\\.)*+"'
    _GROUP = rb'[\[{](?:[^"{}\[\]]++|' + _STR + rb')*+[\]}]'
    for _ in range(7):
        _GROUP = rb'[\[{](?:[^"{}\[\]]++|' + _STR + rb'|' + _GROUP + rb')*+[\]}]'
    _DEEP = re.compile(rb'(?:[^"{}\[\]]++|' + _STR + rb'|' + _GROUP + rb')*+', re.DOTALL)
    # A key without `%`, NUL or an escape of an ASCII character (`\u005f`): its text is its bytes but
    # for escapes of control characters, quotes, slashes and non-ASCII characters, none of which is a
    # letter of the words. query_key strips what such an escape decodes to (`"_method\t"`), so a
    # backslash after the word counts as its end.
    _KEY_BODY = rb'(?:[^"\\%\x00]++|\\[^u%\x00]|\\u(?!00[0-7])[0-9A-Fa-f]{4})*+'
    _MEMBERS = re.compile(rb'(?:[ \t\r\n]*+"(?!(?:[^"\\]|\\.)*?' + _KEYISH_WORD + rb'(?![^' + _KEYISH_END + rb'"\\]))'
                          + _KEY_BODY + rb'"[ \t\r\n]*+:(?:[^"{}\[\],]++|' + _STR + rb'|' + _GROUP + rb')*+,)+',
                          re.DOTALL)

    # Steps the scan takes one by one (each a few regex calls and, for a key, json.loads and
    # query_key): past STEPS_FREE plus one per STEP_BYTES bytes read (and 4 per chunk), the body is refused as
    # uncheckable. What the fast paths leave to them: keys with `%`, a NUL, an escaped ASCII
    # character or a word of an override key, values nested more than 8 levels, the pieces of a
    # member cut by a chunk boundary. Real bodies need a handful per chunk; a body of a million
    # `"\u0061":1` members or 10,000-level nesting would hold the event loop for seconds.
    STEPS_FREE = 20_000
    STEP_BYTES = 8  # a translations file of keys like "payment method 123" needs ~6 steps a key

    def __init__(self) -> None:
        self._started = False
        self._dead = False  # not an object at the top, or past its end: no keys to find
        self._steps = 0
        self._budget = self.STEPS_FREE
        self.problem: str | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False  # a backslash ended the last chunk
        self._capture: bytearray | None = None
        self._capturing = ""  # key | value
        self._expect_key = False
        self._value_for: str | None = None  # an override key whose value comes next

    def feed(self, data: bytes, found: list[Override]) -> None:
        pos, end = 0, len(data)
        self._budget += end // self.STEP_BYTES + 4  # a chunk boundary costs a few steps (a cut member)
        while pos < end and not self._dead:
            self._steps += 1
            if self._steps > self._budget:
                self.problem, self._dead = _TOO_MANY_STEPS, True
                return
            if not self._started:
                while pos < end and data[pos] in self._SPACE:
                    pos += 1
                if pos == end:
                    return
                if data[pos] != ord("{"):
                    self._dead = True
                    return
                self._started = True
            if self._in_string:
                if self._escape:
                    self._keep(data[pos:pos + 1])
                    self._escape = False
                    pos += 1
                    continue
                if self._capture is None or len(self._capture) > NAME_CAP:  # nothing kept: skip escapes at once
                    pos = self._STRING_BODY.match(data, pos).end()
                m = self._IN_STRING.search(data, pos)
                stop = m.start() if m else end
                self._keep(data[pos:stop])
                if m is None:
                    return
                if data[stop] == ord("\\"):
                    self._keep(b"\\")
                    self._escape = True
                    pos = stop + 1
                    continue
                pos = stop + 1
                self._in_string = False
                self._end_string(found)
                continue
            if self._depth >= 2:
                pos = self._DEEP.match(data, pos).end()
            elif self._depth == 1 and self._expect_key and (fast := self._MEMBERS.match(data, pos)):
                pos = fast.end()
                self._value_for = None
                continue
            m = self._STRUCT.search(data, pos)
            if m is None:
                return
            pos = m.end()
            c = data[m.start()]
            if c == ord('"'):
                self._in_string = True
                if self._depth == 1 and self._expect_key:
                    self._capture, self._capturing = bytearray(), "key"
                elif self._depth == 1 and self._value_for is not None:
                    self._capture, self._capturing = bytearray(), "value"
            elif c in b"{[":
                self._depth += 1
                if self._depth == 1:
                    self._expect_key = True
                elif self._depth == 2:
                    self._value_for = None  # an object or array is not a method name
            elif c in b"}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._dead = True
            elif self._depth == 1 and c == ord(","):
                self._expect_key, self._value_for = True, None
            elif self._depth == 1 and c == ord(":"):
                self._expect_key = False

    def _keep(self, piece: bytes) -> None:
        if self._capture is not None and len(self._capture) <= NAME_CAP:
            self._capture += piece[: NAME_CAP + 1 - len(self._capture)]

    def _end_string(self, found: list[Override]) -> None:
        raw, kind = self._capture, self._capturing
        self._capture, self._capturing = None, ""
        if raw is None:
            return
        text = None
        if len(raw) <= NAME_CAP:
            try:
                text = json.loads(b'"' + bytes(raw) + b'"')
            except ValueError:
                text = None
        if kind == "key":
            self._expect_key = False
            self._value_for = text if text is not None and query_key(text) in FIELD_KEYS else None
        elif self._value_for is not None:
            key, self._value_for = self._value_for, None
            if text is None:
                found.append(Override("json", key[:64], None))
            else:
                found += [Override("json", key[:64], m) for m in _elements(text)]

    def finish(self, found: list[Override]) -> None:
        self._dead = True

    pending = False  # a JSON string must be closed to count: the end of the body adds nothing


def body_parsers(content_types: Sequence[str]) -> list:
    """The parsers for one reading of a body with these Content-Type values."""
    return _parsers(plan_body(content_types))


def _parsers(plan: BodyPlan) -> list:
    charsets = plan.field_charsets
    parsers: list = []
    if plan.form:
        parsers.append(_Form(charsets))
    if plan.multipart:
        parsers += [_Multipart(b, charsets) for b in plan.boundaries]
        parsers.append(_Multipart(None, charsets, plan.boundaries))
    if plan.json:
        parsers.append(_Json())
    return parsers


_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")
_WIDE_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")  # UTF-16 LE/BE, UTF-32 LE (ff fe 00 00) and BE


class _Reading:
    """One reading of a byte stream as text: the bytes as they are (every ASCII-transparent
    charset), or decoded from a charset and re-encoded as UTF-8 for the parsers. A leading BOM is
    dropped (body-parser and Python's json do)."""

    def __init__(self, codec: str | None, parsers: list):
        self.codec = codec
        self.parsers = parsers
        self._decoder = codecs.getincrementaldecoder(codec)("replace") if codec else None
        self._started = False
        self.failed = False

    def feed(self, data: bytes, found: list[Override], final: bool = False) -> None:
        if self.failed:
            return
        if self._decoder is not None:
            try:
                data = self._decoder.decode(data, final).encode("utf-8", "replace")
            except Exception:
                self.failed = True
                return
        if not self._started and data:
            self._started = True
            if data.startswith(b"\xef\xbb\xbf"):
                data = data[3:]
        for parser in self.parsers:
            parser.feed(data, found)

    def finish(self, found: list[Override]) -> None:
        if self._decoder is not None:
            self.feed(b"", found, final=True)
        for parser in self.parsers:
            parser.finish(found)

    @property
    def pending(self) -> bool:
        return any(p.pending for p in self.parsers)

    @property
    def problem(self) -> str | None:
        return next((p.problem for p in self.parsers if getattr(p, "problem", None)), None)


class _Stream:
    """One byte stream of the body (as sent, or decoded from its Content-Encoding), read every
    plausible way: as bytes, in each declared charset that is not ASCII-transparent, and as
    UTF-16 and UTF-32 of both byte orders by every parser when a wide charset is declared or the
    body starts with a UTF-16/32 byte order mark (ASP.NET's FormReader reads a form with
    `detectEncodingFromByteOrderMarks`), and by JSON parsers only when it has a NUL in its first
    four bytes (RFC 4627, Python's json; no form or multipart parser guesses from a NUL). A form
    read as UTF-16 because of a NUL refused binary bodies: every gzip stream starts with one, and
    its bytes read as UTF-16 are one endless field name (15 of 40 gzip-encoded 1 MiB forms)."""

    HEAD = 4

    def __init__(self, plan: BodyPlan):
        self.plan = plan
        self._head: bytearray | None = bytearray()
        self.readings: list[_Reading] = []

    def _start(self) -> None:
        head = bytes(self._head or b"")[: self.HEAD]
        self._head = None
        codecs_: list[str | None] = [None, *self.plan.charsets]
        self.readings = [_Reading(c, _parsers(self.plan)) for c in codecs_]
        if self.plan.wide or head.startswith(_WIDE_BOMS):
            self.readings += [_Reading(c, _parsers(self.plan)) for c in _WIDE]
        elif self.plan.json and b"\0" in head:
            self.readings += [_Reading(c, [_Json()]) for c in _WIDE]

    def feed(self, data: bytes, found: list[Override]) -> None:
        if self._head is not None:
            self._head += data
            if len(self._head) < self.HEAD:
                return
            data = bytes(self._head)
            self._start()
        for reading in self.readings:
            reading.feed(data, found)

    def finish(self, found: list[Override]) -> None:
        if self._head is not None:
            data = bytes(self._head)
            self._start()
            for reading in self.readings:
                reading.feed(data, found)
        for reading in self.readings:
            reading.finish(found)

    @property
    def pending(self) -> bool:
        return self._head is not None or any(r.pending for r in self.readings)

    @property
    def problem(self) -> str | None:
        for reading in self.readings:
            if (why := reading.problem) is not None:
                return why
        failed = [r.codec for r in self.readings if r.failed]
        return f"it does not decode as its charset {failed[0]}" if failed else None


_END = object()  # a decode's end (BodyScanner._decode)


# Decoded bytes scanned per step: the scan of a piece runs on the event loop (its decoder call on a
# pool thread), and 256 KiB of tiny form fields took ~19 ms to scan, as long as four reads of a
# plain body (a fresh-eyes review); brotli hands out up to twice what is asked.
SCAN_PIECE = 64 * 1024


class BodyScanner:
    """Finds method overrides in a request body, fed chunk by chunk as it arrives. The body is read
    as sent and, when it has a Content-Encoding the gateway can decode, decoded too (frameworks
    that ignore the coding read the first, those that decode it the second); each stream is read
    every way `_Stream` and `plan_body` say. Memory stays bounded: a parser keeps at most one field
    name or value (NAME_CAP, VALUE_CAP; the first LONG_HEAD bytes of an over-long form name), one part's header block (HEADER_CAP) and one delimiter's
    worth of bytes, and there are at most a few dozen parsers (READINGS_CAP, CODINGS_CAP)."""

    def __init__(self, plan: BodyPlan, decoders: Sequence = (), problem: str | None = None):
        self.plan = plan
        self.decoders = list(decoders)  # outermost coding first (applied last by the sender)
        self._raw = _Stream(plan)
        self._decoded = _Stream(plan) if self.decoders else None
        self._armed = problem or plan.problem  # reported once the body turns out not to be empty
        self._problem: str | None = None
        self._read = 0

    @classmethod
    def for_headers(cls, headers: Iterable[tuple[str, str]], decoder_for: Callable[[str], object] | None = None
                    ) -> "BodyScanner | None":
        """A scanner for a request with these headers, or None when no framework reads fields
        from such a body (a Content-Type nobody parses into fields)."""
        types, encodings = [], []
        for name, value in headers:
            lower = name.strip().lower()
            if lower == "content-type":
                types.append(value)
            elif lower == "content-encoding":
                encodings += [c.strip().lower() for c in value.split(",") if c.strip()]
        plan = plan_body(types)
        if not plan.parses:
            return None
        encodings = [c for c in encodings if c != "identity"]
        decoders, problem = [], None
        if len(encodings) > CODINGS_CAP:
            problem = "it has more Content-Encodings than the gateway decodes"
        elif encodings and decoder_for is not None:
            # Decode from the last coding applied; stop at one the gateway does not know (then no
            # server decodes the body either, and the bytes as sent are what some server reads).
            for coding in reversed(encodings):
                decoder = decoder_for(coding)
                if decoder is None:
                    decoders = []
                    break
                decoders.append(decoder)
        return cls(plan, decoders, problem)

    def close(self) -> None:
        """The scan is over (refused, or the body ended): its decoders' windows go now."""
        for decoder in self.decoders:
            if hasattr(decoder, "close"):
                decoder.close()

    def feed(self, data: bytes) -> list[Override]:
        return run_steps(self.feed_steps(data))

    def finish(self) -> list[Override]:
        return run_steps(self.finish_steps())

    def feed_steps(self, data: bytes) -> Generator[Callable[[], object], object, list[Override]]:
        """`feed` in steps, sans I/O: each decoder call is yielded as a callable for the caller to
        run where it likes (one brotli call fills the whole window the sender chose, up to 16 MiB,
        ~50 ms: addons/decode_pool.py runs it on a thread) and send back its result, or throw its
        exception; what it sent is scanned on the caller's thread. Returns what `feed` returns."""
        found: list[Override] = []
        if self._problem is not None or not data:
            return found
        self._read += len(data)
        self._problem = self._armed
        self._raw.feed(data, found)
        if self._decoded is not None:
            yield from self._decode(lambda: self._through(data), found)
        return found

    def finish_steps(self) -> Generator[Callable[[], object], object, list[Override]]:
        """`finish` in steps, like `feed_steps`."""
        found: list[Override] = []
        if self._problem is not None:
            return found
        self._raw.finish(found)
        if self._decoded is not None:
            if self._read:
                yield from self._decode(self._flushed, found)
            if self._problem is None:
                self._decoded.finish(found)
        return found

    def _through(self, data: bytes, level: int = 0):
        """What `data` decodes to through every coding, in pieces (BoundedDecoder.pieces): a chunk
        that decodes to many MiB is scanned a piece at a time, never held whole."""
        if level == len(self.decoders):
            yield data
            return
        decoder = self.decoders[level]
        pieces = decoder.pieces(data, SCAN_PIECE) if hasattr(decoder, "pieces") else [decoder.decompress(data)]
        for piece in pieces:
            if piece:
                yield from self._through(piece, level + 1)

    def _flushed(self):
        data = b""
        for decoder in self.decoders:
            data = (decoder.decompress(data) if data else b"") + decoder.flush()
            if not getattr(decoder, "finished", lambda: True)():
                raise ValueError("truncated")
        yield data

    def _decode(self, step: Callable[[], Iterator[bytes]], found: list[Override]) -> Generator:
        from .decompress import DecodedTooLarge, OverBudget

        pieces = step()
        while True:
            try:
                data = yield functools.partial(next, pieces, _END)
                if data is _END:
                    return
            except DecodedTooLarge as exc:
                raise BodyTooLarge(str(exc)) from None
            except OverBudget:
                raise  # a later zstd frame's window the buffer budget has no room for
            except Exception:
                self._problem = "its Content-Encoding does not decode (or ends early)"
                return
            if any(getattr(d, "trailing", False) for d in self.decoders):
                self._problem = "it has data after the end of its compressed stream"
                return
            if data:
                self._decoded.feed(data, found)

    @property
    def pending(self) -> bool:
        """Could the end of the body, right after what was fed, still reveal an override (`finish`
        judges an override field whose value is not terminated yet, or flushes a decoder)? While it
        could, a streaming caller must hold back the last byte it has (addons/http_stream.py)."""
        if self.problem is not None:
            return False
        return bool(self.decoders) or self._raw.pending or (self._decoded is not None and self._decoded.pending)

    @property
    def problem(self) -> str | None:
        """Why the body cannot be checked for method overrides (the caller refuses it), or None."""
        if self._problem is not None:
            return self._problem
        for stream in (self._raw, self._decoded):
            if stream is not None and (why := stream.problem):
                return why
        return None

    @property
    def unreadable(self) -> bool:
        return self.problem is not None
