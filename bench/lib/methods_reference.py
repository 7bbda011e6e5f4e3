"""A frozen copy of gateway/methods.py before the fast body scan (commit 1d064cd), for the differential
test (tests/unit/test_method_scan_fast.py: the new scanner must find exactly what this one finds) and
bench/method_scan.py's "before"; in bench/lib (with the benchmark's harness) so that bench/ imports no test internals.
One change: a multipart `name=` with nothing after it raised IndexError in `_disposition_names`
(the request was refused as a failed check, 500); both now read it as the empty name it is.

The method a request is judged by: the method on the wire and every method override in it.

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
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import unquote_plus, unquote_to_bytes

from gateway.foreign import query_key
from gateway.policy import FORBIDDEN_METHODS

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
_DECODE_ROUNDS = 4
_QUERY_SPLIT = re.compile(r"[&;]")
# Distinct methods one override value may name: past it the value counts as naming no method (refused
# whatever the rule allows; no client names 65 methods), so a sandbox cannot make the gateway build,
# judge and describe thousands of them for one header.
MAX_ELEMENTS = 64
VALUE_CAP = 512  # bytes of a field value kept; a longer value is not a method name
NAME_CAP = 512  # bytes of a body field name kept; a longer name is not an override name

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


def _decoded(value: str) -> str:
    for _ in range(_DECODE_ROUNDS):
        decoded = unquote_plus(value, errors="replace")
        if decoded == value:
            break
        value = decoded
    return value


def field_overrides(source: str, name: str, value: str, generic: bool = False) -> list[Override]:
    """Overrides one query/form/JSON field carries (none when its name is not an override name).
    `generic`: also the names that count only with a registered method as value (query only)."""
    if name.isascii() and "%" not in name and "+" not in name and "method" not in name.lower():
        return []  # not decoded, so query_key cannot make "method" appear: the common case, read fast
    key = query_key(name)
    shown = name[:64]
    if key in FIELD_KEYS:
        return [Override(source, shown, m) for m in _elements(_decoded(value))]
    if generic and key in GENERIC_KEYS:
        return [Override(source, shown, m) for m in _elements(_decoded(value)) if m in KNOWN_METHODS]
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
    for piece in dict.fromkeys(_QUERY_SPLIT.split(query)):
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
    for _ in range(_DECODE_ROUNDS):
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
        texts = [_decoded(texts[0])]
    for charset in charsets:
        try:
            texts.append((_unquoted_bytes(raw) if percent else raw).decode(charset, "replace"))
        except Exception:
            continue
    return list(dict.fromkeys(texts))


def _override_names(raw: bytes, charsets: Sequence[str], percent: bool = True) -> list[str]:
    return [t for t in _texts(raw, charsets, percent) if query_key(t) in FIELD_KEYS]


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


class _Form:
    """application/x-www-form-urlencoded (and a body without Content-Type, which Rack parses as a
    form): `name=value` fields split at `&` (and `;`, looser than any server)."""

    _STOP = re.compile(rb"[=&;]")
    _SEP = re.compile(rb"[&;]")

    def __init__(self, charsets: Sequence[str] = ()) -> None:
        self._charsets = tuple(charsets)
        self._state = "name"  # name | value | skip
        self._name = bytearray()
        self._value = bytearray()
        self._names: list[str] = []

    def feed(self, data: bytes, found: list[Override]) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if self._state == "name":
                m = self._STOP.search(data, pos)
                stop = m.start() if m else end
                if len(self._name) <= NAME_CAP:
                    self._name += data[pos:stop][: NAME_CAP + 1 - len(self._name)]
                if m is None:
                    return
                pos = stop + 1
                if data[stop] == ord("=") and len(self._name) <= NAME_CAP:
                    self._names = _override_names(bytes(self._name), self._charsets)
                    self._state = "value" if self._names else "skip"
                elif data[stop] == ord("="):
                    self._state = "skip"
                self._name.clear()
            else:
                m = self._SEP.search(data, pos)
                stop = m.start() if m else end
                if self._state == "value" and len(self._value) <= VALUE_CAP:
                    self._value += data[pos:stop][: VALUE_CAP + 1 - len(self._value)]
                if m is None:
                    return
                pos = stop + 1
                self._close(found)

    def _close(self, found: list[Override]) -> None:
        if self._state == "value":
            found += _judged("form", self._names, bytes(self._value), self._charsets, percent=True)
        self._state = "name"
        self._value.clear()
        self._name.clear()

    def finish(self, found: list[Override]) -> None:
        self._close(found)

    @property
    def pending(self) -> bool:
        return self._state == "value"


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
        self._buf = bytearray()
        self._state = "preamble"  # sniff | preamble | after_delimiter | headers | value | skip | done
        if boundary is None:
            self._state = "sniff"
        self._names: list[str] = []
        self._value = bytearray()
        self.unreadable = False  # part headers beyond HEADER_CAP: the caller refuses

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
        return True

    def _step(self, found: list[Override]) -> bool:
        """Consume what can be consumed from the buffer; False when more input is needed."""
        if self._state == "sniff":
            return self._sniff()
        buf, delimiter = self._buf, self._delimiter
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
                    self.unreadable, self._state = True, "done"
                return False
            del buf[: newline + 1]
            self._state = "headers"
            return True
        if self._state == "headers":
            m = self._BLANK.search(buf)
            if m is None:
                if len(buf) > self.HEADER_CAP:
                    self.unreadable, self._state = True, "done"
                return False
            self._names = self._part_names(bytes(buf[: m.start()]))
            del buf[: m.end()]
            self._state = "value" if self._names else "skip"
            return True
        return False

    def _part_names(self, block: bytes) -> list[str]:
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
            if raw[:1] and raw[0] in "\"'":  # the one change: `name=` alone crashed it
                quote = raw[0]
                inner = raw[1:].removesuffix(quote) if len(raw) > 1 else ""
                variants = [inner, re.sub(r"\\(.)", r"\1", inner), inner.split(quote, 1)[0]]
            else:  # Rack's token stops at any tspecial
                variants.append(re.split(r"[()<>@,;:\\\"/\[\]?={}\s]", raw, maxsplit=1)[0])
            if m.group(1):  # name*=utf-8''%5Fmethod (RFC 2231 / 5987)
                variants = [v.split("'", 2)[-1] for v in variants]
            names += variants
    return list(dict.fromkeys(names))


class _Json:
    """A JSON body: the keys of the top-level object (where Laravel and Slim read `_method`). The
    scan jumps from one structural character to the next, so long strings (a model prompt) cost
    one regex search each."""

    _STRUCT = re.compile(rb'["{}\[\],:]')
    _IN_STRING = re.compile(rb'["\\]')
    _SPACE = b" \t\r\n"

    def __init__(self) -> None:
        self._started = False
        self._dead = False  # not an object at the top, or past its end: no keys to find
        self._depth = 0
        self._in_string = False
        self._escape = False  # a backslash ended the last chunk
        self._capture: bytearray | None = None
        self._capturing = ""  # key | value
        self._expect_key = False
        self._value_for: str | None = None  # an override key whose value comes next

    def feed(self, data: bytes, found: list[Override]) -> None:
        pos, end = 0, len(data)
        while pos < end and not self._dead:
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
    def unreadable(self) -> bool:
        return any(getattr(p, "unreadable", False) for p in self.parsers)


class _Stream:
    """One byte stream of the body (as sent, or decoded from its Content-Encoding), read every
    plausible way: as bytes, in each declared charset that is not ASCII-transparent, and as
    UTF-16 and UTF-32 of both byte orders by every parser when a wide charset is declared or the
    body starts with a UTF-16/32 byte order mark, and by JSON parsers only when it has a NUL in its
    first four bytes."""

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
        if any(r.unreadable for r in self.readings):
            return "a multipart part's header block is too long to tell whether it is a method override field"
        failed = [r.codec for r in self.readings if r.failed]
        return f"it does not decode as its charset {failed[0]}" if failed else None


class BodyScanner:
    """Finds method overrides in a request body, fed chunk by chunk as it arrives. The body is read
    as sent and, when it has a Content-Encoding the gateway can decode, decoded too (frameworks
    that ignore the coding read the first, those that decode it the second); each stream is read
    every way `_Stream` and `plan_body` say. Memory stays bounded: a parser keeps at most one field
    name or value (NAME_CAP, VALUE_CAP), one part's header block (HEADER_CAP) and one delimiter's
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

    def feed(self, data: bytes) -> list[Override]:
        found: list[Override] = []
        if self._problem is not None or not data:
            return found
        self._read += len(data)
        self._problem = self._armed
        self._raw.feed(data, found)
        if self._decoded is not None:
            self._decode(lambda: self._through(data), found)
        return found

    def finish(self) -> list[Override]:
        found: list[Override] = []
        if self._problem is not None:
            return found
        self._raw.finish(found)
        if self._decoded is not None:
            if self._read:
                self._decode(self._flushed, found)
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
        pieces = decoder.pieces(data) if hasattr(decoder, "pieces") else [decoder.decompress(data)]
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

    def _decode(self, step: Callable[[], Iterator[bytes]], found: list[Override]) -> None:
        from gateway.decompress import DecodedTooLarge

        pieces = step()
        while True:
            try:
                data = next(pieces)
            except StopIteration:
                return
            except DecodedTooLarge as exc:
                raise BodyTooLarge(str(exc)) from None
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
        could, a streaming caller must hold back the last byte it has (addons/layers.py)."""
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
