"""Every promise of README.md (its numbered pinning rules) has a row in tests/README.md's "Which
tests check each promise of the README", and every test file or folder a row names exists: a
promise cannot lose its tests, nor a row point at tests that were moved away."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _rows() -> dict[str, str]:
    """promise (the first cell) -> the tests cell."""
    section = _section((ROOT / "tests" / "README.md").read_text(), "Which tests check each promise of the README")
    rows = [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^\| (.+?) \| (.+) \|$", section, re.M)]
    return dict(rows[1:])  # after the header (its rule "|---|" does not match)


def test_every_pinning_rule_of_the_readme_has_a_row():
    rules = re.findall(r"^(\d+)\. \*\*", _section((ROOT / "README.md").read_text(), "The pinning rules"), re.M)
    assert len(rules) >= 10
    numbered = {promise.split(".", 1)[0] for promise in _rows() if re.match(r"\d+\.", promise)}
    assert sorted(set(rules) - numbered, key=int) == []


def test_every_test_a_row_names_exists():
    problems = []
    for promise, tests in _rows().items():
        named = [name for name in re.findall(r"`([^`]+)`", tests) if name.startswith(("tests/", "policies/"))]
        if not named:
            problems.append(f"{promise}: names no test")
        problems += [f"{promise}: {name} does not exist" for name in named if not (ROOT / name).exists()]
    assert problems == []
