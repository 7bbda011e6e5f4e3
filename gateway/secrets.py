"""Secret values, read where the policy says and never written anywhere but an approved request.

`{env: VAR}` is read once, at load. `{file: PATH}` is re-read whenever the file behind the path
changes: `os.stat` follows symlinks, so a Kubernetes Secret volume's `..data` symlink swap (a new
inode) is seen on the next request, without a restart. One trailing newline is dropped.

Errors never carry a value: a missing secret is reported by name only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .credentials import SecretSource


class SecretUnavailable(Exception):
    """A secret that cannot be read; the message names the secret, never a value."""

    def __init__(self, name: str, why: str):
        self.name = name
        super().__init__(f"secret {name!r} is unavailable: {why}")


@dataclass
class _Cached:
    key: tuple
    value: str


class SecretStore:
    def __init__(self, sources: dict[str, SecretSource], environ: dict[str, str] | None = None):
        self.sources = dict(sources)
        self._environ = os.environ if environ is None else environ
        self._env_values: dict[str, str | None] = {
            name: self._environ.get(src.env) for name, src in self.sources.items() if src.env
        }
        self._files: dict[str, _Cached] = {}
        self.generation = 0  # bumped whenever any value changes (redaction patterns follow it)

    def value(self, name: str) -> str:
        source = self.sources.get(name)
        if source is None:
            raise SecretUnavailable(name, "not declared in the policy")
        if source.env:
            value = self._env_values.get(name)
            if not value:
                raise SecretUnavailable(name, f"environment variable {source.env} is not set or empty")
            return value
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
                raw = handle.read(1 << 20)
        except OSError as exc:
            self._forget(name)
            raise SecretUnavailable(name, f"cannot read {path}: {exc.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SecretUnavailable(name, f"{path} is not UTF-8 text") from None
        if text.endswith("\n"):
            text = text[:-1]
            if text.endswith("\r"):
                text = text[:-1]
        if not text:
            raise SecretUnavailable(name, f"{path} is empty")
        if any(c in text for c in "\r\n\x00"):
            raise SecretUnavailable(name, f"{path} holds more than one line")
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
