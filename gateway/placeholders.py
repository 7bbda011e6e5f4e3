"""Where a placeholder may be swapped for its secret, and what is refused instead.

Leak class: the sandbox chooses the bytes around the secret. A placeholder written right after
`%2` in a URL (`?q=%2<placeholder>`) would be swapped for the URL-encoded secret, whose first hex
digit then completes the sandbox's `%2` into an escape; an upstream reflecting the decoded query
hands back the secret with one character re-encoded, which no redaction form matches. So a
placeholder is swapped only where it stands **as a whole token in a position the rule allows**,
and a request with a placeholder anywhere else is refused (403 `placeholder_misuse`):

- a header value: the whole value, or a whole token of it delimited by spaces, tabs or commas
  (`Bearer <ph>`, `a, <ph>`); swapped raw. Never in a header *name*, never in `Cookie` (a cookie is
  always `name=value`, and frameworks URL-decode cookie values);
- the whole value of a query parameter the rule names (`placeholders.query`, matched as sent);
  swapped percent-encoded (`quote(value, safe="")`), so it cannot add `&`, `=`, `+` or `#`;
- a whole path segment, only if the rule says `placeholders.path: true`; swapped percent-encoded.

"Placeholder anywhere else" is judged generously: the mark `egress-placeholder` in any case,
however often percent-encoded (`egress%2Dplaceholder-...`, `%2565gress-...`), in header names and
values, path, query names and values and fragment. A token that has the exact shape but is not one
this sandbox holds for a secret the rule is bound to (another sandbox's, another secret's, a forged
one) is refused too: on a bound request every placeholder is either swapped or refused. Headers the
rule injects are replaced whole, so what the sandbox sent there is never looked at. Bodies are never
swapped and never scanned (module docstring of gateway/foreign.py and README say why).

Pure: `plan` looks at (name, value) header pairs and the request target and returns the swaps to
make (`Swaps`, rendered with the secret values later) or the first misuse (`Misuse`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, unquote_plus

from .credentials import PLACEHOLDER_PREFIX

MARK = PLACEHOLDER_PREFIX.rstrip("-")  # "egress-placeholder"
DECODE_ROUNDS = 4  # like request paths: enough for double and triple encoding
# Token delimiters inside a header value: whitespace and list commas (RFC 9110 5.6.1).
_HEADER_SPLIT = re.compile(r"([ \t,]+)")
# What `gateway.credentials.placeholder` makes: the mark, a secret name, 40 lower-case hex digits.
PLACEHOLDER_SHAPE = re.compile(r"egress-placeholder-([A-Za-z_][A-Za-z0-9_]{0,63})-[0-9a-f]{40}\Z")

Part = tuple[str, str]  # ("text", s) | ("secret", name)


@dataclass(frozen=True)
class Positions:
    """Where a rule lets a placeholder be swapped besides header values (always allowed)."""

    query: frozenset[str] = frozenset()  # parameter names, as sent, whose whole value may be one
    path: bool = False  # a whole path segment

    def describe(self) -> str:
        query = f"the whole value of query parameters [{', '.join(sorted(self.query))}]" if self.query else None
        path = "a whole path segment" if self.path else None
        extra = [p for p in (query, path) if p]
        return "a whole header value or a whole space/comma-delimited token of one" + (
            "; " + "; ".join(extra) if extra else "")


NO_POSITIONS = Positions()


@dataclass(frozen=True)
class Misuse:
    """A placeholder where it is never swapped. `location` names the place, never a value."""

    location: str  # header name | header NAME | cookie | query parameter name | query parameter NAME | path | fragment
    why: str


@dataclass(frozen=True)
class Swaps:
    """The swaps one request gets: new header values and request target, as text and secret parts."""

    headers: dict[int, tuple[Part, ...]] = field(default_factory=dict)  # index in the header list -> value
    target: tuple[Part, ...] | None = None  # None: the target is unchanged
    secrets: tuple[str, ...] = ()  # names swapped in, in order

    def __bool__(self) -> bool:
        return bool(self.headers) or self.target is not None

    def header_value(self, index: int, values: Mapping[str, str]) -> str:
        """Raw: a header value carries the secret as it is (CR, LF and NUL cannot be in one)."""
        return "".join(values[v] if kind == "secret" else v for kind, v in self.headers[index])

    def new_target(self, values: Mapping[str, str]) -> str:
        return "".join(encode_for_url(values[v]) if kind == "secret" else v for kind, v in self.target or ())


def encode_for_url(value: str) -> str:
    """Every reserved character escaped (a raw value could add '&', '=', '+', '#', '/' to the URL and
    come back from a parsing upstream in pieces no redaction form matches); a value of only dots
    could make a dot segment, so its dots are escaped too."""
    encoded = quote(value, safe="")
    if encoded.strip(".") == "":
        encoded = encoded.replace(".", "%2E")
    return encoded


def _decodings(text: str) -> Iterator[str]:
    yield text
    for _ in range(DECODE_ROUNDS):
        if "%" not in text and "+" not in text:
            return
        decoded = unquote_plus(unquote(text, errors="replace"), errors="replace")
        if decoded == text:
            return
        text = decoded
        yield text


def looks_like_placeholder(text: str) -> bool:
    """Does `text` hold the placeholder mark, in any case, however often percent-encoded?"""
    if not text:
        return False
    return any(MARK in view.casefold() for view in _decodings(text))


class ShapeTokens(Mapping[str, str]):
    """Stands in for a sandbox's real placeholders where the HMAC key is not at hand (explain,
    replay): any well-formed placeholder of one of `secrets` counts as that sandbox's."""

    def __init__(self, secrets: Sequence[str]):
        self._secrets = frozenset(secrets)

    def __getitem__(self, token: str) -> str:
        match = PLACEHOLDER_SHAPE.match(token)
        if match is None or match.group(1) not in self._secrets:
            raise KeyError(token)
        return match.group(1)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def _why(piece: str, tokens: Mapping[str, str], rule: str, elsewhere: str | None = None) -> str:
    """Why a piece holding the mark is not swapped."""
    if piece in tokens:
        return elsewhere or "placeholders are not swapped here"
    if PLACEHOLDER_SHAPE.match(piece):
        return (f"not a placeholder this sandbox holds for a secret rule {rule} injects "
                "(another sandbox's, another secret's, or made up); it is never swapped")
    if any(PLACEHOLDER_SHAPE.match(view.lower()) for view in _decodings(piece)):
        return "a placeholder is swapped only exactly as issued: not re-cased, not percent-encoded"
    return ("a placeholder is swapped only where it stands as a whole token, never run together with "
            "other characters")


