"""The unabridged method-override body scanner: gateway/methods/ with every fast path of its body
scan switched off, the oracle of the differential test (tests/unit/test_method_scan_fast.py: the
scanner must find exactly what this one finds) and bench/method_scan.py's "before"; in bench/lib
(with the benchmark's harness) so that bench/ imports no test internals.

What is off, and so checked by the test: the form scan's name filter, its memo and its memchr
walk (the form parser below walks every field with regexes, as the scanner did before them, and
reads every name in full), the multipart scan's skipping of parts whose header block cannot name
an override, and the JSON scan's skipping of nested values, plain members and escapes; with them
the caps that only bound what the fast paths leave over (fields, parts, JSON steps). The readings
themselves (charsets, decodings, names, values) are the scanner's own, so every reading it adds is
checked too. Until the split of gateway/methods.py this was a frozen 1,000-line copy of it as of
commit 1d064cd; that copy's reading had fallen behind (no RFC 2231 name continuations), and what it
shared with the scanner line for line checked nothing.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

from gateway.foreign import query_key
from gateway.methods import OVERRIDE_FIELDS, Override, form, json_keys, multipart, scanner
from gateway.methods.fields import FIELD_KEYS, NAME_CAP, VALUE_CAP, _judged, _texts

__all__ = ["OVERRIDE_FIELDS", "BodyScanner", "Override", "_override_names"]


def _override_names(raw: bytes, charsets: Sequence[str], percent: bool = True) -> list[str]:
    """The override names a field name may be read as, every reading in full (no `_may_be_key`)."""
    return [t for t in _texts(raw, charsets, percent) if query_key(t) in FIELD_KEYS]


class _Form(form._Form):
    """Every field walked one at a time with regexes (the walk before the memchr one), every name
    read in full (`_override_names` above), nothing remembered, no over-long name refused."""

    _STOP = re.compile(rb"[=&;]")
    _SEP = re.compile(rb"[&;]")

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


class _Multipart(multipart._Multipart):
    """Every part's header block read in full: none skipped unread, however plain."""

    SLOW_PARTS_CAP = math.inf

    def _parts_pattern(self) -> None:
        return None


class _Json(json_keys._Json):
    """One structural character at a time: nothing skipped (an empty match), no member taken whole
    (a pattern that never matches), no step budget."""

    _STRING_BODY = _DEEP = re.compile(b"")
    _MEMBERS = re.compile(b"(?!)")
    STEPS_FREE = math.inf


class BodyScanner(scanner.BodyScanner):
    make_parsers = staticmethod(functools.partial(scanner._parsers, form=_Form, multipart=_Multipart, json=_Json))
