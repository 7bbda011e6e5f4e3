"""The words of a refusal the gateway writes about a failure it did not decide (an upstream that
failed, a message mitmproxy could not parse), without the bytes that failed.

mitmproxy's error texts quote what they could not parse (`unexpected server response:
b'HTTP/1.1 200 OK\\r\\nX-Echo: ...'`): bytes an upstream chose, which may echo a credential the
gateway injected, or bytes the sandbox chose. A refusal page quotes none of them: every quoted
literal is withheld, the rest is cut to printable ASCII and a bounded length. The caller still passes
the text through the redactor, as a backstop.
"""

from __future__ import annotations

import ipaddress
import re

MAX_DETAIL = 160
WITHHELD = "<bytes withheld>"
# A Python repr of str or bytes, as mitmproxy's f"{data!r}" writes it, single- or double-quoted.
_QUOTED = re.compile(r"""b?'(?:[^'\\]|\\.)*'?|b?"(?:[^"\\]|\\.)*"?""", re.S)
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def _quoted(match: re.Match[str]) -> str:
    text = match.group(0)
    try:  # ('127.0.0.1', 443) in a connect error: the gateway's own pinned address, not upstream bytes
        ipaddress.ip_address(text.lstrip("b")[1:-1])
    except ValueError:
        return WITHHELD
    return text


def failure_detail(text: str) -> str:
    """`text` with every quoted literal withheld, printable ASCII only, at most MAX_DETAIL long."""
    cleaned = _UNPRINTABLE.sub("?", _QUOTED.sub(_quoted, text))
    return cleaned if len(cleaned) <= MAX_DETAIL else cleaned[: MAX_DETAIL - 3] + "..."
