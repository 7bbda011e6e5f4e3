"""Path globs (`paths:` in a rule), matched in time linear in the length of the path.

The language (docs/policy.md, `paths`) is a literal path with three wildcards: `*` is any run of
characters within one segment, `?` one character within a segment, `**` any run of characters at
all; a `/**` that ends the glob or is followed by `/` may also match nothing, so `/a/**` matches `/a`
and `/a/**/z` matches `/a/z`. Every other character (`[`, `{`, `\\`, `+`, ...) is itself. The
definition is `reference_regex`: the regular expression the loader used to compile a glob into.

Why the loader no longer uses that regex: Python's `re` backtracks. `/packages/**/*-*-*.whl`
against a 2.5 KB path of dashes (or `a-a-a-...`) tries every way of sharing the path out between `**` and the
three `*`s (cubic: seconds of CPU, 6 KB takes tens of seconds), inside the request hook, while every
other client of that worker waits. Matching must cost time linear in the path for every glob the
loader accepts, since the sandbox chooses the path.

Why not RE2 (google-re2, pyre2), which is linear: a native extension, to build or find a wheel for on
every platform the image is built for, for a language with no alternation, no groups and no
character classes; and its guarantee comes from a bounded DFA cache with an NFA fallback, which is
what this module does, in a page of Python, for exactly this language (its `re`-compatible API
would also be one more way to hand a glob to a backtracking engine by mistake).

How: a glob is a sequence of items (a literal character, `?`, `*`, `**`, and `/**` as an optional
`/` followed by `**`), and its Thompson NFA has one state per item boundary. A set of NFA states is
a bit mask, so one step of the NFA is a few integer operations whatever the number of active states
(the closure over the ε-moves of `*`/`**` is the carry of one addition). Those steps are run as a
lazily built DFA: each DFA state (a mask) gets a row of successors per character class (`/`, each
literal character of the glob, anything else), filled in on first use, so a warm match is one dict
and one list lookup per character. The cache holds at most `MAX_STATES` states per glob; a match
that needs more finishes on the bit-parallel NFA uncached (still linear, several times slower) and
the next match starts on an empty cache. A match also stops as soon as no NFA state is left (no
match possible), or as soon as a state holds a `**` followed only by what may match nothing
(everything that follows matches), and is refused without a step when the path does not start
with the glob's literal prefix or end with its literal suffix.
"""

from __future__ import annotations

import re
from itertools import islice

# Cached DFA states per glob (each a list of one int per character class); a match needing more
# finishes uncached. Globs seen in policies need a few dozen at most.
MAX_STATES = 1024

_LIT, _ONE, _SEG_STAR, _ANY_STAR, _OPT_SUBTREE = range(5)


