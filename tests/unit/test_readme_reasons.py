"""Every reason code the gateway can send is documented in README.md's table, and tests/README.md
maps each one to tests that name it."""

import re
from pathlib import Path

from gateway.decision import REASONS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TESTS_README = (ROOT / "tests" / "README.md").read_text()
DOCUMENTED = [code for code in REASONS if code != "allowed"]


def test_every_reason_code_is_in_the_readme():
    section = README.split("## Reason codes", 1)[1].split("\n## ", 1)[0]
    missing = [code for code in DOCUMENTED if f"`{code}`" not in section]
    assert missing == []


def _names(code: str, text: str) -> bool:
    """A test names a code as a quoted string, or as `reason: CODE` in a policy test file."""
    return re.search(r"""["'`]%s["'`]|\breason: %s\b""" % (re.escape(code), re.escape(code)), text) is not None


def _test_files() -> dict[Path, str]:
    files = [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "policies").rglob("*.test.yaml"),
             ROOT / "policies" / "test_policies.py"]
    return {path: path.read_text(errors="replace") for path in files}


def test_every_reason_code_has_a_test_and_a_row_in_tests_readme():
    section = TESTS_README.split("## Which tests check each reason code", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_0-9]+)` \| (.*) \|$", section, re.M)}
    texts = _test_files()
    problems = []
    for code in DOCUMENTED:
        if not any(_names(code, text) for text in texts.values()):
            problems.append(f"{code}: no test names it")
        if code not in rows:
            problems.append(f"{code}: no row in tests/README.md")
            continue
        listed = re.findall(r"`([^`]+)`", rows[code])
        if not listed:
            problems.append(f"{code}: its row lists no test")
        for name in listed:
            path = ROOT / name
            if not path.is_file() or not _names(code, path.read_text(errors="replace")):
                problems.append(f"{code}: {name} does not name it")
    assert problems == []
