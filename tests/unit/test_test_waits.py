"""The tests synchronise on events, never on sleeps (tests/README.md, "Waiting"): every sleep left
under tests/ says, in a comment on its line or just above, why it is not synchronisation (pacing, a
slow origin under test, a window for a bug to show, a polling interval). A sleep added to stand for
an event fails here; `tests.support.waiting.wait_for`, a recorder's condition or a fence
(`tests.support.fence`) is what to use instead."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SLEEP = re.compile(r"\b(?:time|asyncio)\.sleep\((?!0\))")  # asyncio.sleep(0): one turn of the loop, no time
REASON = "not synchronisation"
ABOVE = 3  # lines above a sleep where its comment may stand


def unexplained_sleeps(root: Path) -> list[str]:
    """file:line of every sleep under `root` with no "not synchronisation" comment near it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if SLEEP.search(line.split("#", 1)[0]):
                nearby = " ".join(lines[max(0, number - 1 - ABOVE):number]).lower()
                if REASON not in nearby:
                    found.append(f"{path.relative_to(root.parent).as_posix()}:{number}: {line.strip()}")
    return found


def test_every_sleep_in_the_tests_says_why_it_is_not_synchronisation():
    assert unexplained_sleeps(TESTS) == []


def test_the_check_finds_a_sleep_without_a_reason(tmp_path):
    suite = tmp_path / "tests"
    suite.mkdir()
    nap = "time." + "sleep"  # spelt apart, so that this file does not match itself
    (suite / "test_x.py").write_text(f"import time\n\n"
                                     f"def test_a():\n    {nap}(0.2)\n\n"
                                     f"def test_b():\n    {nap}(0.2)  # pacing, not synchronisation: a drip\n\n"
                                     f"async def test_c():\n    await asyncio.sleep(0)\n")
    assert unexplained_sleeps(suite) == [f"tests/test_x.py:4: {nap}(0.2)"]
