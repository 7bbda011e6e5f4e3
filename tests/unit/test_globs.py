"""The linear-time glob matcher (gateway/globs.py): the same answers as the regex that defines the
language, and no input that makes it slow."""

from __future__ import annotations

import pickle
import random
import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway import globs
from gateway.globs import PathGlob, reference_regex
from gateway.paths import compile_glob

# Pieces of globs: every wildcard, `/**` in each position, literal characters that are special in
# regexes or glob dialects the loader does not have (they must stay literal), and characters the
# wildcards treat differently ('/', '\n', non-ASCII).
GLOB_PIECES = ["/", "a", "b", "-", ".", "*", "**", "?", "/**", "/**/", "\n", "é", "[", "]", "\\", "{", "+"]
GLOBS = st.lists(st.sampled_from(GLOB_PIECES), max_size=12).map(lambda parts: "/" + "".join(parts))
PATH_CHARS = st.sampled_from(["/", "a", "b", "-", ".", "\n", "é", "*", "?", "[", "\\"])
SHORT_PATHS = st.lists(PATH_CHARS, max_size=16).map("".join)


def instance(glob: str, draw) -> str:
    """A path shaped like `glob`: each wildcard replaced by a short random run (which may break
    the rules on purpose), so that matches are common and near-misses too."""
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(draw(SHORT_PATHS))
            i += 2
        elif glob[i] == "*":
            out.append(draw(st.lists(PATH_CHARS, max_size=4).map("".join)))
            i += 1
        elif glob[i] == "?":
            out.append(draw(PATH_CHARS))
            i += 1
        else:
            out.append(glob[i])
            i += 1
    return "".join(out)


def agrees(glob: str, path: str) -> None:
    expected = reference_regex(glob).match(path) is not None
    assert PathGlob(glob).match(path) is expected, (glob, path, expected)


@settings(max_examples=3000, deadline=None)
@given(GLOBS, st.data())
@example("/packages/**/*-*-*.whl", None)
@example("/a/**/**/b", None)
@example("/**", None)
@example("/a/***", None)
@example("/**/*", None)
def test_same_answers_as_the_defining_regex(glob, data):
    paths = ["", "/", "/a", glob, glob + "/", glob.replace("*", "")]
    if data is not None:
        paths += [data.draw(SHORT_PATHS), "/" + data.draw(SHORT_PATHS), instance(glob, data.draw)]
    for path in paths:
        agrees(glob, path)


@pytest.mark.parametrize("cap", [0, 1, 3])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(glob=GLOBS, data=st.data())
def test_same_answers_when_the_state_cache_overflows(cap, glob, data):
    """A full DFA cache finishes the match on the bare NFA: same answers."""
    with mock.patch.object(globs, "MAX_STATES", cap):
        compiled = PathGlob(glob)
        for _ in range(3):
            path = instance(glob, data.draw) + data.draw(SHORT_PATHS)
            assert compiled.match(path) is (reference_regex(glob).match(path) is not None), (glob, path)
        assert len(compiled._cache.masks) <= max(cap, 1) + 2  # the start state is always there


def test_cache_stays_bounded_on_a_glob_with_exponentially_many_states():
    # After `**a`, eleven `?` must remember which of the last twelve characters were 'a': 2^12 DFA
    # states, more than the cache holds. Random paths visit a new one at nearly every character.
    glob = "/**a???????????"
    rng = random.Random(14)
    body = "/" + "".join(rng.choice("ab") for _ in range(65536))
    for last12, expected in (("a", True), ("b", False)):
        path = body[:-12] + last12 + body[-11:]
        assert (reference_regex(glob).match(path) is not None) is expected
        compiled = compile_glob(glob)
        assert compiled.match(path) is expected
        assert len(compiled._cache.masks) <= globs.MAX_STATES + 2
        assert len(compiled._cache.masks) < 10  # and the next match starts on a fresh one


# --------------------------------------------------------------------------------------------
# time: linear in the path, whatever the glob

BUDGET = 0.050  # seconds per 64 KiB match: generous; the regex took seconds on 2.5 KB
SIZE = 64 * 1024

# Many wildcards, and literals that the fillers below are made of.
STRESS_PIECES = ["*", "**", "?", "/**", "/**/", "*-", "-*", "a", "-", "/", ".whl", "*a*"]
STRESS_GLOBS = st.lists(st.sampled_from(STRESS_PIECES), min_size=1, max_size=16).map(lambda p: "/" + "".join(p))
FILLERS = ["a-", "/", "/a", "a-/", "-", "a", "/-a", "a-a-/a-"]


def literal_ends(glob: str) -> tuple[str, str]:
    """The glob's literal prefix and suffix, so that an adversarial path gets past the cheap checks
    and the automaton reads all of it."""
    wild = [i for i, ch in enumerate(glob) if ch in "*?"]
    if not wild:
        return glob, ""
    return glob[: wild[0]], glob[wild[-1] + 1 :]


def timed_match(glob: str, path: str) -> float:
    compiled = compile_glob(glob)  # cold: the DFA is built during the match
    start = time.perf_counter()
    compiled.match(path)
    return time.perf_counter() - start


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STRESS_GLOBS, st.sampled_from(FILLERS), st.sampled_from(["", "x", "/", ".whl", "-.whl"]))
@example("/packages/**/*-*-*.whl", "a-", "")
@example("/packages/**/*-*-*.whl", "-", "x.whl")
@example("/**/*-*-*-*-*-*-*-*.whl", "a-", ".whl")
@example("/**" * 8 + "/*" * 8, "/", "")
@example("/" + "*-" * 16, "-", "x")
@example("/" + "**a" * 8, "a-", "b")
def test_adversarial_64k_paths_match_within_budget(glob, filler, tail):
    prefix, suffix = literal_ends(glob)
    body = filler * (SIZE // len(filler))
    for path in (prefix + body + tail + suffix, "/" + body + tail, prefix + body + tail):
        elapsed = timed_match(glob, path)
        if elapsed > BUDGET:  # one retry, for a scheduler hiccup rather than a slow matcher
            elapsed = min(elapsed, timed_match(glob, path))
        assert elapsed < BUDGET, (glob, filler, tail, len(path), elapsed)


def test_the_issue_pattern_is_linear():
    """`/packages/**/*-*-*.whl` took 3 s on a 2.5 KB path: now time grows with the path, no faster."""
    glob = compile_glob("/packages/**/*-*-*.whl")
    times = {}
    for size in (4096, 65536):
        path = "/packages/" + "a-" * (size // 2) + "x.whl"  # gets past the suffix check: a full run
        assert glob.match(path)
        times[size] = min(_time(glob._run, path) for _ in range(3))
    assert times[65536] < BUDGET
    assert times[65536] < 16 * 4 * times[4096] + 0.005  # 16x the path: nowhere near 16^3 the time


def _time(fn, arg) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# the object


def test_compiled_globs_are_values():
    a, b = compile_glob("/a/**"), compile_glob("/a/**")
    assert a == b and hash(a) == hash(b) and a != compile_glob("/a/*")
    assert a.pattern == "/a/**" and repr(a) == "PathGlob('/a/**')"
    copy = pickle.loads(pickle.dumps(a))
    assert copy == a and copy.match("/a/b") and not copy.match("/ab")


def test_match_returns_bools():
    glob = compile_glob("/a/*")
    assert glob.match("/a/b") is True
    assert glob.match("/b") is False
    assert compile_glob("/lit").match("/lit") is True
