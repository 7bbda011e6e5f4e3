"""What a refusal's body says, and in which format: the policy's `refusals:` (a message template and
`text`, `json` or `negotiate`), compiled once at load and rendered per refusal.

An agent that is refused should be able to tell its user what was blocked and how to ask for it,
instead of trying another way round: so the body can be JSON with fixed keys, and can carry the
platform's own words ("ask in #platform-access, quoting rule {rule}"). Headers are not decided
here (addons/respond.py): they are the same in every format but Content-Type.

Nothing the sandbox sent can shape the body: a template names only the fixed `PLACEHOLDERS`, whose
values the gateway decided (the parsed host, the rule, the sandbox); every value, and the gateway's
own wording, is stripped of control and format characters (`clean`) and capped, and the whole body
is bounded (`MAX_BODY_BYTES`) whatever the values are.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .ratelimit import retry_after_header

if TYPE_CHECKING:
    from .decision import Decision

FORMATS = ("text", "json", "negotiate")
PLACEHOLDERS = ("reason", "rule", "host", "status", "sandbox")
UNKNOWN_VALUE = "(none)"  # what a placeholder with no value (no rule, no host, no sandbox) renders as

MAX_TEMPLATE_CHARS = 500
MAX_VALUE_CHARS = 255  # one substituted value (a DNS name is at most 253)
MAX_MESSAGE_CHARS = 1000  # the rendered message
MAX_DETAIL_CHARS = 500  # the gateway's own explanation of the refusal
MAX_NOTES = 8
MAX_NOTE_CHARS = 200
MAX_BODY_BYTES = 16384  # what any rendered body stays under (tests/unit/test_refusal_page.py proves it)
MAX_ACCEPT_CHARS = 1024  # of an Accept header, what negotiation reads
MAX_ACCEPT_RANGES = 32

TEXT_TYPE = "text/plain; charset=utf-8"
JSON_TYPE = "application/json"

# Characters a template may not contain (the JSON Schema's pattern says the same): C0 and C1
# controls, and the line and paragraph separators.
_TEMPLATE_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
# Unicode categories never let into a body from a value: controls, format characters (bidi
# overrides, zero-width), surrogates (undecodable bytes kept by surrogateescape), line separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
REPLACEMENT = "\ufffd"


class MessageTemplateError(ValueError):
    """A message template that cannot be compiled (the policy loader reports it at its key)."""


def clean(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """`value` as text safe to put in a body: every control, format or separator character
    replaced by U+FFFD, and at most `limit` characters (a cut one ends in an ellipsis)."""
    text = str(value)
    if not (text.isascii() and text.isprintable()):
        text = "".join(REPLACEMENT if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in text)
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return text


@dataclass(frozen=True)
class MessageTemplate:
    """A compiled message template: literal pieces and placeholder names, in order."""

    text: str
    parts: tuple[tuple[bool, str], ...]  # (is a placeholder, literal text or placeholder name)

    @classmethod
    def parse(cls, text: str) -> "MessageTemplate":
        """`{name}` for a placeholder, `{{` and `}}` for literal braces; raises MessageTemplateError."""
        if not text:
            raise MessageTemplateError("must not be empty")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise MessageTemplateError(f"is {len(text)} characters long, more than {MAX_TEMPLATE_CHARS}")
        if (bad := _TEMPLATE_FORBIDDEN.search(text)) is not None:
            raise MessageTemplateError(f"contains the control character U+{ord(bad.group()):04X} at offset {bad.start()} "
                                "(a message is one line of printable text)")
        parts: list[tuple[bool, str]] = []
        literal: list[str] = []
        end = 0
        for match in _TEMPLATE_TOKEN.finditer(text):
            literal.append(text[end:match.start()])
            end = match.end()
            token = match.group()
            if token in ("{{", "}}"):
                literal.append(token[0])
                continue
            name = match.group(1)
            if name is None:
                raise MessageTemplateError(f"unmatched {token!r} at offset {match.start()} (write {token * 2} for a literal one)")
            if name not in PLACEHOLDERS:
                allowed = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                raise MessageTemplateError(f"unknown placeholder {token} (allowed: {allowed})")
            if literal:
                parts.append((False, "".join(literal)))
                literal = []
            parts.append((True, name))
        literal.append(text[end:])
        if "".join(literal):
            parts.append((False, "".join(literal)))
        return cls(text, tuple(parts))

    def render(self, values: dict[str, str]) -> str:
        """The message with each placeholder's value (already cleaned), capped at MAX_MESSAGE_CHARS."""
        rendered = "".join(values[piece] if placeholder else piece for placeholder, piece in self.parts)
        return clean(rendered, MAX_MESSAGE_CHARS)


@dataclass(frozen=True)
class Page:
    """A refusal's body and the Content-Type it is sent with."""

    content_type: str
    body: bytes


