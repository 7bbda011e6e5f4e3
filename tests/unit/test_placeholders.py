"""gateway/placeholders.py: a placeholder is swapped only as a whole token where the rule allows it;
anything else holding one is a misuse. Named cases for every shape of the leak class, and
hypothesis for the open-ended part: around a placeholder, any bytes the sandbox likes; the result
is either a swap of exactly the whole tokens in allowed positions, or a refusal, never a swap
anywhere else."""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.placeholders import (
    MARK,
    Misuse,
    Positions,
    ShapeTokens,
    Swaps,
    encode_for_url,
    looks_like_placeholder,
    plan,
)

PH = "egress-placeholder-tok-" + "3f" * 20
OTHER_SANDBOX = "egress-placeholder-tok-" + "a1" * 20  # same shape, not this sandbox's
OTHER_SECRET = "egress-placeholder-other-" + "3f" * 20
TOKENS = {PH: "tok"}
SECRET = "S3cr%2F&=+#/x y?"  # every character a URL parser splits or decodes at
VALUES = {"tok": SECRET}
ALLOW_QUERY = Positions(frozenset({"api_key"}), False)
ALLOW_PATH = Positions(frozenset(), True)


def _header(value: str, name: str = "X-Key", positions: Positions = ALLOW_QUERY):
    return plan([(name, value)], "/v1", TOKENS, positions, "r")


def _target(target: str, positions: Positions = ALLOW_QUERY):
    return plan([], target, TOKENS, positions, "r")


# --- what is swapped ----------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (PH, SECRET),
    (f"Bearer {PH}", f"Bearer {SECRET}"),
    (f"token\t{PH}", f"token\t{SECRET}"),
    (f"a, {PH}", f"a, {SECRET}"),
    (f"{PH},{PH}", f"{SECRET},{SECRET}"),
    (f"prefix {PH} suffix", f"prefix {SECRET} suffix"),
])
def test_whole_header_tokens_are_swapped_raw(value, expected):
    swaps = _header(value)
    assert isinstance(swaps, Swaps) and swaps.secrets == ("tok",)
    assert swaps.header_value(0, VALUES) == expected
    assert swaps.target is None


def test_every_header_line_of_a_multi_valued_header():
    swaps = plan([("X-Key", PH), ("x-key", f"b, {PH}"), ("X-Other", "plain")], "/", TOKENS, ALLOW_QUERY, "r")
    assert set(swaps.headers) == {0, 1}
    assert swaps.header_value(1, VALUES) == f"b, {SECRET}"


def test_a_named_query_parameter_is_swapped_percent_encoded():
    swaps = _target(f"/v1/x?a=1&api_key={PH}&b=2")
    assert swaps.new_target(VALUES) == f"/v1/x?a=1&api_key={quote(SECRET, safe='')}&b=2"
    assert not set("&=+#/?") & set(quote(SECRET, safe=""))  # the value adds nothing a parser splits at


def test_a_whole_path_segment_when_the_rule_allows_it():
    swaps = _target(f"/bot/{PH}/getMe?x=1", ALLOW_PATH)
    assert swaps.new_target(VALUES) == f"/bot/{quote(SECRET, safe='')}/getMe?x=1"


def test_nothing_to_swap_changes_nothing():
    swaps = plan([("Authorization", "Bearer mine")], "/v1/x?q=1", TOKENS, ALLOW_QUERY, "r")
    assert not swaps and swaps.target is None and swaps.headers == {}


def test_injected_headers_and_parameters_are_not_looked_at():
    """They are replaced whole by the injection, whatever the sandbox put there."""
    swaps = plan([("X-Api-Key", f"%2{PH}")], f"/v?api%5Fkey=%2{PH}", TOKENS, Positions(), "r",
                 replaced_headers=frozenset({"x-api-key"}), replaced_query=frozenset({"api_key"}))
    assert isinstance(swaps, Swaps) and not swaps


def test_dot_only_values_cannot_make_a_dot_segment():
    assert encode_for_url("..") == "%2E%2E"
    assert encode_for_url("a.b") == "a.b"


