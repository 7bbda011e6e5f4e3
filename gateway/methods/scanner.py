"""The body scan (`BodyScanner`): a request body fed chunk by chunk, as sent and decoded, through
every reading `plan_body` plans, each with its parsers; sans I/O (`feed_steps`)."""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence

from ..steps import run_steps
from .body_plan import _WIDE, BodyPlan, plan_body
from .form import _Form
from .json_keys import _Json
from .multipart import _Multipart
from .overrides import Override


class BodyTooLarge(ValueError):
    """A compressed body decodes past the decoder's budget: it cannot be checked."""


CODINGS_CAP = 3  # stacked Content-Encodings decoded; more is refused


def body_parsers(content_types: Sequence[str]) -> list:
    """The parsers for one reading of a body with these Content-Type values."""
    return _parsers(plan_body(content_types))


def _parsers(plan: BodyPlan, form: type = _Form, multipart: type = _Multipart, json: type = _Json) -> list:
    """The parsers of one reading. The classes are parameters: the unabridged scanner the fast paths
    are tested against (bench/lib/methods_reference.py) is this one with parsers of its own."""
    charsets = plan.field_charsets
    parsers: list = []
    if plan.form:
        parsers.append(form(charsets))
    if plan.multipart:
        parsers += [multipart(b, charsets) for b in plan.boundaries]
        parsers.append(multipart(None, charsets, plan.boundaries))
    if plan.json:
        parsers.append(json())
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

    def __init__(self, plan: BodyPlan, parsers: Callable[[BodyPlan], list] = _parsers):
        self.plan = plan
        self._parsers = parsers
        self._head: bytearray | None = bytearray()
        self.readings: list[_Reading] = []

    def _start(self) -> None:
        head = bytes(self._head or b"")[: self.HEAD]
        self._head = None
        codecs_: list[str | None] = [None, *self.plan.charsets]
        self.readings = [_Reading(c, self._parsers(self.plan)) for c in codecs_]
        if self.plan.wide or head.startswith(_WIDE_BOMS):
            self.readings += [_Reading(c, self._parsers(self.plan)) for c in _WIDE]
        elif self.plan.json and b"\0" in head:
            self.readings += [_Reading(c, self._parsers(BodyPlan(json=True))) for c in _WIDE]  # JSON's alone

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

    make_parsers: Callable[[BodyPlan], list] = staticmethod(_parsers)  # one reading's (`_parsers`)

    def __init__(self, plan: BodyPlan, decoders: Sequence = (), problem: str | None = None):
        self.plan = plan
        self.decoders = list(decoders)  # outermost coding first (applied last by the sender)
        self._raw = _Stream(plan, self.make_parsers)
        self._decoded = _Stream(plan, self.make_parsers) if self.decoders else None
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
        from ..decompress import DecodedTooLarge, OverBudget

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
