"""Platform-held credentials: what a rule injects, and the placeholders sandboxes may hold instead.

A rule's `inject` entries are templates like `"Bearer ${secrets.github_token}"`, parsed once at
load. Values are looked up only when an approved request is about to leave (`SecretStore`), and
only ever written into that request. Placeholders are HMACs of (sandbox, secret name) under a key
the sandbox never sees: stable, unique per sandbox, and worthless anywhere but at the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets as random_source
from dataclasses import dataclass
from pathlib import Path

SECRET_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_REFERENCE_RE = re.compile(r"\$\{([^}]*)\}")
HEADER_NAME_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}\Z")
PLACEHOLDER_PREFIX = "egress-placeholder-"
PLACEHOLDER_KEY_FILE = "egress-placeholder.key"
# Headers that would change framing or routing if a template set them.
FORBIDDEN_INJECT_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer", "keep-alive",
     "proxy-connection", "expect", "http2-settings",
     # the sandbox's own hop to the gateway: never sent upstream (gateway/hopbyhop.py)
     "proxy-authorization"}
)


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Template:
    """Literal text with `${secrets.NAME}` references; `$${` is a literal `${`."""

    parts: tuple[tuple[str, str], ...]  # ("text", s) | ("secret", name)

    @classmethod
    def parse(cls, text: str) -> "Template":
        parts: list[tuple[str, str]] = []
        position = 0
        for match in _REFERENCE_RE.finditer(text):
            start = match.start()
            if start > 0 and text[start - 1] == "$":
                continue
            reference = match.group(1).strip()
            if not reference.startswith("secrets."):
                raise TemplateError(f"${{{reference}}}: only ${{secrets.NAME}} references are allowed")
            name = reference[len("secrets."):]
            if not SECRET_NAME_RE.match(name):
                raise TemplateError(f"${{{reference}}}: {name!r} is not a valid secret name")
            if start > position:
                parts.append(("text", text[position:start].replace("$${", "${")))
            parts.append(("secret", name))
            position = match.end()
        if position < len(text):
            parts.append(("text", text[position:].replace("$${", "${")))
        if any(c in text for c in "\r\n\x00"):
            raise TemplateError("a value cannot contain CR, LF or NUL")
        return cls(tuple(parts))

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for kind, name in self.parts if kind == "secret"))

    def render(self, values: dict[str, str]) -> str:
        return "".join(values[value] if kind == "secret" else value for kind, value in self.parts)


@dataclass(frozen=True)
class Injection:
    target: str  # "header" | "query"
    name: str
    template: Template


@dataclass(frozen=True)
class SecretSource:
    name: str
    env: str | None = None
    file: str | None = None

    @property
    def env_name(self) -> str:
        """The variable a sandbox would hold it in (for `placeholders`)."""
        return self.env or self.name.upper()


def load_placeholder_key(confdir: str | os.PathLike) -> bytes:
    """The HMAC key for placeholders: 32 random bytes in CONFDIR, created (0600) on first use."""
    path = Path(os.path.expanduser(confdir)) / PLACEHOLDER_KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = random_source.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key)
    finally:
        os.close(fd)
    return key


def placeholder(key: bytes, secret: str, sandbox: str | None) -> str:
    """Stable per (sandbox, secret); unguessable without the key; reveals nothing about the value."""
    message = f"{sandbox or '-'}\x00{secret}".encode()
    digest = hmac.new(key, message, hashlib.sha256).hexdigest()[:40]
    return f"{PLACEHOLDER_PREFIX}{secret}-{digest}"
