"""The encodings real servers use when they echo a value, made by real encoders (the standard
library's, or an imitation of another language's written from its documentation), never by the
redactor's own table: for random secrets of realistic shapes, each echo at any offset, split across
any chunk boundaries, is redacted."""

from __future__ import annotations

import base64
import html
import json
import string
import uuid
from urllib.parse import quote, quote_plus

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.redact import Redactor, SecretMemory, StreamRedactor, forms_of

B64 = string.ascii_letters + string.digits
_alnum = st.text(B64, min_size=1, max_size=1)


def _aws_secret(draw) -> str:  # 40 characters of base64 alphabet, with / and +
    return "".join(draw(st.lists(st.sampled_from(B64 + "/+"), min_size=40, max_size=40)))


@st.composite
def secrets(draw) -> str:
    """Realistic secrets are random: one that repeats itself ('0000...') is not one (its base64 forms
    at different alignments overlap, and redaction may leave an edge character; docs/credentials.md)."""
    value = draw(_shapes())
    assume(len(set(value)) >= 8)
    return value


@st.composite
def _shapes(draw) -> str:
    shape = draw(st.sampled_from(["aws", "hex", "uuid", "jwt", "sk", "ghp", "anthropic"]))
    if shape == "aws":
        return _aws_secret(draw)
    if shape == "hex":
        return draw(st.binary(min_size=16, max_size=32)).hex()
    if shape == "uuid":
        return str(uuid.UUID(bytes=draw(st.binary(min_size=16, max_size=16))))
    token = "".join(draw(st.lists(st.sampled_from(B64 + "-_"), min_size=20, max_size=60)))
    if shape == "jwt":
        head = base64.urlsafe_b64encode(b'{"alg":"RS256","typ":"JWT"}').rstrip(b"=").decode()
        return f"{head}.{token}.{token[::-1]}"
    return {"sk": "sk-", "ghp": "ghp_", "anthropic": "sk-ant-api03-"}[shape] + token


def _dotnet_json(s: str) -> str:  # System.Text.Json's default JavaScriptEncoder
    return json.dumps(s)[1:-1].translate({ord(c): f"\\u{ord(c):04X}" for c in "+&'<>`"})


def _go_json(s: str) -> str:  # encoding/json escapes HTML-sensitive characters
    return json.dumps(s)[1:-1].replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _go_html(s: str) -> str:  # html/template's htmlEscaper
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&#34;")
            .replace("'", "&#39;").replace("+", "&#43;"))


def _owasp_html(s: str) -> str:
    return "".join(c if c.isalnum() else f"&#x{ord(c):X};" for c in s)


def _mime(data: bytes) -> str:
    return base64.encodebytes(data).decode()  # 76 columns, \n


def _pem(data: bytes) -> str:
    text = base64.b64encode(data).decode()
    return "\r\n".join(text[i:i + 64] for i in range(0, len(text), 64))


# name -> (encoder of the secret, placed in a body of that kind)
REAL_ENCODERS = {
    "raw": lambda s: s,
    "json.dumps": lambda s: json.dumps(s)[1:-1],
    "php-json_encode": lambda s: json.dumps(s)[1:-1].replace("/", "\\/"),
    "dotnet-json": _dotnet_json,
    "go-json": _go_json,
    "json-ensure-all": lambda s: "".join(c if c.isalnum() else f"\\u{ord(c):04x}" for c in s),
    "html.escape": html.escape,
    "php-htmlspecialchars": lambda s: html.escape(s).replace("&#x27;", "&#039;"),
    "go-html-template": _go_html,
    "owasp-html": _owasp_html,
    "quote": quote,
    "quote-safe-none": lambda s: quote(s, safe=""),
    "quote-lower-hex": lambda s: "".join(p.lower() if p.startswith("%") else p for p in _split_escapes(quote(s, safe=""))),
    "quote_plus": quote_plus,
    "encodeURIComponent": lambda s: quote(s, safe="-_.!~*'()"),
    "java-URLEncoder": lambda s: quote_plus(s, safe="-_.*"),
    "hex": lambda s: s.encode().hex(),
    "HEX": lambda s: s.encode().hex().upper(),
    "hex-mixed-case": lambda s: "".join(c.upper() if i % 2 else c for i, c in enumerate(s.encode().hex())),
    "base64": lambda s: base64.b64encode(s.encode()).decode(),
    "base64url": lambda s: base64.urlsafe_b64encode(s.encode()).decode().rstrip("="),
    "basic-credential": lambda s: base64.b64encode(b"x-access-token:" + s.encode()).decode(),
    "json-of-base64-php": lambda s: base64.b64encode(b"u:" + s.encode()).decode().replace("/", "\\/"),
}


