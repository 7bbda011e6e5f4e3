"""How a request body is read, from its Content-Type values alone (`plan_body`): as a form, JSON or
multipart, under which boundaries and in which charsets."""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from dataclasses import dataclass

READINGS_CAP = 6  # distinct boundaries (or charsets) one Content-Type may name; more is refused
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