# --- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("headers, target, location", [
    ([], f"/v1/x?q=%2{PH}", "query parameter q"),                     # the example
    ([], f"/v1/x?api_key=%2{PH}", "query parameter api_key"),         # named, but not the whole value
    ([], f"/v1/x?q={PH}", "query parameter q"),                       # whole value, parameter not named
    ([], f"/v1/x?API_KEY={PH}", "query parameter API_KEY"),           # names are matched as sent
    ([], f"/v1/x?api%5Fkey={PH}", "query parameter api%5Fkey"),
    ([], f"/v1/x?{PH}=1", "query parameter name"),
    ([], f"/v1/x?{PH}", "query parameter name"),
    ([], f"/v1/x?api_key={PH};x=1", "query parameter api_key"),
    ([], f"/v1/{PH}/x", "path"),                                      # the rule does not allow the path
    ([], f"/v1/x#{PH}", "fragment"),
    ([], "/v1/x?api_key=egress%2Dplaceholder-tok-" + "3f" * 20, "query parameter api_key"),  # split by %-encoding
    ([], "/v1/x?api_key=%2565gress-placeholder-tok-" + "3f" * 20, "query parameter api_key"),  # twice encoded
    ([], f"/v1/x?api_key={PH.upper()}", "query parameter api_key"),
    ([("X-Key", f"%2{PH}")], "/", "header X-Key"),
    ([("X-Key", f"xx{PH}yy")], "/", "header X-Key"),
    ([("X-Key", f'"{PH}"')], "/", "header X-Key"),
    ([("X-Key", f"k={PH}")], "/", "header X-Key"),
    ([("X-Key", PH.upper())], "/", "header X-Key"),
    ([("X-Key", "EGRESS%2dPLACEHOLDER-tok")], "/", "header X-Key"),
    ([("X-Key", OTHER_SANDBOX)], "/", "header X-Key"),                # another sandbox's
    ([("X-Key", OTHER_SECRET)], "/", "header X-Key"),                 # a secret this rule is not bound to
    ([("X-Key", "egress-placeholder-tok-made-up")], "/", "header X-Key"),
    ([("X-" + PH, "1")], "/", "header name"),
    ([("Cookie", f"s={PH}")], "/", "cookie"),
    ([("Cookie", PH)], "/", "cookie"),
    ([("X-Ok", PH), ("X-Key", f"{PH}x")], "/", "header X-Key"),       # one good swap does not excuse another
])
def test_misuse_names_where(headers, target, location):
    result = plan(headers, target, TOKENS, ALLOW_QUERY, "r")
    assert isinstance(result, Misuse), result
    assert result.location == location
    assert SECRET not in result.why


def test_the_path_is_refused_in_any_segment_shape_when_allowed_too():
    for target in (f"/v1/{PH}x/y", f"/v1/x{PH}", f"/v1/{PH};p", f"/v1/%2{PH}"):
        result = _target(target, ALLOW_PATH)
        assert isinstance(result, Misuse) and result.location == "path", target


def test_the_why_says_what_went_wrong():
    assert "not a placeholder this sandbox holds" in _header(OTHER_SANDBOX).why
    assert "exactly as issued" in _header(PH.upper()).why
    assert "exactly as issued" in _target("/v?api_key=egress%2Dplaceholder-tok-" + "3f" * 20).why
    assert "whole token" in _header(f"x{PH}").why
    assert "placeholders.query" in _target(f"/v?q={PH}").why
    assert "path: true" in _target(f"/v/{PH}").why


@pytest.mark.parametrize("text", [
    MARK, "EGRESS-PLACEHOLDER", "egress%2Dplaceholder", "egress%252Dplaceholder", "%65gress-placeholder",
    "egreſſ-placeholder",  # case-folds to "egress"
])
def test_looks_like_placeholder(text):
    assert looks_like_placeholder(f"x{text}y")


@pytest.mark.parametrize("text", ["", "egress", "placeholder", "egress-place holder", "egress_placeholder"])
def test_does_not_look_like_placeholder(text):
    assert not looks_like_placeholder(text)


def test_shape_tokens_stand_in_where_the_key_is_unknown():
    tokens = ShapeTokens(["tok"])
    assert tokens.get(PH) == "tok" and tokens.get(OTHER_SANDBOX) == "tok"
    assert tokens.get(OTHER_SECRET) is None and tokens.get(PH.upper()) is None


# --- hypothesis: any bytes around a placeholder -------------------------------------------------

AROUND = st.lists(st.sampled_from(["%", "%2", "%25", "2", "f", "F", "0", "a", " ", "\t", ",", ";", "=", "&", "/",
                                    "?", "+", '"', "-", "egress", "placeholder", "%2D", "%65", PH[:10]]),
                  max_size=5).map("".join)