def _split_escapes(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        if text[i] == "%":
            out.append(text[i:i + 3])
            i += 3
        else:
            out.append(text[i])
            i += 1
    return out


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        if p > last:
            pieces.append(data[last:p])
            last = p
    pieces.append(data[last:])
    return pieces


def _streamed(redactor: Redactor, chunks: list[bytes]) -> bytes:
    stream = StreamRedactor(redactor)
    return b"".join([stream(c) for c in chunks] + [stream(b"")])


def _assert_gone(secret: str, echo: bytes, output: bytes) -> None:
    assert len(output) == len(echo)
    assert secret.encode() not in output
    assert b"[REDACTED]" in output or b"*" * 6 in output.replace(b"\0", b""), output[:200]


@settings(max_examples=400, deadline=None)
@given(secret=secrets(), encoder=st.sampled_from(sorted(REAL_ENCODERS)), before=st.text(max_size=40),
       after=st.text(max_size=40), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_every_real_encoding_is_redacted_at_any_offset_and_split(secret, encoder, before, after, cuts):
    redactor = Redactor({"key": secret})
    encoded = REAL_ENCODERS[encoder](secret).encode()
    body = json.dumps(before).encode() + b" " + encoded + b" " + json.dumps(after).encode()
    output = _streamed(redactor, _chunks(body, cuts))
    _assert_gone(secret, body, output)
    assert encoded not in output
    assert output == redactor.redact(body)[0]


@settings(max_examples=200, deadline=None)
@given(secret=secrets(), encoding=st.sampled_from(["utf-16-le", "utf-16-be", "utf-16", "utf-32-le", "utf-32-be", "utf-32"]),
       cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_text_bodies_in_utf16_and_utf32_are_redacted(secret, encoding, cuts):
    redactor = Redactor({"key": secret})
    body = json.dumps({"echo": secret, "note": "ok"}).encode(encoding)
    output = _streamed(redactor, _chunks(body, cuts))
    assert len(output) == len(body)
    assert secret not in output.decode(encoding, "replace")
    assert output.decode(encoding)  # still valid text of the same encoding


@settings(max_examples=200, deadline=None)
@given(secret=secrets(), wrap=st.sampled_from(["mime", "pem"]), lead=st.binary(max_size=120),
       tail=st.binary(max_size=60), cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_line_wrapped_base64_is_redacted_at_any_alignment(secret, wrap, lead, tail, cuts):
    """The secret somewhere inside a certificate-like or e-mail-like blob: the line breaks fall
    anywhere relative to it, and its base64 starts at any of the three alignments."""
    redactor = Redactor({"key": secret})
    blob = lead + secret.encode() + tail
    text = (_mime if wrap == "mime" else _pem)(blob).encode()
    body = b"-----BEGIN DATA-----\n" + text + b"\n-----END DATA-----\n"
    output = _streamed(redactor, _chunks(body, cuts))
    assert len(output) == len(body)
    assert output.count(b"\n") == body.count(b"\n")  # the line breaks stay where they were
    flat = output[len(b"-----BEGIN DATA-----\n"):-len(b"\n-----END DATA-----\n")].replace(b"\r", b"").replace(b"\n", b"")
    # Base64 characters that depend on the secret's bytes only: every one of them is a marker now.
    first, last = -(-8 * len(lead) // 6), (8 * (len(lead) + len(secret))) // 6
    assert set(flat[first:last]) <= set(b"[REDACTED]*"), flat[first:last]
    assert len(flat) == len(base64.b64encode(blob))


def test_the_table_names_what_each_row_mimics():
    from gateway.redact import ENCODINGS, ESCAPES

    for name, mimics, _ in (*ENCODINGS, *ESCAPES):
        assert name and len(mimics) > 8


def test_memory_keeps_redacting_a_value_after_rotation():
    memory = SecretMemory(limit=3)
    memory.remember({"token": "old-Value-1234567890"})
    memory.remember({"token": "new-Value-0987654321"})
    clean, hits = memory.redactor().redact(b"echo old-Value-1234567890 and new-Value-0987654321")
    assert b"Value" not in clean and hits == ["token", "token"]
    for i in range(3):
        memory.remember({"other": f"filler-value-{i:08d}"})
    assert not memory.holds(["old-Value-1234567890"])  # bounded: the oldest is forgotten first


def test_forms_include_the_escaped_variants():
    forms = forms_of("ab/cd+ef=gh")
    assert b"ab\\/cd+ef=gh" in forms  # PHP
    assert b"ab/cd\\u002bef=gh" in forms  # .NET
    assert b"ab/cd&#43;ef=gh" in forms  # Go html/template
