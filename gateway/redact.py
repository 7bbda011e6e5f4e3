"""Redaction of secret values in what flows back to the sandbox.

Each secret is searched in every form an upstream is likely to echo it in: raw, base64 and
base64url (alone, or at any byte alignment inside a longer base64 blob such as a Basic
credential), lower- and upper-case hex, and URL-encoding. Replacements keep the length of what
they replace, so Content-Length stays true and streamed bodies can be redacted chunk by chunk with
an overlap window no longer than the longest form.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus

MIN_FORM_LENGTH = 6  # shorter base64 fragments would match innocent text
MARKER = b"[REDACTED]"


def _pure_base64(raw: bytes, offset: int, urlsafe: bool) -> bytes:
    """The base64 characters that depend only on `raw` when it starts `offset` bytes into a blob."""
    encoder = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    encoded = encoder(b"\0" * offset + raw)
    start_bit, end_bit = 8 * offset, 8 * (offset + len(raw))
    chars = [encoded[i : i + 1] for i in range(len(encoded)) if 6 * i >= start_bit and 6 * i + 6 <= end_bit]
    return b"".join(chars)


def forms_of(value: str) -> set[bytes]:
    raw = value.encode("utf-8")
    forms = {raw, raw.hex().encode(), raw.hex().upper().encode(), value.replace("+", " ").encode("utf-8")}
    for text in (quote(value, safe=""), quote(value), quote_plus(value), quote_plus(value, safe="/"),
                 quote(value, safe="").lower()):
        forms.add(text.encode("ascii"))
    for urlsafe in (False, True):
        for offset in (0, 1, 2):
            forms.add(_pure_base64(raw, offset, urlsafe))
    return {f for f in forms if len(f) >= MIN_FORM_LENGTH or f == raw}


def marker(length: int) -> bytes:
    if length >= len(MARKER):
        return MARKER + b"*" * (length - len(MARKER))
    return b"*" * length


class Redactor:
    """Finds every form of every secret; `redact` returns the redacted bytes and the secret names hit."""

    def __init__(self, secrets: dict[str, str]):
        self._owner: dict[bytes, str] = {}
        for name, value in secrets.items():
            if not value:
                continue
            for form in forms_of(value):
                self._owner.setdefault(form, name)
        forms = sorted(self._owner, key=len, reverse=True)
        self._pattern = re.compile(b"|".join(re.escape(f) for f in forms)) if forms else None
        self.max_length = max((len(f) for f in forms), default=0)

    def __bool__(self) -> bool:
        return self._pattern is not None

    def redact(self, data: bytes) -> tuple[bytes, list[str]]:
        if self._pattern is None or not data:
            return data, []
        hits: list[str] = []

        def replace(match: re.Match[bytes]) -> bytes:
            hits.append(self._owner[match.group(0)])
            return marker(len(match.group(0)))

        return self._pattern.sub(replace, data), hits

    def redact_text(self, text: str) -> tuple[str, list[str]]:
        data = text.encode("utf-8", "surrogateescape")
        redacted, hits = self.redact(data)
        return (redacted.decode("utf-8", "surrogateescape") if hits else text), hits


class StreamRedactor:
    """Redacts a body chunk by chunk; holds back at most `max_length - 1` bytes between chunks.

    Call it with each chunk and finally with b"" (mitmproxy's stream callable protocol)."""

    def __init__(self, redactor: Redactor, on_hit=None):
        self.redactor = redactor
        self.keep = max(redactor.max_length - 1, 0)
        self.pending = b""
        self.on_hit = on_hit

    def __call__(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        data, hits = self.redactor.redact(data)
        if hits and self.on_hit is not None:
            self.on_hit(hits)
        if not chunk:  # end of body: flush everything
            self.pending = b""
            return data
        cut = max(len(data) - self.keep, 0)
        self.pending = data[cut:]
        return data[:cut]


def redact_all(redactor: Redactor, chunks: Iterable[bytes]) -> bytes:
    stream = StreamRedactor(redactor)
    return b"".join(stream(c) for c in [*chunks, b""])
