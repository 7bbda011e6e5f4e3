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

Spellings, as upstreams read them: header names case-insensitively with `_` as `-` (CGI, WSGI and
PHP turn `X_HTTP_Method_Override` into `HTTP_X_HTTP_METHOD_OVERRIDE`); query and form names like
gateway/foreign.py (percent-decoded, case-folded, `.`, `-` and space as `_`, `[...]` array suffixes
dropped). Values are percent-decoded (query and form), trimmed and upper-cased (frameworks upper-case
overrides), split at commas (Express takes the first element of `GET, DELETE`, others the whole):
every element counts. A value under one of the override names that is not a method token at all
(`DELETE;x`, a NUL, non-ASCII) is refused too: no client needs one, and what a server makes of it is
not knowable. An empty value is no override. The generic name `method` (query only) counts only when
its value is a registered method name (`?method=flickr.photos.search` is an API's own parameter).

Pure: `overrides` finds them in headers and the request target; `refused` says which one the rule
does not allow; `BodyScanner` (below) finds them in urlencoded, multipart and JSON bodies, fed
chunk by chunk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote_plus

from .foreign import query_key
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
    out: list[str | None] = []
    for element in value.split(","):
        element = element.strip(" \t\r\n\f\v")
        if not element:
            continue
        out.append(element.upper() if element.isascii() and _TOKEN.match(element) else None)
    return out


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
    key = query_key(name)
    shown = name[:64]
    if key in FIELD_KEYS:
        return [Override(source, shown, m) for m in _elements(_decoded(value))]
    if generic and key in GENERIC_KEYS:
        return [Override(source, shown, m) for m in _elements(_decoded(value)) if m in KNOWN_METHODS]
    return []


def header_overrides(headers: Iterable[tuple[str, str]]) -> list[Override]:
    found = []
    for name, value in headers:
        if override_header_key(name) in HEADER_KEYS:
            found += [Override("header", name[:64], m) for m in _elements(value)]
    return found


def query_overrides(target: str) -> list[Override]:
    query = target.partition("#")[0].partition("?")[2]
    found: list[Override] = []
    if not query:
        return found
    for piece in _QUERY_SPLIT.split(query):  # looser than any server: ';' splits too
        name, equals, value = piece.partition("=")
        if equals:
            found += field_overrides("query", name, value, generic=True)
    return found


def overrides(headers: Iterable[tuple[str, str]], target: str) -> tuple[Override, ...]:
    """Every method override in the request's headers and target, in order."""
    return tuple(header_overrides(headers) + query_overrides(target))


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


class BodyTooLarge(ValueError):
    """A compressed body decodes past the decoder's budget: it cannot be checked."""


class _Form:
    """application/x-www-form-urlencoded (and a body without Content-Type, which Rack parses as a
    form): `name=value` fields split at `&` (and `;`, looser than any server)."""

    _STOP = re.compile(rb"[=&;]")
    _SEP = re.compile(rb"[&;]")

    def __init__(self) -> None:
        self._state = "name"  # name | value | skip
        self._name = bytearray()
        self._value = bytearray()
        self._field = ""

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
                    self._field = self._name.decode("utf-8", "replace")
                    overriding = query_key(self._field) in FIELD_KEYS
                    self._state = "value" if overriding else "skip"
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
            found += _judged_value("form", self._field, bytes(self._value))
        self._state = "name"
        self._value.clear()
        self._name.clear()

    def finish(self, found: list[Override]) -> None:
        self._close(found)

    @property
    def pending(self) -> bool:
        return self._state == "value"


def _judged_value(source: str, name: str, raw: bytes, decode: bool = True) -> list[Override]:
    if len(raw) > VALUE_CAP:
        return [Override(source, name[:64], None)]
    text = raw.decode("utf-8", "replace")
    if not decode:
        return [Override(source, name[:64], m) for m in _elements(text)]
    return field_overrides(source, name, text)


class _Multipart:
    """multipart/form-data (and the other multipart types Rack parses): every part whose
    Content-Disposition names an override field. Delimiters are found anywhere (not only at the
    start of a line): looser than any parser, so no part a server reads is missed."""

    HEADER_CAP = 64 * 1024
    _NAME = re.compile(r"""(?:^|;)\s*name(\*?)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)""", re.IGNORECASE)

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"--" + boundary
        self._buf = bytearray()
        self._state = "preamble"  # preamble | after_delimiter | headers | value | skip | done
        self._names: list[str] = []
        self._value = bytearray()
        self.unreadable = False  # part headers beyond HEADER_CAP: the caller refuses

    def feed(self, data: bytes, found: list[Override]) -> None:
        if self._state == "done":
            return
        self._buf += data
        while self._step(found):
            pass

    def _step(self, found: list[Override]) -> bool:
        """Consume what can be consumed from the buffer; False when more input is needed."""
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
            if buf[:2] == b"--":
                self._state = "done"
                buf.clear()
                return False
            newline = buf.find(b"\n")
            if newline < 0:
                if len(buf) > self.HEADER_CAP:
                    self.unreadable, self._state = True, "done"
                return False
            del buf[: newline + 1]
            self._state = "headers"
            return True
        if self._state == "headers":
            end, size = _blank_line(buf)
            if end < 0:
                if len(buf) > self.HEADER_CAP:
                    self.unreadable, self._state = True, "done"
                return False
            self._names = _disposition_names(bytes(buf[:end]).decode("utf-8", "replace"), self._NAME)
            del buf[: end + size]
            self._state = "value" if any(query_key(n) in FIELD_KEYS for n in self._names) else "skip"
            return True
        return False

    def _close_value(self, found: list[Override]) -> None:
        raw = bytes(self._value)
        for name in self._names:
            if query_key(name) in FIELD_KEYS:
                found += _judged_value("form", name, raw, decode=False)
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


def _blank_line(buf: bytearray) -> tuple[int, int]:
    """Where the part's header block ends (index, length of the blank line), or (-1, 0)."""
    if buf.startswith(b"\r\n"):
        return 0, 2
    if buf.startswith(b"\n"):
        return 0, 1
    candidates = [(i, n) for i, n in ((buf.find(b"\r\n\r\n"), 4), (buf.find(b"\n\n"), 2)) if i >= 0]
    return min(candidates) if candidates else (-1, 0)


def _disposition_names(headers: str, pattern: re.Pattern) -> list[str]:
    names = []
    for line in headers.replace("\r\n", "\n").split("\n"):
        field, colon, value = line.partition(":")
        if not colon or field.strip().lower() != "content-disposition":
            continue
        for m in pattern.finditer(value):
            raw = m.group(2).strip()
            if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
                raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
            if m.group(1):  # name*=utf-8''%5Fmethod (RFC 2231 / 5987)
                raw = raw.split("'", 2)[-1]
            names.append(raw)
    return names


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


_FORM_TYPES = ("application/x-www-form-urlencoded",)
_BOUNDARY = re.compile(r"""(?:^|;)\s*boundary\s*=\s*("(?:[^"\\]|\\.)*"|[^;,\s]*)""", re.IGNORECASE)


def body_parsers(content_types: Sequence[str]) -> list:
    """The parsers for a request body with these Content-Type values (none: Rack parses a body
    without one as a form). Each value is read as every server might read it."""
    if not content_types:
        return [_Form()]
    parsers: list = []
    for value in content_types:
        media, _, params = value.partition(";")
        media = media.strip().lower()
        if media in _FORM_TYPES or not media:
            parsers.append(_Form())
        elif media.startswith("multipart/"):
            for m in _BOUNDARY.finditer(";" + params):
                boundary = m.group(1)
                if boundary.startswith('"') and boundary.endswith('"') and len(boundary) >= 2:
                    boundary = boundary[1:-1]
                if boundary:
                    parsers.append(_Multipart(boundary.encode("utf-8", "surrogateescape")))
        if "/json" in media or "+json" in media:
            parsers.append(_Json())
    return parsers


class BodyScanner:
    """Finds method overrides in a request body, fed chunk by chunk as it arrives (decoded first
    when the body has a Content-Encoding the gateway can decode). Memory stays bounded: a parser
    keeps at most one field name or value (NAME_CAP, VALUE_CAP) and one delimiter's worth of bytes."""

    def __init__(self, parsers: list, decoder=None):
        self.parsers = parsers
        self.decoder = decoder
        self._broken = False  # the body does not decode: no server reads fields from it either

    @classmethod
    def for_headers(cls, headers: Iterable[tuple[str, str]], decoder_for: Callable[[str], object] | None = None
                    ) -> "BodyScanner | None":
        """A scanner for a request with these headers, or None when no framework reads fields
        from such a body (a Content-Encoding nobody decodes, a type nobody parses into fields)."""
        types, encodings = [], []
        for name, value in headers:
            lower = name.lower()
            if lower == "content-type":
                types.append(value)
            elif lower == "content-encoding":
                encodings += [c.strip().lower() for c in value.split(",") if c.strip()]
        parsers = body_parsers(types)
        if not parsers:
            return None
        encodings = [c for c in encodings if c != "identity"]
        decoder = None
        if encodings:
            if len(encodings) > 1 or decoder_for is None:
                return None  # body parsers refuse stacked or unknown codings (body-parser: 415)
            decoder = decoder_for(encodings[0])
            if decoder is None:
                return None
        return cls(parsers, decoder)

    def feed(self, data: bytes) -> list[Override]:
        found: list[Override] = []
        if self._broken or not data:
            return found
        if self.decoder is not None:
            data = self._decode(lambda: self.decoder.decompress(data))
        for parser in self.parsers:
            parser.feed(data, found)
        return found

    def finish(self) -> list[Override]:
        found: list[Override] = []
        if not self._broken:
            tail = self._decode(self.decoder.flush) if self.decoder is not None else b""
            for parser in self.parsers:
                if tail:
                    parser.feed(tail, found)
                parser.finish(found)
        return found

    @property
    def pending(self) -> bool:
        """Could the end of the body, right after what was fed, still reveal an override (`finish`
        judges an override field whose value is not terminated yet, or flushes a decoder)? While it
        could, a streaming caller must hold back the last byte it has (addons/layers.py)."""
        return not self._broken and (self.decoder is not None or any(p.pending for p in self.parsers))

    @property
    def unreadable(self) -> bool:
        """A multipart part's header block was too long to read (the caller refuses the body)."""
        return any(getattr(p, "unreadable", False) for p in self.parsers)

    def _decode(self, step: Callable[[], bytes]) -> bytes:
        from .decompress import DecodedTooLarge

        try:
            return step()
        except DecodedTooLarge as exc:
            raise BodyTooLarge(str(exc)) from None
        except Exception:
            self._broken = True
            return b""