def plan(headers: Sequence[tuple[str, str]], target: str, tokens: Mapping[str, str], positions: Positions,
         rule: str = "", replaced_headers: frozenset[str] = frozenset(),
         replaced_query: frozenset[str] = frozenset()) -> Swaps | Misuse:
    """The swaps for one request bound to a rule, or the first place a placeholder is misused.

    `tokens`: this sandbox's placeholders for the rule's secrets, placeholder -> secret name.
    `replaced_headers` (lower case) and `replaced_query` (decoded names): what the rule injects,
    which replaces whatever the sandbox sent there (so it is not looked at)."""
    swapped: list[str] = []
    header_swaps: dict[int, tuple[Part, ...]] = {}
    for index, (name, value) in enumerate(headers):
        lower = name.lower()
        if lower in replaced_headers:
            continue
        if looks_like_placeholder(name):
            return Misuse("header name", "a placeholder in a header name is never swapped")
        if lower == "cookie":
            if looks_like_placeholder(value):
                return Misuse("cookie", "placeholders are never swapped in Cookie (a cookie is a name=value "
                              "pair, and frameworks URL-decode cookie values)")
            continue
        parts: list[Part] = []
        hit = False
        for piece in _HEADER_SPLIT.split(value):
            if _swap(piece, tokens, parts, swapped):
                hit = True
            elif looks_like_placeholder(piece):
                return Misuse(f"header {name[:64]}", _why(piece, tokens, rule))
            elif piece:
                parts.append(("text", piece))
        if hit:
            header_swaps[index] = tuple(parts)
        elif looks_like_placeholder(value):  # spread over several tokens
            return Misuse(f"header {name[:64]}", _why(value, tokens, rule))

    target_parts, target_hit, misuse = _plan_target(target, tokens, positions, rule, replaced_query, swapped)
    if misuse is not None:
        return misuse
    return Swaps(header_swaps, tuple(target_parts) if target_hit else None, tuple(dict.fromkeys(swapped)))


def _swap(token: str, tokens: Mapping[str, str], parts: list[Part], swapped: list[str]) -> bool:
    """Is this whole token one of the sandbox's placeholders? If so, its secret goes in its place."""
    secret = tokens.get(token) if token else None
    if secret is None:
        return False
    parts.append(("secret", secret))
    swapped.append(secret)
    return True


def _plan_target(target: str, tokens: Mapping[str, str], positions: Positions, rule: str,
                 replaced_query: frozenset[str], swapped: list[str]) -> tuple[list[Part], bool, Misuse | None]:
    before_fragment, hash_mark, fragment = target.partition("#")
    path, question, query = before_fragment.partition("?")
    parts: list[Part] = []
    hit = False
    # the path
    if positions.path:
        for i, segment in enumerate(path.split("/")):
            if i:
                parts.append(("text", "/"))
            if _swap(segment, tokens, parts, swapped):
                hit = True
            elif looks_like_placeholder(segment):
                return parts, hit, Misuse("path", _why(segment, tokens, rule))
            else:
                parts.append(("text", segment))
    else:
        if looks_like_placeholder(path):
            pieces = [s for s in path.split("/") if looks_like_placeholder(s)]
            return parts, hit, Misuse("path", _why(pieces[0] if pieces else path, tokens, rule,
                                                   f"rule {rule} does not swap placeholders in the path "
                                                   "(placeholders: {path: true} allows whole segments)"))
        parts.append(("text", path))
    # the query: pairs split at '&' and at the first '=', as mitmproxy and most upstreams do
    if question:
        parts.append(("text", "?"))
        for i, pair in enumerate(query.split("&")):
            if i:
                parts.append(("text", "&"))
            name, equals, value = pair.partition("=")
            if looks_like_placeholder(name):
                return parts, hit, Misuse("query parameter name", "a placeholder in a query parameter name is "
                                          "never swapped")
            if unquote_plus(name, errors="surrogateescape") in replaced_query:
                parts.append(("text", pair))  # the rule's own injection replaces this pair
                continue
            secret = tokens.get(value) if equals and value else None
            if secret is not None and name in positions.query:
                parts += [("text", name + equals), ("secret", secret)]
                swapped.append(secret)
                hit = True
            elif looks_like_placeholder(value):
                elsewhere = (f"rule {rule} does not swap placeholders in query parameter {name[:64]!r} "
                             "(list it under placeholders.query)")
                return parts, hit, Misuse(f"query parameter {name[:64]}", _why(value, tokens, rule, elsewhere))
            else:
                parts.append(("text", pair))
    if hash_mark:
        if looks_like_placeholder(fragment):
            return parts, hit, Misuse("fragment", "a placeholder in a fragment is never swapped")
        parts.append(("text", "#" + fragment))
    return parts, hit, None
