"""Secret values, read where the policy says and never written anywhere but an approved request.

`{env: VAR}` is read once, at load. `{file: PATH}` is re-read whenever the file behind the path
changes: `os.stat` follows symlinks, so a Kubernetes Secret volume's `..data` symlink swap (a new
inode) is seen on the next request, without a restart.

Both kinds obey the same rules (`parse_secret`), because a value goes verbatim into a header line
or a URL: one trailing line break (LF or CRLF: a Kubernetes Secret made with `--from-file`, an
`echo` into a file) is dropped; what is left must be UTF-8 text of `MIN_SECRET_BYTES` to
`MAX_SECRET_BYTES` bytes with no control character (C0, DEL, C1: CR, LF and NUL would split or end a header) and no
space at either end (HTTP strips that from a header value, so the upstream would get another
secret than the one stored). Anything else makes the secret unavailable, with an error naming the
secret and where it was looked for, never the value.

Errors never carry a value: a missing secret is reported by name only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .credentials import SecretSource

# A header credential longer than this does not fit the header-line limits of common servers
# (nginx and Apache allow 8 KiB for a whole line) with room for the name and the template.
MAX_SECRET_BYTES = 4096
# A shorter value is guessable, and redacting its raw form from every response (headers of all
# requests included) would rewrite innocent text: a one-character secret "1" rewrites every
# Content-Length holding a 1.
MIN_SECRET_BYTES = 8

_NAMED_CONTROLS = {"\n": "a line feed (LF)", "\r": "a carriage return (CR)", "\x00": "a NUL byte",
                   "\t": "a tab", "\x7f": "a DEL byte"}


class SecretUnavailable(Exception):
    """A secret that cannot be read; the message names the secret, never a value."""

    def __init__(self, name: str, why: str):
        self.name = name
        self.why = why
        super().__init__(f"secret {name!r} is unavailable: {why}")


def _control(char: str) -> bool:
    code = ord(char)
    return code < 0x20 or 0x7F <= code <= 0x9F


def parse_secret(raw: bytes, where: str) -> str:
    """The secret value held in `raw`, or ValueError saying what is wrong with it (never what it is).

    `where` names the source in the message: "environment variable X" or a path."""
    if raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    if not raw:
        raise ValueError(f"{where} is empty")
    if len(raw) > MAX_SECRET_BYTES:
        raise ValueError(f"{where} holds {len(raw)} bytes; a secret is at most {MAX_SECRET_BYTES}")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} holds {len(raw)} bytes; a secret is at least {MIN_SECRET_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not UTF-8 text (byte {exc.start + 1})") from None
    for position, char in enumerate(text, 1):
        if _control(char):
            what = _NAMED_CONTROLS.get(char, f"the control character U+{ord(char):04X}")
            more = " (a second line?)" if char in "\r\n" else ""
            raise ValueError(f"{where} contains {what} at character {position}{more}: a secret is one line "
                             "of printable text")
    for edge, char in (("begins", text[0]), ("ends", text[-1])):
        if char == " ":
            raise ValueError(f"{where} {edge} with a space, which HTTP strips from a header value: "
                             "remove it where the secret is stored")
    return text


@dataclass
class _Cached:
    key: tuple
    value: str


class SecretStore:
    def __init__(self, sources: dict[str, SecretSource], environ: Mapping | None = None):
        """`environ` maps variable names to values, as bytes (like os.environb, the default where
        the platform has it: the bytes exactly as the process got them) or str (like os.environ)."""
        self.sources = dict(sources)
        if environ is None:
            environ = getattr(os, "environb", os.environ)
        bytes_keyed = environ is getattr(os, "environb", None) or any(
            isinstance(key, bytes) for key in itertools.islice(environ, 1))
        self._env_values: dict[str, str] = {}
        self._env_errors: dict[str, str] = {}  # name -> why its variable cannot be used
        self._env_unset: set[str] = set()
        for name, source in self.sources.items():
            if source.env:
                try:
                    self._env_values[name] = self._read_env(source.env, environ, bytes_keyed)
                except KeyError:
                    self._env_unset.add(name)
                    self._env_errors[name] = f"environment variable {source.env} is not set"
                except ValueError as exc:
                    self._env_errors[name] = str(exc)
        self._files: dict[str, _Cached] = {}
        self.generation = 0  # bumped whenever any value changes (redaction patterns follow it)

    @staticmethod
    def _read_env(variable: str, environ: Mapping, bytes_keyed: bool) -> str:
        where = f"environment variable {variable}"
        raw = environ.get(os.fsencode(variable) if bytes_keyed else variable)
        if raw is None:
            raise KeyError(variable)
        if isinstance(raw, str):
            raw = os.fsencode(raw)  # undoes os.environ's surrogateescape decoding: the bytes as set
        return parse_secret(raw, where)

    def value(self, name: str) -> str:
        source = self.sources.get(name)
        if source is None:
            raise SecretUnavailable(name, "not declared in the policy")
        if source.env:
            if name in self._env_errors:
                raise SecretUnavailable(name, self._env_errors[name])
            return self._env_values[name]
        return self._file_value(name, source.file)

    def _file_value(self, name: str, path: str) -> str:
        try:
            st = os.stat(path)
        except OSError as exc:
            self._forget(name)
            raise SecretUnavailable(name, f"cannot stat {path}: {exc.strerror}") from None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._files.get(name)
        if cached is not None and cached.key == key:
            return cached.value
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_SECRET_BYTES + 3)  # enough to tell "too long" from a value and its CRLF
        except OSError as exc:
            self._forget(name)
            raise SecretUnavailable(name, f"cannot read {path}: {exc.strerror}") from None
        if len(raw) > MAX_SECRET_BYTES + 2:
            raise SecretUnavailable(name, f"{path} holds more than {MAX_SECRET_BYTES} bytes; "
                                    f"a secret is at most {MAX_SECRET_BYTES}")
        try:
            text = parse_secret(raw, path)
        except ValueError as exc:
            raise SecretUnavailable(name, str(exc)) from None
        if cached is None or cached.value != text:
            self.generation += 1
        self._files[name] = _Cached(key, text)
        return text

    def _forget(self, name: str) -> None:
        if self._files.pop(name, None) is not None:
            self.generation += 1

    def values(self, names) -> dict[str, str]:
        return {name: self.value(name) for name in names}

    def known_values(self) -> dict[str, str]:
        """Every value readable right now (for redaction); unreadable ones are skipped."""
        found = {}
        for name in self.sources:
            try:
                found[name] = self.value(name)
            except SecretUnavailable:
                continue
        return found

    def problems(self, present_only: bool = False) -> dict[str, str]:
        """name -> why, for every secret that cannot be used right now (the start-up log). With
        `present_only`, only those whose variable is set or whose file exists (what `check` reports,
        run where the secrets may well be absent)."""
        found = {}
        for name, source in self.sources.items():
            if present_only and (name in self._env_unset if source.env else not os.path.lexists(source.file)):
                continue
            try:
                self.value(name)
            except SecretUnavailable as exc:
                found[name] = exc.why
        return found
