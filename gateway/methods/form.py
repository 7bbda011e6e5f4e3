"""application/x-www-form-urlencoded bodies (`_Form`): every field named like an override, read
chunk by chunk, its complete fields picked by the name filter."""

from __future__ import annotations

from collections.abc import Sequence

from .fields import (LONG_HEAD, NAME_CAP, SLOW_FIELDS_CAP, VALUE_CAP, _PADDING, _TOO_MANY, _judged, _long_suspect,
                     _override_names)
from .name_filter import _IDENTITY, _KEY_AT_START, _NameFilter, _spelled
from .overrides import MAX_ELEMENTS, Override

def _first(data: bytes, a: bytes, b: bytes) -> int:
    """The index of the first `a` or `b` in `data`, or -1."""
    i, j = data.find(a), data.find(b)
    return j if i < 0 else i if j < 0 else min(i, j)


_MEMO_CAP = 256  # distinct names (and values under override names) a form parser remembers


class _Form:
    """application/x-www-form-urlencoded (and a body without Content-Type, which Rack parses as a
    form): `name=value` fields split at `&` (and `;`, looser than any server).

    The complete fields inside a chunk are not walked one by one: `_NameFilter` picks, in a few
    passes over all of them, those whose name could be an override name, and only those are read
    (`_step`, the same reading as for the field a chunk starts or ends in). A field it leaves out
    would have been read as no override and skipped, so the findings are the same."""

    _SEMI = bytes.maketrans(b";", b"&")

    def __init__(self, charsets: Sequence[str] = ()) -> None:
        self._charsets = tuple(charsets)
        self._state = "name"  # name | value | skip
        self._name = bytearray()
        self._value = bytearray()
        self._names: list[str] = []
        self._filter = _NameFilter.for_charsets(self._charsets)
        self._fields = 0  # read one by one, without a fast path
        self._full = 0  # distinct fields the fast path could not rule out, read in full
        self.problem: str | None = None
        # A field repeated a million times (`_method=GET&...`) is read once: both are pure.
        self._names_of: dict[bytes, list[str]] = {}
        self._judged_of: dict[tuple, list[Override]] = {}
        self._field_of: dict[bytes, list[Override]] = {}
        # The over-long name in progress: may it hold an override (`_LONG_SUSPECT`), and its last
        # bytes (a "method" split across chunks). Every distinct refusal is reported once.
        self._long_suspect = False
        self._long_tail = b""
        self._long_head = bytearray()
        self._long_length = 0
        self._long_found: set[Override] = set()
        self._long_triggers = b"".join(_IDENTITY[c] for c in self._charsets) if self._filter is not None else b""

    def _suspect(self, piece: bytes) -> bool:
        if self._filter is None:
            return True  # a charset read only field by field (EBCDIC, UTF-16/32): any bytes may spell it
        return _long_suspect(piece) or any(t in piece for t in self._long_triggers)

    def _long_verdict(self, length: int) -> bool:
        """May the over-long name now ended (its first LONG_HEAD bytes in `_long_head`) be an override?"""
        if not self._long_suspect:
            return False  # no "method", `%` or trigger anywhere
        if self._filter is None or self._long_triggers or self._filter._words is not _KEY_AT_START:
            return True
        head = bytes(self._long_head)
        if length > len(head) and _PADDING.match(head).end() > len(head) - NAME_CAP:
            return True  # padding too long to see past
        return _KEY_AT_START.match(_spelled(head, self._filter._rounds)) is not None

    def _long_name(self, piece: bytes) -> None:
        """`piece` of a name already past NAME_CAP (the kept bytes were looked at before)."""
        if not self._long_suspect and piece:
            # the piece, and where it meets the last one's tail (a "method" split across chunks)
            self._long_suspect = self._suspect(piece) or self._suspect(self._long_tail + piece[:5])
            self._long_tail = (self._long_tail + piece)[-5:] if len(piece) < 5 else piece[-5:]

    def feed(self, data: bytes, found: list[Override]) -> None:
        if self.problem is not None:
            return
        if self._filter is None:
            self._fields += data.count(b"&") + data.count(b";")
            if self._fields > SLOW_FIELDS_CAP:
                self.problem = _TOO_MANY
                return
            self._step(data, found)
            return
        first = _first(data, b"&", b";")
        if first < 0:
            self._step(data, found)
            return
        last = max(data.rfind(b"&"), data.rfind(b";"))
        self._step(data[: first + 1], found)  # the field in progress ends here
        if last > first:
            fields = data[first + 1: last].translate(self._SEMI)
            pieces = fields.split(b"&")
            for index in self._filter.candidates(fields):
                self._field(pieces[index], found)
                if self.problem is not None:
                    return
        self._step(data[last + 1:], found)

    def _step(self, data: bytes, found: list[Override]) -> None:
        # `;` separates as `&` does and is kept in no name or value: one byte to look for, with
        # bytes.find (memchr) rather than a regex class, which reads ~20x slower. Each find's result
        # is kept until passed, so that a chunk of many fields is still read in one pass.
        if b";" in data:
            data = data.translate(self._SEMI)
        pos, end = 0, len(data)
        amp = equals = -2  # the next `&` / `=` at or after pos (-1: none left; -2: not looked for)
        while pos < end:
            if amp != -1 and amp < pos:
                amp = data.find(b"&", pos)
            if self._state == "name":
                if equals != -1 and equals < pos:
                    equals = data.find(b"=", pos, amp if amp >= 0 else end)
                    if equals < 0 and amp >= 0:
                        equals = -2  # none before this `&`: look again past it
                stop = min(i for i in (amp, equals, end) if i >= 0)
                more = stop < end
                if len(self._name) <= NAME_CAP:
                    room = NAME_CAP + 1 - len(self._name)
                    self._name += data[pos:min(stop, pos + room)]
                    if len(self._name) > NAME_CAP:
                        self._long_name(bytes(self._name))
                        self._long_name(data[pos + room:stop])
                        self._long_head += self._name
                        self._long_head += data[pos + room:stop][: LONG_HEAD - len(self._long_head)]
                        self._long_length = len(self._name) + stop - pos - room
                else:
                    self._long_name(data[pos:stop])
                    if len(self._long_head) < LONG_HEAD:
                        self._long_head += data[pos:stop][: LONG_HEAD - len(self._long_head)]
                    self._long_length += stop - pos
                if not more:
                    return
                pos = stop + 1
                if data[stop] == ord("=") and len(self._name) <= NAME_CAP:
                    self._names = self._override_names(bytes(self._name))
                    self._state = "value" if self._names else "skip"
                elif data[stop] == ord("="):
                    self._state = "skip"
                    if self._long_verdict(self._long_length):
                        refused = Override("form", bytes(self._name[:64]).decode("utf-8", "replace"), None)
                        if refused not in self._long_found and len(self._long_found) < MAX_ELEMENTS:
                            self._long_found.add(refused)
                            found.append(refused)
                self._name.clear()
                self._long_suspect, self._long_tail, self._long_length = False, b"", 0
                self._long_head.clear()
            else:
                stop = amp if amp >= 0 else end
                more = amp >= 0
                if self._state == "value" and len(self._value) <= VALUE_CAP:
                    self._value += data[pos:stop][: VALUE_CAP + 1 - len(self._value)]
                if not more:
                    return
                pos = stop + 1
                self._close(found)

    def _field(self, field: bytes, found: list[Override]) -> None:
        """One whole field (no `&` or `;`), read from the `name` state back to it: what it yields
        depends on its bytes only."""
        if b"=" not in field:
            return  # a name alone is no field: `_step` drops it
        judged = self._field_of.get(field)
        if judged is None:
            self._full += 1
            if self._full > SLOW_FIELDS_CAP:
                self.problem = _TOO_MANY
                return
            if len(field) > NAME_CAP + VALUE_CAP + 2:
                self._step(field + b"&", found)
                return
            if len(self._field_of) >= _MEMO_CAP:
                self._field_of.clear()
            judged = self._field_of[field] = []
            self._step(field + b"&", judged)
        found += judged

    def _override_names(self, name: bytes) -> list[str]:
        names = self._names_of.get(name)
        if names is None:
            if len(self._names_of) >= _MEMO_CAP:
                self._names_of.clear()
            names = self._names_of[name] = _override_names(name, self._charsets)
        return names

    def _close(self, found: list[Override]) -> None:
        if self._state == "value":
            key = (tuple(self._names), bytes(self._value))
            judged = self._judged_of.get(key)
            if judged is None:
                if len(self._judged_of) >= _MEMO_CAP:
                    self._judged_of.clear()
                judged = self._judged_of[key] = _judged("form", self._names, key[1], self._charsets, percent=True)
            found += judged
        self._state = "name"
        self._value.clear()
        self._name.clear()
        self._long_suspect, self._long_tail, self._long_length = False, b"", 0
        self._long_head.clear()

    def finish(self, found: list[Override]) -> None:
        if self.problem is None:
            self._close(found)

    @property
    def pending(self) -> bool:
        return self._state == "value"

