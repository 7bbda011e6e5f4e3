"""What a secret value may be (gateway/secrets.py), for `{env: ...}` and `{file: ...}` alike, by
property: every byte string is either accepted as exactly the value the rules describe, or refused
with a message that names the secret and its source and says what is wrong, never what it is."""

from __future__ import annotations

import os
import re

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.credentials import SecretSource
from gateway.secrets import MAX_SECRET_BYTES, MIN_SECRET_BYTES, SecretStore, SecretUnavailable, parse_secret

VAR = "EGRESS_UNIT_SECRET"

# Every message a refusal may say: only the source, numbers and names of characters vary.
_MESSAGES = re.compile(
    r"secret 'tok' is unavailable: (?P<where>environment variable EGRESS_UNIT_SECRET|/\S+) ("
    r"is empty"
    r"|is not set"
    r"|holds \d+ bytes; a secret is at (most|least) \d+"
    r"|holds more than \d+ bytes; a secret is at most \d+"
    r"|is not UTF-8 text \(byte \d+\)"
    r"|contains (a line feed \(LF\)|a carriage return \(CR\)|a NUL byte|a tab|a DEL byte"
    r"|the control character U\+00[0-9A-F]{2}) at character \d+( \(a second line\?\))?: "
    r"a secret is one line of printable text"
    r"|(begins|ends) with a space, which HTTP strips from a header value: remove it where the secret is stored"
    r")\Z")


def expected(raw: bytes) -> str | None:
    """The rules, stated independently of the implementation: the value, or None (refused)."""
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    if not raw or not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text) or text[0] == " " or text[-1] == " ":
        return None
    return text


INTERESTING = st.sampled_from([b"\r", b"\n", b"\r\n", b"\x00", b"\t", b" ", b"\x7f", b"\x1b", b"\x0b", b"\x0c",
                               b"\xc2\x85", b"\xc2\xa0", b"\xe2\x80\xa8", b"\xff", b"\xc3", b"\xed\xa0\x80", b"%",
                               b"&", b"=", b"+", b"#", b"?", b"\\", b'"', b":", b",", b";"])
PIECES = st.one_of(INTERESTING, st.binary(min_size=1, max_size=6),
                   st.text(min_size=1, max_size=8).map(lambda t: t.encode("utf-8", "surrogatepass")))
VALUES = st.lists(PIECES, max_size=12).map(b"".join)


def _check(raw: bytes, store_of) -> None:
    want = expected(raw)
    store = store_of(raw)
    try:
        got = store.value("tok")
    except SecretUnavailable as exc:
        assert want is None, f"{raw!r} should have been accepted as {want!r}: {exc}"
        assert _MESSAGES.match(str(exc)), str(exc)
        assert store.known_values() == {} and "tok" in store.problems()
    else:
        assert got == want, (raw, got, want)
        assert store.known_values() == {"tok": want} and store.problems() == {}


@settings(max_examples=400, deadline=None)
@given(VALUES)
@example(b"tok-value\n")
@example(b"tok-value\r\n")
@example(b"tok-value\n\n")
@example(b"tok-value\r")
@example(b"tok\r\nX-Injected: 1")
@example(b" tok-value")
@example(b"tok-value ")
@example(b"tok value")
@example(b"t\xc3\xb6k-value")
@example(b"tok-value\xff")
@example(b"1234567")
@example(b"12345678\n")
@example(b"a" * MAX_SECRET_BYTES + b"\r\n")
@example(b"a" * (MAX_SECRET_BYTES + 1))
def test_env_values_by_property(raw):
    sources = {"tok": SecretSource("tok", env=VAR, file=None)}
    _check(raw, lambda value: SecretStore(sources, {os.fsencode(VAR): value}))
    if b"\x00" not in raw:  # str mappings (os.environ) hold the same bytes, surrogate-escaped
        _check(raw, lambda value: SecretStore(sources, {VAR: os.fsdecode(value)}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(VALUES)
@example(b"tok-value\r\n")
@example(b"line one\nline two\n")
@example(b"a" * (MAX_SECRET_BYTES + 3))
def test_file_values_by_property(tmp_path, raw):
    path = tmp_path / "secret"
    sources = {"tok": SecretSource("tok", env=None, file=str(path))}

    def store_of(value: bytes) -> SecretStore:
        fresh = tmp_path / "secret.new"
        fresh.write_bytes(value)
        os.replace(fresh, path)
        return SecretStore(sources, {})

    _check(raw, store_of)


def test_one_store_follows_a_file_from_valid_to_invalid_and_back(tmp_path):
    path = tmp_path / "secret"
    store = SecretStore({"tok": SecretSource("tok", env=None, file=str(path))}, {})
    for raw, want in ((b"good-one\n", "good-one"), (b"bad\none\n", None), (b"good-two\r\n", "good-two")):
        fresh = tmp_path / "new"
        fresh.write_bytes(raw)
        os.replace(fresh, path)
        if want is None:
            assert "tok" in store.problems()
        else:
            assert store.value("tok") == want


def test_a_refusal_says_where_and_what_never_the_value():
    sources = {"tok": SecretSource("tok", env=VAR, file=None)}
    store = SecretStore(sources, {VAR: "sk-live-abcdef\r\nX-Evil: 1"})
    why = store.problems()["tok"]
    assert why == (f"environment variable {VAR} contains a carriage return (CR) at character 15 (a second "
                   "line?): a secret is one line of printable text")
    assert "sk-live" not in why and "X-Evil" not in why


def test_unset_and_present_only():
    sources = {"tok": SecretSource("tok", env=VAR, file=None), "f": SecretSource("f", env=None, file="/nonexistent/x")}
    store = SecretStore(sources, {})
    assert set(store.problems()) == {"tok", "f"}
    assert store.problems(present_only=True) == {}
    assert parse_secret(b"x" * MIN_SECRET_BYTES + b"\n", "here") == "x" * MIN_SECRET_BYTES
