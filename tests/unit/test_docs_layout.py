"""The layout the documents describe is the layout that exists: docs/architecture.md's "Layout in
detail" names every module under gateway/ and addons/ (and only modules that exist), and README.md's
"Layout" names every top-level path of the tree (and only paths that exist)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _section(document: str, title: str) -> str:
    text = (ROOT / document).read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _modules() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for package in ("gateway", "addons")
            for path in (ROOT / package).rglob("*.py") if path.name != "__init__.py"}


def test_the_architecture_names_every_module_of_the_core_and_the_addons():
    named = set(re.findall(r"`((?:gateway|addons)/[\w/]+\.py)`", _section("docs/architecture.md", "Layout in detail")))
    assert sorted(_modules() - named) == [], "modules missing from docs/architecture.md's Layout in detail"
    assert sorted(named - _modules()) == [], "modules named there that do not exist"


def test_every_module_has_its_own_line():
    section = _section("docs/architecture.md", "Layout in detail")
    rows = re.findall(r"^\| `((?:gateway|addons)/[\w/]+\.py)` \| (.+) \|$", section, re.MULTILINE)
    assert sorted(module for module, _ in rows) == sorted(_modules())
    assert all(what.strip() for _, what in rows)


def test_the_readme_layout_names_every_top_level_path():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/")[0] + ("/" if "/" in path else "") for path in tracked} - {"README.md", ".gitignore"}
    named = set(re.findall(r"^\| `([^`]+)` \|", _section("README.md", "Layout"), re.MULTILINE))
    assert sorted(top - named) == [], "top-level paths missing from README.md's Layout"
    assert sorted(p for p in named if not (ROOT / p).exists()) == [], "README.md's Layout names paths that do not exist"
