"""multipart bodies (`_Multipart`): every part whose Content-Disposition names an override field,
its headers and name read as liberally as PHP, Rack and Werkzeug read them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

from ..foreign import query_key
from .body_plan import _codec
from .fields import SLOW_FIELDS_CAP, VALUE_CAP, _TOO_MANY, _judged, _texts
from .name_filter import _IDENTITY, _NameFilter
from .overrides import FIELD_KEYS, Override

_HEADERS_TOO_LONG = "a multipart part's header block is too long to tell whether it is a method override field"


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
    SLOW_PARTS_CAP = SLOW_FIELDS_CAP  # (an attribute: the unabridged scanner of the tests has no cap)
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
                if self._slow_parts > self.SLOW_PARTS_CAP:
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
            if self._slow_parts > self.SLOW_PARTS_CAP:
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