def reference_regex(pattern: str) -> re.Pattern[str]:
    """The meaning of a glob as a Python regex (`.match`). It backtracks: for tests and benchmarks,
    never for matching requests."""
    if not pattern.startswith("/"):
        raise ValueError("a path glob must start with '/'")
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("/**", i) and (i + 3 == len(pattern) or pattern[i + 3] == "/"):
            out.append("(?:/.*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def _tokens(pattern: str) -> list[tuple[int, str]]:
    """The glob read the way `reference_regex` reads it."""
    out: list[tuple[int, str]] = []
    i, n = 0, len(pattern)
    while i < n:
        if pattern.startswith("/**", i) and (i + 3 == n or pattern[i + 3] == "/"):
            token, i = (_OPT_SUBTREE, ""), i + 3
            if out and out[-1] == token:
                continue  # (?:/.*)?(?:/.*)? is (?:/.*)?: `/a/**/**` is `/a/**`
        elif pattern.startswith("**", i):
            token, i = (_ANY_STAR, ""), i + 2
        elif pattern[i] == "*":
            token, i = (_SEG_STAR, ""), i + 1
        elif pattern[i] == "?":
            token, i = (_ONE, ""), i + 1
        else:
            token, i = (_LIT, pattern[i]), i + 1
        out.append(token)
    return out


class _Cache:
    """One glob's DFA so far. State 0 is dead (no match), 1 accepts whatever follows; a row holds,
    per character class, the next state or -1 (not computed yet)."""

    __slots__ = ("masks", "rows", "accepting", "ids", "start")

    def __init__(self, glob: "PathGlob") -> None:
        self.masks: list[int] = [0, -1]
        self.rows: list[list[int]] = [[], []]
        self.accepting: list[bool] = [False, True]
        self.ids: dict[int, int] = {}
        self.start = self.state(glob, glob._start_mask, limit=False)

    def state(self, glob: "PathGlob", mask: int, limit: bool = True) -> int:
        """The id of `mask`, added if new; -1 when the cache is full (and `limit`)."""
        sid = self.ids.get(mask)
        if sid is not None:
            return sid
        if mask == 0:
            sid = 0
        elif mask & glob._universal:
            sid = 1
        elif limit and len(self.masks) >= MAX_STATES + 2:
            return -1
        else:
            sid = len(self.masks)
            self.masks.append(mask)
            self.rows.append([-1] * glob._class_count)
            self.accepting.append(bool(mask & glob._accept))
        self.ids[mask] = sid
        return sid


class PathGlob:
    """A compiled path glob: `.match(path)` is True when the glob matches all of `path`."""

    __slots__ = (
        "pattern", "_literal", "_prefix", "_suffix", "_min_len", "_classes", "_class_count",
        "_one", "_star", "_eps", "_skip", "_accept", "_universal", "_start_mask", "_cache",
    )

    def __init__(self, pattern: str) -> None:
        if not pattern.startswith("/"):
            raise ValueError("a path glob must start with '/'")
        self.pattern = pattern
        tokens = _tokens(pattern)
        self._literal = pattern if all(kind == _LIT for kind, _ in tokens) else None
        lead = 0
        while lead < len(tokens) and tokens[lead][0] == _LIT:
            lead += 1
        trail = 0
        while trail < len(tokens) - lead and tokens[-1 - trail][0] == _LIT:
            trail += 1
        self._prefix = "".join(ch for _, ch in tokens[:lead])
        self._suffix = "".join(ch for _, ch in tokens[len(tokens) - trail :])
        self._min_len = sum(kind in (_LIT, _ONE) for kind, _ in tokens)

        # Character classes: 0 anything else, 1 '/', then each other literal character.
        self._classes: dict[str, int] = {"/": 1}
        for kind, ch in tokens:
            if kind == _LIT and ch not in self._classes:
                self._classes[ch] = len(self._classes) + 1
        count = self._class_count = len(self._classes) + 1
        not_slash = [x for x in range(count) if x != 1]

        # Items, one NFA state before each (bit i: "items before i matched"); bit len(items) accepts.
        # one[x]: states left by consuming one character of class x; star[x]: states that consume
        # one and stay; eps: the `*`/`**` states (ε to the next); skip: `/**` starts (ε over it).
        one, star = [0] * count, [0] * count
        eps = skip = 0
        items: list[int] = []  # kinds, for the "matches all that follows" analysis below
        for kind, ch in tokens:
            bit = 1 << len(items)
            if kind == _LIT:
                one[self._classes[ch]] |= bit
                items.append(_LIT)
            elif kind == _ONE:
                for x in not_slash:
                    one[x] |= bit
                items.append(_ONE)
            elif kind == _SEG_STAR:
                for x in not_slash:
                    star[x] |= bit
                eps |= bit
                items.append(_SEG_STAR)
            elif kind == _ANY_STAR:
                for x in range(count):
                    star[x] |= bit
                eps |= bit
                items.append(_ANY_STAR)
            else:  # `/**`: an optional '/' then `**`, skipped as a whole
                one[1] |= bit
                skip |= bit
                for x in range(count):
                    star[x] |= bit << 1
                eps |= bit << 1
                items += [_LIT, _ANY_STAR]
        self._one, self._star, self._eps, self._skip = one, star, eps, skip
        self._accept = 1 << len(items)
        # The closure does the ε-moves in one pass (`*` runs, then `/**` skips), which is complete
        # because a skip never lands on an ε-state: `/**` is followed by a literal '/' or the end
        # (consecutive ones are merged by _tokens).
        assert not ((skip << 2) & (eps | skip)), pattern

        # Once a `**` is reached from which the rest of the glob can match nothing, any rest matches.
        nullable = [False] * len(items) + [True]  # nullable[i]: items i.. can match ""
        for i in range(len(items) - 1, -1, -1):
            if (skip >> i) & 1:
                nullable[i] = nullable[i + 2]
            elif items[i] in (_SEG_STAR, _ANY_STAR):
                nullable[i] = nullable[i + 1]
        universal = 0
        for i, kind in enumerate(items):
            if kind == _ANY_STAR and nullable[i + 1]:
                universal |= 1 << i
        self._universal = universal
        self._start_mask = self._close(1 << lead)
        self._cache = _Cache(self)

    def _close(self, mask: int) -> int:
        eps = self._eps
        mask |= (eps + (mask & eps)) ^ eps  # through runs of `*` / `**` states: one carry each
        return mask | ((mask & self._skip) << 2)

    def _step(self, mask: int, x: int) -> int:
        return self._close(((mask & self._one[x]) << 1) | (mask & self._star[x]))

    def match(self, path: str) -> bool:
        if self._literal is not None:
            return path == self._literal
        if len(path) < self._min_len or not path.startswith(self._prefix) or not path.endswith(self._suffix):
            return False
        return self._run(path)

    def _run(self, path: str) -> bool:
        """The automaton over `path` after the literal prefix (which must be there): the whole cost
        of a match that the prefix, suffix and length checks let through."""
        cache = self._cache
        sid = cache.start
        if sid < 2:
            return sid == 1
        rows = cache.rows
        classes = self._classes.get
        rest = islice(path, len(self._prefix), None) if self._prefix else iter(path)
        for ch in rest:
            x = classes(ch, 0)
            nxt = rows[sid][x]
            if nxt < 2:
                if nxt >= 0:
                    return nxt == 1
                nxt = cache.state(self, self._step(cache.masks[sid], x))
                if nxt < 0:
                    self._cache = _Cache(self)  # full: the next match starts afresh
                    return self._simulate(self._step(cache.masks[sid], x), rest)
                rows[sid][x] = nxt
                if nxt < 2:
                    return nxt == 1
            sid = nxt
        return cache.accepting[sid]

    def _simulate(self, mask: int, rest) -> bool:
        """The rest of a match on the NFA alone, uncached: a few integer operations per character."""
        classes, one, star, eps, skip, universal = (
            self._classes.get, self._one, self._star, self._eps, self._skip, self._universal
        )
        for ch in rest:
            if not mask or mask & universal:
                break
            x = classes(ch, 0)
            mask = ((mask & one[x]) << 1) | (mask & star[x])
            mask |= (eps + (mask & eps)) ^ eps
            mask |= (mask & skip) << 2
        return bool(mask & (self._accept | universal))

    def __repr__(self) -> str:
        return f"PathGlob({self.pattern!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PathGlob) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash((PathGlob, self.pattern))

    def __reduce__(self):
        return PathGlob, (self.pattern,)
