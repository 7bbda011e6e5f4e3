"""Request paths as the policy sees them, and the globs that match them.

Path rules are matched against a normalised path that is at least as "wide" as what any common
server would make of the request: percent-encodings are decoded (repeatedly, so double encoding
cannot hide a `..`), backslashes count as slashes, `;params` are dropped from segments (Tomcat's
`/..;/`), empty segments collapse and dot segments are resolved. A request whose path cannot be
normalised safely (NUL, control bytes, invalid UTF-8, climbing above the root) is refused.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

from .globs import PathGlob

MAX_DECODE_ROUNDS = 4


class PathError(ValueError):
    """A request target that cannot be normalised; always a 400."""


def _decode_fully(text: str) -> str:
    for _ in range(MAX_DECODE_ROUNDS):
        if "%" not in text:
            return text
        decoded_bytes = unquote_to_bytes(text)
        try:
            decoded = decoded_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise PathError("path is not valid UTF-8 after percent-decoding") from None
        if decoded == text:
            return text
        text = decoded
    if "%" in text and re.search(r"%[0-9A-Fa-f]{2}", text):
        raise PathError("path is percent-encoded too many times")
    return text


def check_target(target: str) -> None:
    """Refuse what no request target may hold, since the raw target is what goes upstream: a
    space or tab (an HTTP/2 :path with one splits the HTTP/1 request line) or '#' (the check
    would ignore what follows it, an upstream might not)."""
    if any(ch in target for ch in " \t#"):
        raise PathError("space, tab or '#' in the request target")


def normalise_path(target: str) -> str:
    """The path part of an origin-form target (query dropped), normalised for matching."""
    if target == "*":
        return "*"
    path = target.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        raise PathError("request target must start with '/'")
    try:
        # Raw bytes that are not UTF-8 reach here as surrogates (mitmproxy's surrogateescape).
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise PathError("path is not valid UTF-8") from None
    path = _decode_fully(path)
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise PathError("control character in path")
    path = path.replace("\\", "/")
    segments: list[str] = []
    for raw_segment in path.split("/"):
        segment = raw_segment.split(";", 1)[0]
        if segment in ("", "."):
            continue
        if segment == "..":
            if not segments:
                raise PathError("path climbs above the root")
            segments.pop()
            continue
        segments.append(segment)
    normalised = "/" + "/".join(segments)
    if path.endswith("/") and segments:
        normalised += "/"
    return normalised


def compile_glob(pattern: str) -> PathGlob:
    """`*` = any run of characters within one segment, `**` = any number of segments,
    `?` = one character within a segment. `/a/**` matches `/a` and everything below it.
    Matching is linear in the path (gateway/globs.py)."""
    return PathGlob(pattern)
