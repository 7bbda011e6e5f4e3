"""normalise_path and compile_glob."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.paths import check_target, MAX_DECODE_ROUNDS, PathError, compile_glob, normalise_path


@pytest.mark.parametrize(
    "target, expected",
    [
        ("/", "/"),
        ("/a/b", "/a/b"),
        ("/a/b/", "/a/b/"),
        ("/a/./b/../c", "/a/c"),
        ("/a/b/.", "/a/b"),
        ("/a/b/..", "/a"),
        ("/a/b/../", "/a/"),
        ("/./a", "/a"),
        # percent-encoded dot segments, any case, and encoded slashes
        ("/a/%2e%2e/b", "/b"),
        ("/a/%2E%2E/b", "/b"),
        ("/a/.%2e/b", "/b"),
        ("/a/%2e./b", "/b"),
        ("/a/%2e/b", "/a/b"),
        ("/a%2Fb", "/a/b"),
        ("/a%2f..%2fb", "/b"),
        ("/a/%2e%2e%2fb", "/b"),
        # double, triple and quadruple encoding
        ("/a/%252e%252e/b", "/b"),
        ("/a/%25252e%25252e/b", "/b"),
        ("/a/%2525252e%2525252e/b", "/b"),
        ("/a/%252f..%252fb", "/b"),
        # ;params dropped from segments (Tomcat)
        ("/a/..;/b", "/b"),
        ("/a/..;x=1/b", "/b"),
        ("/a/.;/b", "/a/b"),
        ("/a/b;jsessionid=1/c", "/a/b/c"),
        ("/a;b/c", "/a/c"),
        ("/;/a", "/a"),
        ("/a/..%3b/b", "/b"),
        # backslashes are slashes
        ("/a\\..\\b", "/b"),
        ("/a\\b", "/a/b"),
        ("/a%5cb", "/a/b"),
        ("/a/%5c..%5cb", "/b"),
        # empty segments collapse
        ("//", "/"),
        ("/a//b///c", "/a/b/c"),
        ("//a//", "/a/"),
        # query and fragment are not part of the path (and not decoded into it)
        ("/a?x=../..", "/a"),
        ("/a/b?%2e%2e", "/a/b"),
        # non-ASCII, percent-encoded UTF-8
        ("/caf%C3%A9", "/café"),
        ("/café", "/café"),
        # a lone % or %zz is not an escape
        ("/%", "/%"),
        ("/%zz", "/%zz"),
        ("/100%", "/100%"),
        ("/%25", "/%"),
        # OPTIONS *
        ("*", "*"),
    ],
)
def test_normalise_path(target, expected):
    assert normalise_path(target) == expected


@pytest.mark.parametrize(
    "target",
    [
        "/..",
        "/../",
        "/../a",
        "/a/../..",
        "/a/../../b",
        "/%2e%2e",
        "/%2e%2e/x",
        "/.%2e/",
        "/%252e%252e/etc/passwd",
        "/..;/",
        "/..;x",
        "/..\\",
        "/\\..",
        "/a/%2e%2e%2f..",
    ],
)
def test_climbing_above_the_root_refused(target):
    with pytest.raises(PathError, match="above the root"):
        normalise_path(target)


@pytest.mark.parametrize(
    "target",
    ["/a%00b", "/a\x00b", "/a%0ab", "/a%0d%0ab", "/a\nb", "/a\rb", "/a\x01", "/a%1f", "/a%7f", "/a\x7f", "/a\tb", "/a%09b",
     "/a%2500b", "/a%252500b"],
)
def test_control_characters_refused(target):
    with pytest.raises(PathError, match="control character|space, tab"):
        check_target(target)
        normalise_path(target)


@pytest.mark.parametrize("target", ["/a#frag/../..", "/a?b#c", "/admin /../ok/x", "/ok/x\t/../../admin"])
def test_targets_an_upstream_could_read_differently_are_refused(target):
    # '#' and whitespace never belong in a request target: forwarded raw, an upstream could
    # split the line at the space or read a path after the '#' that the check ignored.
    with pytest.raises(PathError):
        check_target(target)


@pytest.mark.parametrize("target", ["/a%ff", "/a%c3", "/a%c3%28", "/a%ed%a0%80", "/a%25ff", "/%c0%ae%c0%ae/x"])
def test_percent_encoded_invalid_utf8_refused(target):
    with pytest.raises(PathError, match="UTF-8"):
        normalise_path(target)


@pytest.mark.parametrize("target", ["/a\udcff", "/\udcc0\udcae\udcc0\udcae/x", "/%41\udcff", "/a/%2e\udcff"])
def test_raw_invalid_utf8_refused(target):
    # mitmproxy's Request.path decodes raw bytes with surrogateescape, so a raw 0xff byte arrives
    # as U+DCFF. Invalid UTF-8 must be refused whether or not it was percent-encoded, and never
    # escape as a UnicodeEncodeError.
    with pytest.raises(PathError):
        normalise_path(target)


def test_too_many_encodings_refused():
    assert MAX_DECODE_ROUNDS == 4
    five_times = "/a/%25252525" + "2e%25252525" + "2e/b"
    with pytest.raises(PathError, match="too many times"):
        normalise_path(five_times)


@pytest.mark.parametrize("target", ["", "a/b", "example.com/a", "http://example.com/", "?x", "#x", "**", "%2f"])
def test_target_must_start_with_slash(target):
    with pytest.raises(PathError):
        normalise_path(target)


PATHISH = st.lists(
    st.sampled_from(["/", "\\", ".", "..", "a", "b", "%2e", "%2E", "%2f", "%5c", "%25", "%252e", ";", ";x", "%3b",
                     "?", "#", "%", "é", "%c3%a9", "//", "/..", "/.", "%00", "\t"]),
    max_size=14,
).map(lambda parts: "/" + "".join(parts))


@settings(max_examples=1000, deadline=None)
@given(st.one_of(PATHISH, st.text(max_size=30).map(lambda s: "/" + s)))
@example("/a/..;/b")
@example("/%2e%2e/")
def test_normalised_paths_are_clean(target):
    try:
        result = normalise_path(target)
    except PathError:
        return
    assert result.startswith("/")
    assert "//" not in result
    assert "/../" not in result and "/./" not in result
    assert not result.endswith("/..") and not result.endswith("/.")
    assert "\\" not in result
    assert ";" not in result
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in result)
    segments = result.split("/")[1:]
    assert ".." not in segments and "." not in segments


@settings(max_examples=500, deadline=None)
@given(PATHISH)
def test_normalise_path_only_raises_path_error(target):
    try:
        normalise_path(target)
    except PathError:
        pass


# --------------------------------------------------------------------------------------------
# globs


@pytest.mark.parametrize(
    "pattern, matching, not_matching",
    [
        ("/a/**", ["/a", "/a/", "/a/b", "/a/b/c", "/a/b/c/"], ["/ab", "/b", "/", "/abc/d", "/b/a"]),
        ("/a/*", ["/a/", "/a/b", "/a/bc"], ["/a", "/a/b/c", "/ab", "/a/b/"]),
        ("/a/?", ["/a/b", "/a/1"], ["/a/", "/a/bc", "/a//", "/a/b/c"]),
        ("/a/**/z", ["/a/z", "/a/b/z", "/a/b/c/z"], ["/az", "/a/z/x", "/a/bz"]),
        ("/a*", ["/a", "/abc"], ["/a/b", "/b"]),
        ("/*.json", ["/x.json", "/.json"], ["/x.jsonx", "/a/x.json", "/xjson"]),
        ("/a.b", ["/a.b"], ["/axb", "/a.b/c"]),
        ("/a+(b)", ["/a+(b)"], ["/aab", "/a+b"]),
        ("/**", ["/", "/x", "/x/y/z"], []),
        ("/", ["/"], ["/a"]),
        ("/api/v?/items/*", ["/api/v1/items/x", "/api/v2/items/"], ["/api/v10/items/x", "/api/v1/items/x/y"]),
        ("/a/**x", ["/a/x", "/a/bx", "/a/b/cx"], ["/a/b/c", "/ax"]),
    ],
)
def test_compile_glob(pattern, matching, not_matching):
    regex = compile_glob(pattern)
    for path in matching:
        assert regex.match(path), (pattern, path)
    for path in not_matching:
        assert not regex.match(path), (pattern, path)


def test_glob_star_does_not_match_newlines_across_segments():
    assert not compile_glob("/a/*").match("/a/b\n/c")
    assert compile_glob("/a/**").match("/a/b\nc")  # DOTALL: ** really is anything


@pytest.mark.parametrize("pattern", ["", "a/b", "*", "**", "*/a", "?/a"])
def test_glob_must_start_with_slash(pattern):
    with pytest.raises(ValueError, match="must start with '/'"):
        compile_glob(pattern)
