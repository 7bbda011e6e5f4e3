"""JSON bodies (`_Json`): the keys of the top-level object, where Laravel and Slim read `_method`."""

from __future__ import annotations

import json
import re

from ..foreign import query_key
from .fields import NAME_CAP
from .name_filter import _KEYISH_END, _KEYISH_WORD
from .overrides import FIELD_KEYS, Override, _elements

_TOO_MANY_STEPS = ("its JSON has too many keys or nested values the gateway must read one by one (escaped or "
                   "named like an override, or nested more than 8 levels)")


class _Json:
    """A JSON body: the keys of the top-level object (where Laravel and Slim read `_method`). The
    scan jumps from one structural character to the next, so long strings (a model prompt) cost
    one regex search each."""

    _STRUCT = re.compile(rb'["{}\[\],:]')
    _IN_STRING = re.compile(rb'["\\]')
    _SPACE = b" \t\r\n"
    # Fast paths, each over bytes the step-by-step scan would read to the same end: inside a nested
    # value, everything but brackets and whole strings (no key is read there); at the top level,
    # whole `"key": value,` members whose key cannot be an override key (no escape, `%` or NUL, so
    # its text is its bytes, and no `_KEYISH` word in it) and whose value is scalars and strings.
    # Possessive: a string that does not end in this chunk is given up at once, not retried.
    _STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
    # Balanced brackets (of any kind: the depth count does not match kinds either), strings in them
    # skipped whole, to _NESTED levels: one regex step for `[]`, `{"a":1}`, `[[0.1,0.2],[0.3]]`.
    _STR = rb'"(?:[^"\\]++|\\.)*+"'
    _GROUP = rb'[\[{](?:[^"{}\[\]]++|' + _STR + rb')*+[\]}]'
    for _ in range(7):
        _GROUP = rb'[\[{](?:[^"{}\[\]]++|' + _STR + rb'|' + _GROUP + rb')*+[\]}]'
    _DEEP = re.compile(rb'(?:[^"{}\[\]]++|' + _STR + rb'|' + _GROUP + rb')*+', re.DOTALL)
    # A key without `%`, NUL or an escape of an ASCII character (`\u005f`): its text is its bytes but
    # for escapes of control characters, quotes, slashes and non-ASCII characters, none of which is a
    # letter of the words. query_key strips what such an escape decodes to (`"_method\t"`), so a
    # backslash after the word counts as its end.
    _KEY_BODY = rb'(?:[^"\\%\x00]++|\\[^u%\x00]|\\u(?!00[0-7])[0-9A-Fa-f]{4})*+'
    _MEMBERS = re.compile(rb'(?:[ \t\r\n]*+"(?!(?:[^"\\]|\\.)*?' + _KEYISH_WORD + rb'(?![^' + _KEYISH_END + rb'"\\]))'
                          + _KEY_BODY + rb'"[ \t\r\n]*+:(?:[^"{}\[\],]++|' + _STR + rb'|' + _GROUP + rb')*+,)+',
                          re.DOTALL)

    # Steps the scan takes one by one (each a few regex calls and, for a key, json.loads and
    # query_key): past STEPS_FREE plus one per STEP_BYTES bytes read (and 4 per chunk), the body is refused as
    # uncheckable. What the fast paths leave to them: keys with `%`, a NUL, an escaped ASCII
    # character or a word of an override key, values nested more than 8 levels, the pieces of a
    # member cut by a chunk boundary. Real bodies need a handful per chunk; a body of a million
    # `"\u0061":1` members or 10,000-level nesting would hold the event loop for seconds.
    STEPS_FREE = 20_000
    STEP_BYTES = 8  # a translations file of keys like "payment method 123" needs ~6 steps a key

    def __init__(self) -> None:
        self._started = False
        self._dead = False  # not an object at the top, or past its end: no keys to find
        self._steps = 0
        self._budget = self.STEPS_FREE
        self.problem: str | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False  # a backslash ended the last chunk
        self._capture: bytearray | None = None
        self._capturing = ""  # key | value
        self._expect_key = False
        self._value_for: str | None = None  # an override key whose value comes next

    def feed(self, data: bytes, found: list[Override]) -> None:
        pos, end = 0, len(data)
        self._budget += end // self.STEP_BYTES + 4  # a chunk boundary costs a few steps (a cut member)
        while pos < end and not self._dead:
            self._steps += 1
            if self._steps > self._budget:
                self.problem, self._dead = _TOO_MANY_STEPS, True
                return
            if not self._started:
                while pos < end and data[pos] in self._SPACE:
                    pos += 1
                if pos == end:
                    return
                if data[pos] != ord("{"):
                    self._dead = True
                    return
                self._started = True
            if self._in_string:
                if self._escape:
                    self._keep(data[pos:pos + 1])
                    self._escape = False
                    pos += 1
                    continue
                if self._capture is None or len(self._capture) > NAME_CAP:  # nothing kept: skip escapes at once
                    pos = self._STRING_BODY.match(data, pos).end()
                m = self._IN_STRING.search(data, pos)
                stop = m.start() if m else end
                self._keep(data[pos:stop])
                if m is None:
                    return
                if data[stop] == ord("\\"):
                    self._keep(b"\\")
                    self._escape = True
                    pos = stop + 1
                    continue
                pos = stop + 1
                self._in_string = False
                self._end_string(found)
                continue
            if self._depth >= 2:
                pos = self._DEEP.match(data, pos).end()
            elif self._depth == 1 and self._expect_key and (fast := self._MEMBERS.match(data, pos)):
                pos = fast.end()
                self._value_for = None
                continue
            m = self._STRUCT.search(data, pos)
            if m is None:
                return
            pos = m.end()
            c = data[m.start()]
            if c == ord('"'):
                self._in_string = True
                if self._depth == 1 and self._expect_key:
                    self._capture, self._capturing = bytearray(), "key"
                elif self._depth == 1 and self._value_for is not None:
                    self._capture, self._capturing = bytearray(), "value"
            elif c in b"{[":
                self._depth += 1
                if self._depth == 1:
                    self._expect_key = True
                elif self._depth == 2:
                    self._value_for = None  # an object or array is not a method name
            elif c in b"}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._dead = True
            elif self._depth == 1 and c == ord(","):
                self._expect_key, self._value_for = True, None
            elif self._depth == 1 and c == ord(":"):
                self._expect_key = False

    def _keep(self, piece: bytes) -> None:
        if self._capture is not None and len(self._capture) <= NAME_CAP:
            self._capture += piece[: NAME_CAP + 1 - len(self._capture)]

    def _end_string(self, found: list[Override]) -> None:
        raw, kind = self._capture, self._capturing
        self._capture, self._capturing = None, ""
        if raw is None:
            return
        text = None
        if len(raw) <= NAME_CAP:
            try:
                text = json.loads(b'"' + bytes(raw) + b'"')
            except ValueError:
                text = None
        if kind == "key":
            self._expect_key = False
            self._value_for = text if text is not None and query_key(text) in FIELD_KEYS else None
        elif self._value_for is not None:
            key, self._value_for = self._value_for, None
            if text is None:
                found.append(Override("json", key[:64], None))
            else:
                found += [Override("json", key[:64], m) for m in _elements(text)]

    def finish(self, found: list[Override]) -> None:
        self._dead = True

    pending = False  # a JSON string must be closed to count: the end of the body adds nothing