VARIANT = st.sampled_from([PH, PH, PH, PH.upper(), OTHER_SANDBOX, PH.replace("-", "%2D", 1), PH[:-1]])
_DELIMITED = re.compile(r"[ \t,]+")


def _oracle_header(value: str) -> str | None:
    """Independently: the swapped value, or None when the header must be refused."""
    pieces = _DELIMITED.split(value)
    if any(p != PH and looks_like_placeholder(p) for p in pieces):
        return None
    if PH not in pieces and looks_like_placeholder(value):
        return None
    return "".join(SECRET if p == PH else p for p in re.split(r"([ \t,]+)", value))


@settings(max_examples=400, deadline=None)
@given(AROUND, VARIANT, AROUND, st.booleans())
@example("%2", PH, "", False)
@example("", PH, "", True)
def test_header_values_swap_whole_tokens_or_refuse(prefix, token, suffix, twice):
    value = prefix + token + suffix + ((" " + token) if twice else "")
    result = _header(value)
    expected = _oracle_header(value)
    if expected is None:
        assert isinstance(result, Misuse), (value, result)
        return
    assert isinstance(result, Swaps), (value, result)
    got = result.header_value(0, VALUES) if 0 in result.headers else value
    assert got == expected
    # never swapped elsewhere: every secret in the output stands between delimiters
    for match in re.finditer(re.escape(SECRET), got):
        before, after = got[:match.start()], got[match.end():]
        assert before == "" or before[-1] in " \t,", (value, got)
        assert after == "" or after[0] in " \t,", (value, got)
    assert got.replace(SECRET, PH) == value


NAMES = st.sampled_from(["api_key", "api_key", "q", "API_KEY", "api%5Fkey", "api_key[]", ""])


@settings(max_examples=400, deadline=None)
@given(NAMES, AROUND, VARIANT, AROUND, st.booleans(), st.sampled_from(["", "a=1&", "x&"]))
@example("q", "%2", PH, "", False, "")
@example("api_key", "", PH, "", False, "a=1&")
@example("api_key", "", PH, "&", False, "")
@example("api_key", "", PH[:-1], "f&", False, "")
def test_query_values_swap_only_whole_values_of_named_parameters(name, prefix, token, suffix, path_ok, before):
    target = f"/v1/x?{before}{name}={prefix}{token}{suffix}"
    positions = Positions(frozenset({"api_key"}), path_ok)
    result = _target(target, positions)
    encoded = encode_for_url(SECRET)
    if isinstance(result, Misuse):
        return  # refused: nothing is sent, whatever the reason
    out = result.new_target(VALUES) if result.target is not None else target
    # the only way a secret gets into the URL: as the whole value of api_key, exactly as issued
    if encoded in out:
        query = out.partition("?")[2]
        swapped = [pair for pair in query.split("&") if encoded in pair]
        assert set(swapped) == {f"api_key={encoded}"}, (target, out)
        original = target.partition("?")[2].split("&")
        assert original.count(f"api_key={PH}") == len(swapped), (target, out)
    else:
        assert not looks_like_placeholder(target), (target, out)
    assert unquote(out).count(SECRET) == out.count(encoded)
    assert out.replace(encoded, PH) == target


@settings(max_examples=300, deadline=None)
@given(AROUND, VARIANT, AROUND, st.booleans())
@example("/", PH, "", True)
@example("", PH[:-1], "f/", True)
@example("%2", PH, "", True)
@example("", PH, "?", True)
def test_path_segments_swap_only_when_allowed_and_whole(prefix, token, suffix, allowed):
    target = f"/v1/{prefix}{token}{suffix}/end"
    result = _target(target, Positions(frozenset(), allowed))
    if isinstance(result, Misuse):
        return
    out = result.new_target(VALUES) if result.target is not None else target
    encoded = encode_for_url(SECRET)
    if encoded in out:
        assert allowed, target
        segments = out.partition("?")[0].split("/")
        assert encoded in segments, (target, out)  # a whole segment
        # Segments end at '/' and at the query's '?': count them in the path part of both.
        assert target.partition("?")[0].split("/").count(PH) == segments.count(encoded), (target, out)
    assert out.replace(encoded, PH) == target