@dataclass(frozen=True)
class RefusalStyle:
    """A policy's `refusals:`: the message template (None: the gateway's own wording only) and the
    format. Compiled at load; `page` is all the per-refusal work."""

    template: MessageTemplate | None = None
    format: str = "text"

    def page(self, decision: "Decision", host: str | None = None, sandbox: str | None = None,
             accept: str | None = None) -> Page:
        """The body for `decision`. `host`: the destination as the gateway parsed it (None when it
        was never known); `sandbox`: the client's sandbox id; `accept`: the request's Accept header
        (None before any request was parsed), read only by `negotiate`."""
        as_json = self.format == "json" or (self.format == "negotiate" and prefers_json(accept))
        return json_page(self, decision, host, sandbox) if as_json else text_page(self, decision, host, sandbox)

    def message(self, decision: "Decision", host: str | None, sandbox: str | None) -> str | None:
        if self.template is None:
            return None
        return self.template.render(_values(decision, host, sandbox))


DEFAULT_STYLE = RefusalStyle()


def _values(decision: "Decision", host: str | None, sandbox: str | None) -> dict[str, str]:
    def value(raw: object) -> str:
        return UNKNOWN_VALUE if raw is None else clean(raw)

    return {"reason": value(decision.reason), "rule": value(decision.rule), "host": value(host),
            "status": str(decision.status), "sandbox": value(sandbox)}


def _notes(decision: "Decision") -> list[str]:
    notes = [clean(note, MAX_NOTE_CHARS) for note in decision.notes[:MAX_NOTES]]
    if len(decision.notes) > MAX_NOTES:
        notes.append(f"({len(decision.notes) - MAX_NOTES} more notes)")
    return notes


def text_page(style: RefusalStyle, decision: "Decision", host: str | None, sandbox: str | None) -> Page:
    """The text body: the policy's message (if it sets one) on the first line, then the gateway's
    own lines as they always were (`egress gateway: ...`, `reason:`, `rule:`, the notes)."""
    lines = []
    message = style.message(decision, host, sandbox)
    if message is not None:
        lines.append(message)
    lines += [f"egress gateway: {clean(decision.message, MAX_DETAIL_CHARS)}", f"reason: {clean(decision.reason)}"]
    if decision.rule:
        lines.append(f"rule: {clean(decision.rule)}")
    lines += _notes(decision)
    return Page(TEXT_TYPE, ("\n".join(lines) + "\n").encode("utf-8"))


def json_page(style: RefusalStyle, decision: "Decision", host: str | None, sandbox: str | None) -> Page:
    """The JSON body, one object under `error` whose keys are always all there (null when unknown);
    docs/policy.md "Refusals" is its reference."""
    detail = clean(decision.message, MAX_DETAIL_CHARS)
    message = style.message(decision, host, sandbox)
    retry_after = decision.retry_after
    error = {
        "reason": clean(decision.reason),
        "status": decision.status,
        "message": detail if message is None else message,
        "detail": detail,
        "rule": None if decision.rule is None else clean(decision.rule),
        "host": None if host is None else clean(host),
        "sandbox": None if sandbox is None else clean(sandbox),
        "retry_after": None if retry_after is None else int(retry_after_header(retry_after)),  # as Retry-After
        "notes": _notes(decision),
    }
    body = json.dumps({"error": error}, ensure_ascii=False, separators=(", ", ": ")) + "\n"
    return Page(JSON_TYPE, body.encode("utf-8"))


_JSON_RANGES = ("application/json", "application/*", "*/*")
_TEXT_RANGES = ("text/plain", "text/*", "*/*")


def _qvalue(params: list[str]) -> float:
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return 0.0
            return min(max(q, 0.0), 1.0) if q == q else 0.0  # NaN: not acceptable
    return 1.0


def prefers_json(accept: str | None) -> bool:
    """Whether an Accept header prefers application/json to text/plain (RFC 9110 12.5.1: each type
    takes the q of the most specific range that matches it). A tie goes to JSON only when
    application/json is named more specifically than text/plain, or as specifically and earlier
    (`application/json, text/plain, */*` is JSON; `*/*` and no Accept at all are text)."""
    if not accept:
        return False
    best: dict[str, tuple[int, int, float]] = {}  # kind -> (specificity, -position, q) of its range
    for position, item in enumerate(accept[:MAX_ACCEPT_CHARS].split(",")[:MAX_ACCEPT_RANGES]):
        media, *params = item.split(";")
        media = media.strip().lower()
        for kind, ranges in (("json", _JSON_RANGES), ("text", _TEXT_RANGES)):
            if media in ranges:
                specificity = 2 - ranges.index(media)
                if kind not in best or specificity > best[kind][0]:
                    best[kind] = (specificity, -position, _qvalue(params))
    json_rank = best.get("json", (0, 0, 0.0))
    text_rank = best.get("text", (0, 0, 0.0))
    if json_rank[2] <= 0.0:
        return False
    return (json_rank[2], json_rank[0], json_rank[1]) > (text_rank[2], text_rank[0], text_rank[1])
