"""The form scan's fast paths: which of many urlencoded fields could carry an override name,
found in a few passes over all of them (`_NameFilter`), never the verdict.

A body of a million tiny fields (`a=b&a=b&...`) must not cost a million trips through `query_key`:
the scan runs on the event loop every sandbox shares. Every override key contains "method", and no
character but the ASCII letters casefolds to a piece of a contiguous "method" (U+1E96 and U+1E97
casefold to a letter and a combining mark, U+FB05 and U+FB06 to "st"), so a text can only be an
override name if, once its percent-escapes are decoded, it holds "method" in ASCII letters of any
case. The tests here (and `fields._may_be_key`) are necessary conditions only (never the verdict):
whatever passes them goes through the full reading, as before. tests/unit/test_method_scan_fast.py
checks them against the unabridged scanner (bench/lib/methods_reference.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..foreign import DECODE_ROUNDS
from .fields import NAME_CAP, _long_suspect
from .overrides import FIELD_KEYS, OVERRIDE_FIELDS

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
