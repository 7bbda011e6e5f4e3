"""Redaction of secret values in what flows back to the sandbox.

A server that echoes a credential rarely echoes it as it was sent: it escapes it the way its
framework escapes strings. Each secret is searched in every form a table of real encoders makes of
it (`ENCODINGS` x `ESCAPES`, each row naming what it mimics), and the search runs over a normalised
*view* of the bytes, so that whole families of variants need no form of their own:

- letters are compared case-insensitively: upper- and lower-case hex, `%2F` and `%2f`, `\\u002B`
  and `\\u002b`, `&#X2F;` (base64 compared this way can only over-redact);
- NUL bytes are skipped: the same text in UTF-16 or UTF-32 (either byte order, declared or not);
- a line break that ends a line made only of base64 characters (16 or more) is skipped: MIME and
  PEM base64 wrapped at any width, at any alignment of the secret within the blob.

Every rule of the view depends only on the bytes before a position, so the view of a prefix is a
prefix of the view; that is what lets a streamed body be redacted chunk by chunk (StreamRedactor)
with exactly the result of redacting it whole. A match is replaced in place by a marker of the same
length (skipped NULs and line breaks stay where they were), so Content-Length stays true and a
UTF-16 body stays UTF-16.

What no form covers: a server that transforms a secret arbitrarily (hashes it, encrypts it, splits
it across fields, reverses it, compresses it inside a body it then encodes, escapes it with an
encoder missing from the table). See docs/credentials.md.
"""

from __future__ import annotations

import base64
import bisect
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from urllib.parse import quote, quote_plus

import ahocorasick_rs

MIN_FORM_LENGTH = 6  # shorter base64 fragments would match innocent text
MARKER = b"[REDACTED]"
REMEMBERED_VALUES = 64  # secret values (current and past) the gateway keeps redacting

_LOWER = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz")
_BASE64_LINE = re.compile(rb"[A-Za-z0-9+/=_\-\0]*")
WRAP_MIN = 16  # a line shorter than this is text, not a wrapped base64 blob


def _pure_base64(raw: bytes, offset: int, urlsafe: bool) -> bytes:
    """The base64 characters that depend only on `raw` when it starts `offset` bytes into a blob."""
    encoder = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    encoded = encoder(b"\0" * offset + raw)
    start_bit, end_bit = 8 * offset, 8 * (offset + len(raw))
    chars = [encoded[i : i + 1] for i in range(len(encoded)) if 6 * i >= start_bit and 6 * i + 6 <= end_bit]
    return b"".join(chars)


def _every_byte_percent(value: str) -> str:
    return "".join(f"%{b:02X}" for b in value.encode("utf-8"))


# How a server may encode a value before it writes it: (name, what it mimics, encoder).
ENCODINGS: tuple[tuple[str, str, Callable[[str], Iterable[str | bytes]]], ...] = (
    ("raw", "any echo of the value as it is", lambda v: [v]),
    ("hex", "hex dumps, digests of nothing: bytes.hex(), xxd (either case)", lambda v: [v.encode().hex()]),
    ("base64", "base64 at any alignment in a blob (Basic credentials, JWT parts, data: URLs)",
     lambda v: [_pure_base64(v.encode(), o, False) for o in (0, 1, 2)]),
    ("base64url", "base64url at any alignment (JWT, URL-safe tokens)",
     lambda v: [_pure_base64(v.encode(), o, True) for o in (0, 1, 2)]),
    ("form-plus", "a form-decoded value whose '+' became a space", lambda v: [v.replace("+", " ")]),
    ("percent-all-reserved", "Python quote(safe=''), PHP rawurlencode, Go url.PathEscape of a segment",
     lambda v: [quote(v, safe="")]),
    ("percent-keep-slash", "Python quote() and urllib's defaults (keeps '/')", lambda v: [quote(v)]),
    ("percent-plus", "Python quote_plus, Go url.QueryEscape, application/x-www-form-urlencoded",
     lambda v: [quote_plus(v), quote_plus(v, safe="/")]),
    ("percent-js-component", "JavaScript encodeURIComponent (keeps !'()*~)", lambda v: [quote(v, safe="-_.!~*'()")]),
    ("percent-js-uri", "JavaScript encodeURI (keeps reserved characters)",
     lambda v: [quote(v, safe=";,/?:@&=+$-_.!~*'()#")]),
    ("percent-php-java", "PHP urlencode and Java URLEncoder (space as '+', '~' and '*' vary)",
     lambda v: [quote_plus(v, safe="-_."), quote_plus(v, safe="-_.*")]),
    ("percent-every-byte", "encoders that escape every byte", lambda v: [_every_byte_percent(v)]),
    ("percent-twice", "a URL that carried the percent-encoded value, percent-encoded again (a redirect's "
     "next= or return_to= parameter, a logged request URL)",
     lambda v: [quote(quote(v, safe=""), safe=""), quote(quote(v)), quote_plus(quote_plus(v)),
                quote(quote_plus(v), safe="")]),
    ("quoted-printable", "MIME quoted-printable (e-mail bodies: '=' as =3D)", lambda v: [_quoted_printable(v)]),
    ("hex-separated", "hex dumps with separators (openssl, certificate fingerprints: 73:6b:2d)",
     lambda v: [":".join(f"{b:02x}" for b in v.encode()), " ".join(f"{b:02x}" for b in v.encode())]),
)


