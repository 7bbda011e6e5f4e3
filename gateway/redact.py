"""Redaction of secret values in what flows back to the sandbox.

Each secret is searched in every form an upstream is likely to echo it in: raw, base64 and
base64url (alone, or at any byte alignment inside a longer base64 blob such as a Basic
credential), lower- and upper-case hex, and URL-encoding. Replacements keep the length of what
they replace, so Content-Length stays true and streamed bodies can be redacted chunk by chunk,
holding back only a tail that could still become a form.
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
        # Every proper prefix of every form, and every byte any form contains: what a streamed
        # body's tail must be to be held back (built once, at load).
        self._prefixes = frozenset(f[:i] for f in forms for i in range(1, len(f)))
        self._alphabet = frozenset(b for f in forms for b in f)

    def __bool__(self) -> bool:
        return self._pattern is not None

    def redact(self, data: bytes) -> tuple[bytes, list[str]]:
        clean, _, hits = self.redact_prefix(data, len(data))
        return clean, hits

    def redact_prefix(self, data: bytes, cut: int) -> tuple[bytes, int, list[str]]:
        """Redacts `data[:end]` and returns (redacted bytes, end, secret names hit): `end` is `cut`,
        or the end of a match that starts before `cut` and runs past it (never split a match)."""
        if self._pattern is None or not data:
            return data[:cut], cut, []
        pieces: list[bytes] = []
        hits: list[str] = []
        pos = 0
        for match in self._pattern.finditer(data):
            if match.start() >= cut:
                break
            pieces.append(data[pos:match.start()])
            pieces.append(marker(match.end() - match.start()))
            hits.append(self._owner[match.group(0)])
            pos = match.end()
        end = max(cut, pos)
        pieces.append(data[pos:end])
        return b"".join(pieces), end, hits

    def held_suffix(self, data: bytes) -> int:
        """Length of the longest suffix of `data` that is a proper prefix of some form: the bytes
        that more data could still turn into a secret.

        Why that is enough: a form matching at position s < len(data) - held_suffix is either whole
        inside `data` already, or `data[s:]` would be a proper prefix of it (and s would be in the
        held suffix); and no longer form can still grow at s for the same reason. So every match
        that starts before the cut is final, whatever comes next."""
        if not self._prefixes:
            return 0
        run = 0  # a prefix can only be made of bytes that occur in some form
        limit = min(len(data), self.max_length - 1)
        while run < limit and data[-1 - run] in self._alphabet:
            run += 1
        for length in range(run, 0, -1):
            if data[-length:] in self._prefixes:
                return length
        return 0

    def redact_text(self, text: str) -> tuple[str, list[str]]:
        data = text.encode("utf-8", "surrogateescape")
        redacted, hits = self.redact(data)
        return (redacted.decode("utf-8", "surrogateescape") if hits else text), hits


class StreamRedactor:
    """Redacts a body chunk by chunk, holding back only what could still become a secret form.

    After each chunk it keeps the longest suffix of what it has seen that is a proper prefix of some
    form (`Redactor.held_suffix`), and passes on everything before it, redacted. Ordinary text, and
    every event that ends in a byte no form contains (SSE's blank line, NDJSON's newline), flows
    through with no delay; a secret split across chunks is still caught whole. Nothing is flushed on
    a timer: the held bytes are exactly those that the next chunk could turn into a secret, so
    releasing them early would release a piece of one.

    Call it with each chunk and finally with b"" (mitmproxy's stream callable protocol). It returns
    b"" when it has nothing to pass on yet: the caller must treat that as "nothing", never as the
    end of the body (the gateway's HTTP/1 writers drop empty pieces)."""

    def __init__(self, redactor: Redactor, on_hit=None):
        self.redactor = redactor
        self.pending = b""
        self.on_hit = on_hit

    def __call__(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        # At the end of the body (b"") everything goes; otherwise the tail that could still become
        # a form waits. A match starting before the cut is final (see Redactor.held_suffix).
        cut = len(data) - self.redactor.held_suffix(data) if chunk else len(data)
        clean, end, hits = self.redactor.redact_prefix(data, cut)
        self.pending = data[end:]
        if hits and self.on_hit is not None:
            self.on_hit(hits)
        return clean


def redact_all(redactor: Redactor, chunks: Iterable[bytes]) -> bytes:
    stream = StreamRedactor(redactor)
    return b"".join(stream(c) for c in [*chunks, b""])
