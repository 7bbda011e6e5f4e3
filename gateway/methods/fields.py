"""One body field's name and value read every way a framework could read it (`_texts`), and the
caps on what is kept of them: the reading every parser (form, multipart) shares."""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

from ..foreign import DECODE_ROUNDS, fully_unquoted, query_key
from .overrides import FIELD_KEYS, Override, _elements

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
_TOO_MANY = (f"it has more than {SLOW_FIELDS_CAP} fields the gateway must read one by one (named like an "
             f"override, or in a charset it can only read so: EBCDIC, UTF-16/32)")


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


# The cheapest of the scan's fast paths (the others are in name_filter.py): a necessary condition.
_MAYBE_KEY = re.compile(r"%|[Mm][Ee][Tt][Hh][Oo][Dd]")


def _may_be_key(text: str) -> bool:
    """False only when `query_key(text)` cannot be an override key: without a `%` its unquoting
    only turns `+` into spaces, so it needs "method" spelled out."""
    return _MAYBE_KEY.search(text) is not None


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