def _quoted_printable(value: str) -> str:
    return "".join(c if (33 <= ord(c) <= 126 and c != "=") else f"={ord(c):02X}" for c in value)


def _json_basic(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _u(c: str) -> str:
    return f"\\u{ord(c):04x}"


def _json_escape(chars: str) -> Callable[[str], str]:
    return lambda s: "".join(_u(c) if c in chars else c for c in _json_basic(s))


def _json_all(s: str) -> str:
    return "".join(c if c.isalnum() and c.isascii() else _u(c) for c in s)


def _html(table: dict[str, str]) -> Callable[[str], str]:
    return lambda s: "".join(table.get(c, c) for c in s)


def _html_all(fmt: str) -> Callable[[str], str]:
    return lambda s: "".join(c if c.isalnum() and c.isascii() else fmt % ord(c) for c in s)


_HTML_BASIC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}

# How a framework escapes a string when it writes it into a document: (name, what it mimics, escaper).
ESCAPES: tuple[tuple[str, str, Callable[[str], str]], ...] = (
    ("none", "text, headers, plain bodies", lambda s: s),
    ("json", "JSON string: Python json, JavaScript JSON.stringify, Java Jackson, Rust serde", _json_basic),
    ("json-slash", "JSON string: PHP json_encode, Ruby's older generators (escape '/' as '\\/')",
     lambda s: _json_basic(s).replace("/", "\\/")),
    ("json-dotnet", ".NET System.Text.Json default encoder (escapes + & ' < > ` as \\uXXXX)",
     _json_escape("+&'<>`")),
    ("json-go", "Go encoding/json (escapes < > & as \\u003c \\u003e \\u0026)", _json_escape("<>&")),
    ("json-ascii-all", "JSON encoders that escape every non-alphanumeric character", _json_all),
    ("js-hex", "JavaScript and Python string literals escaping punctuation as \\xHH (template engines)",
     lambda s: "".join(c if c.isalnum() and c.isascii() else f"\\x{ord(c):02x}" for c in s)),
    ("html-python", "Python html.escape (' as &#x27;), Jinja2/MarkupSafe (' as &#39;)",
     lambda s: (_html(_HTML_BASIC | {"'": "&#x27;"})(s))),
    ("html-php", "PHP htmlspecialchars (ENT_QUOTES: ' as &#039;), XML (&apos;)",
     lambda s: _html(_HTML_BASIC | {"'": "&#039;"})(s)),
    ("html-go", "Go html/template (escapes + as &#43;, ' as &#39;, \" as &#34;)",
     _html({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&#34;", "'": "&#39;", "+": "&#43;"})),
    ("html-hex-all", "OWASP Java Encoder / ESAPI (every non-alphanumeric as &#xHH;)", _html_all("&#x%x;")),
    ("html-dec-all", "encoders writing every non-alphanumeric as &#DD;", _html_all("&#%d;")),
)


def forms_of(value: str) -> set[bytes]:
    """Every form of `value` the table makes (as written, before the view folds case)."""
    forms: set[bytes] = set()
    for _, _, encode in ENCODINGS:
        for encoded in encode(value):
            text = encoded.decode("ascii") if isinstance(encoded, bytes) else encoded
            for _, _, escape in ESCAPES:
                forms.add(escape(text).encode("utf-8", "surrogateescape"))
    raw = value.encode("utf-8", "surrogateescape")
    return {f for f in forms if len(f) >= MIN_FORM_LENGTH or f == raw}


def marker(length: int) -> bytes:
    if length >= len(MARKER):
        return MARKER + b"*" * (length - len(MARKER))
    return b"*" * length


class _View:
    """The normalised view of a buffer: lower case, NULs and wrap line breaks skipped, with the
    map back to the buffer's positions. `wrap_run` is the length of the buffer's first line so
    far when that line has been base64 characters only, else -1.

    The text is made with regular expressions and bytes.translate (C speed, whatever the body); the
    map back is built only when a position is asked for, that is when something matched."""

    __slots__ = ("data", "text", "_breaks", "_adjusted")

    def __init__(self, data: bytes, wrap_run: int):
        self.data = data
        self._breaks = _wrap_breaks(data, wrap_run)
        self._adjusted: list[int] | None = None
        if self._breaks:
            pieces, last = [], 0
            for start, end in self._breaks:
                pieces.append(data[last:start])
                last = end
            pieces.append(data[last:])
            data = b"".join(pieces)
        self.text = data.translate(_LOWER, b"\0")

    @property
    def identity(self) -> bool:
        """Nothing skipped: view positions are buffer positions."""
        return len(self.text) == len(self.data)

    def position(self, index: int) -> int:
        """The buffer position of view byte `index` (len(view) maps to len(buffer))."""
        if index >= len(self.text):
            return len(self.data)
        if self.identity:
            return index
        if self._adjusted is None:
            skips = sorted([m.start() for m in _NUL.finditer(self.data)]
                           + [p for start, end in self._breaks for p in range(start, end)])
            self._adjusted = [pos - i for i, pos in enumerate(skips)]  # view index of each skipped byte
        return index + bisect.bisect_right(self._adjusted, index)


_NUL = re.compile(rb"\0")
# A line break after a whole line of base64 characters (NULs allowed: UTF-16), WRAP_MIN or more bytes.
_WRAP_BREAK = re.compile(rb"(?<=\n)[A-Za-z0-9+/=_\-\0]{%d,}(\r?\n)" % WRAP_MIN)
_FIRST_LINE = re.compile(rb"([A-Za-z0-9+/=_\-\0]*)(\r?\n)")


def _wrap_breaks(data: bytes, wrap_run: int) -> list[tuple[int, int]]:
    """(start, end) of every line break that ends a wrapped base64 line."""
    if b"\n" not in data:
        return []
    breaks = [m.span(1) for m in _WRAP_BREAK.finditer(data)]
    if wrap_run >= 0 and (first := _FIRST_LINE.match(data)) is not None:
        # The first line continues one that began before this buffer: its length counts from there.
        line = first.group(1)
        if wrap_run + len(line) - line.count(0) >= WRAP_MIN:
            breaks.insert(0, first.span(2))
    return breaks


def wrap_run_after(data: bytes, wrap_run: int) -> int:
    """The `wrap_run` for the bytes that follow `data` (see _View)."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        data, wrap_run = data[newline + 1:], 0
    if wrap_run < 0 or not _BASE64_LINE.fullmatch(data):
        return -1
    return wrap_run + len(data) - data.count(0)


class Redactor:
    """Finds every form of every secret; `redact` returns the redacted bytes and the secret names hit.

    Built once per set of values (at load, on a rotation): the forms, one Aho-Corasick automaton
    over them (leftmost-longest, linear in the body whatever the number of forms), and the sorted
    forms that streaming hold-back searches for prefixes."""

    def __init__(self, secrets: dict[str, str] | Iterable[tuple[str, str]]):
        owner: dict[bytes, str] = {}
        for name, value in (secrets.items() if isinstance(secrets, dict) else secrets):
            if not value:
                continue
            for form in forms_of(value):
                owner.setdefault(form.translate(_LOWER), name)
        forms = sorted(owner, key=len, reverse=True)
        self._forms = forms
        self._names = [owner[f] for f in forms]
        self._automaton = (ahocorasick_rs.BytesAhoCorasick(forms, matchkind=ahocorasick_rs.MatchKind.LeftmostLongest)
                           if forms else None)
        self.max_length = max((len(f) for f in forms), default=0)
        # Sorted, the forms that start with some bytes p follow p directly: "is p a proper prefix
        # of a form" is one bisection, in memory linear in the forms (an index of every prefix
        # grew with the square of a secret's length: 1.6 GiB for a 4 KiB secret).
        self._sorted = sorted(forms)
        self._alphabet = frozenset(b for f in forms for b in f)

    def __bool__(self) -> bool:
        return self._automaton is not None

    def redact(self, data: bytes) -> tuple[bytes, list[str]]:
        clean, _, hits = self.redact_prefix(data, len(data))
        return clean, hits

    def redact_prefix(self, data: bytes, cut: int, wrap_run: int = -1,
                      view: "_View | None" = None) -> tuple[bytes, int, list[str]]:
        """Redacts `data[:end]` and returns (redacted bytes, end, secret names hit): `end` is `cut`,
        or the end of a match that starts before `cut` and runs past it (a match is never split).
        `wrap_run`: see _View (what came before `data` on its first line)."""
        if self._automaton is None or not data:
            return data[:cut], cut, []
        view = view if view is not None else _View(data, wrap_run)
        matches = self._automaton.find_matches_as_indexes(view.text, overlapping=False)
        if not matches:
            return data[:cut], cut, []
        out = bytearray(data)
        hits: list[str] = []
        end = cut
        for index, start, stop in matches:
            first = view.position(start)
            if first >= cut:
                break
            fill = marker(stop - start)
            if view.identity:
                out[start:stop] = fill
            else:  # skipped NULs and line breaks stay where they are
                for k, v in enumerate(range(start, stop)):
                    out[view.position(v)] = fill[k]
            hits.append(self._names[index])
            end = max(end, view.position(stop - 1) + 1)
        return bytes(out[:end]), end, hits

    def _begins_a_form(self, piece: bytes) -> bool:
        """Whether `piece` is a proper prefix of some form."""
        forms = self._sorted
        i = bisect.bisect_left(forms, piece)
        if i < len(forms) and forms[i] == piece:
            i += 1
        return i < len(forms) and forms[i].startswith(piece)

    def held_suffix(self, data: bytes, wrap_run: int = -1, view: "_View | None" = None) -> int:
        """How many bytes at the end of `data` more data could still turn into a secret: from the
        start of the longest suffix of the view that is a proper prefix of some form.

        Why that is enough: a form matching the view at s < cut is either whole already, or the
        view from s would be a proper prefix of it (and s would be past the cut); and no longer
        form can still grow at s for the same reason. So every match that starts before the cut
        is final, whatever comes next. The view is of the whole buffer (skipped bytes have no
        bound: 2,000 NULs between two characters of a form are still one form in the view)."""
        if not self._sorted or not data:
            return 0
        view = view if view is not None else _View(data, wrap_run)
        text = view.text
        # A final CR may be the first half of a wrap line break the next chunk completes; until
        # then it waits too, with whatever could precede a form (one CR: a second one before it
        # could not be part of the break).
        pending_cr = data.endswith(b"\r")
        end = len(text) - 1 if pending_cr else len(text)
        run, limit = 0, min(end, self.max_length - 1)
        while run < limit and text[end - 1 - run] in self._alphabet:
            run += 1
        for length in range(run, 0, -1):
            if self._begins_a_form(text[end - length:end]):
                return len(data) - view.position(end - length)
        return 1 if pending_cr else 0

    def redact_text(self, text: str) -> tuple[str, list[str]]:
        data = text.encode("utf-8", "surrogateescape")
        redacted, hits = self.redact(data)
        return (redacted.decode("utf-8", "surrogateescape") if hits else text), hits


class StreamRedactor:
    """Redacts a body chunk by chunk, holding back only what could still become a secret form.

    After each chunk it keeps the longest tail of what it has seen that is a proper prefix of some
    form (`Redactor.held_suffix`), and passes on everything before it, redacted. Ordinary text, and
    every event that ends in a byte no form contains (SSE's blank line, NDJSON's newline), flows
    through with no delay; a secret split across chunks is still caught whole. Nothing is flushed on
    a timer: the held bytes are exactly those that the next chunk could turn into a secret, so
    releasing them early would release a piece of one.

    Call it with each chunk and finally with b"" (mitmproxy's stream callable protocol). It returns
    b"" when it has nothing to pass on yet: the caller must treat that as "nothing", never as the
    end of the body (the gateway's HTTP/1 writers drop empty pieces)."""

    def __init__(self, redactor: "Redactor | Callable[[], Redactor | None]", on_hit=None):
        # A callable is asked again for every chunk: a secret rotated while the stream is open is
        # redacted from the next chunk on.
        self._current = redactor if callable(redactor) and not isinstance(redactor, Redactor) else (lambda: redactor)
        self.pending = b""
        self.wrap_run = 0  # the body starts a line
        self.on_hit = on_hit

    @property
    def redactor(self) -> Redactor | None:
        return self._current()

    def __call__(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        redactor = self.redactor
        if redactor is None or not redactor:
            self.pending = b""
            return data
        view = _View(data, self.wrap_run)
        # At the end of the body (b"") everything goes; otherwise the tail that could still become
        # a form waits. A match starting before the cut is final (see Redactor.held_suffix).
        cut = len(data) - redactor.held_suffix(data, self.wrap_run, view) if chunk else len(data)
        clean, end, hits = redactor.redact_prefix(data, cut, self.wrap_run, view)
        self.wrap_run = wrap_run_after(data[:end], self.wrap_run)
        self.pending = data[end:]
        if hits and self.on_hit is not None:
            self.on_hit(hits)
        return clean


class SecretMemory:
    """Every secret value the gateway has held, current and past (the last REMEMBERED_VALUES), and
    one Redactor over all of them.

    A value rotated away or dropped by a reload while a request that carried it is in flight, or
    echoed back later, is still redacted: redaction never depends on what the store holds now."""

    def __init__(self, limit: int = REMEMBERED_VALUES):
        self.limit = limit
        self._values: OrderedDict[str, str] = OrderedDict()  # value -> secret name, oldest first
        self._pinned: dict[str, dict[str, str]] = {}  # a request in flight -> the values it carried
        self._redactor: Redactor | None = None

    def remember(self, values: dict[str, str]) -> None:
        for name, value in values.items():
            if not value:
                continue
            if value in self._values:
                self._values.move_to_end(value)
                continue
            self._values[value] = name
            self._redactor = None
        pinned = {v for held in self._pinned.values() for v in held.values()}
        for value in list(self._values):
            if len(self._values) <= self.limit:
                break
            if value not in pinned:  # a value a request in flight carried is never forgotten
                del self._values[value]
                self._redactor = None

    def pin(self, key: str, values: dict[str, str]) -> None:
        """Keep redacting `values` at least until `unpin(key)` (one request's lifetime)."""
        self._pinned[key] = dict(values)
        self.remember(values)

    def unpin(self, key: str) -> None:
        self._pinned.pop(key, None)

    def holds(self, values: Iterable[str]) -> bool:
        return all(v in self._values for v in values if v)

    def redactor(self) -> Redactor:
        if self._redactor is None:
            self._redactor = Redactor([(name, value) for value, name in self._values.items()])
        return self._redactor


def redact_all(redactor: Redactor, chunks: Iterable[bytes]) -> bytes:
    stream = StreamRedactor(redactor)
    return b"".join(stream(c) for c in [*chunks, b""])
