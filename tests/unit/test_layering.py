"""`gateway/` is the pure core: it imports neither mitmproxy (nor the protocol libraries under it)
nor `addons/`, so explain, replay, policy tests and the session walk run, and are tested, without a
proxy. Checked from the source (every import statement, nested ones too) and at run time (importing
every gateway module loads no mitmproxy).

`bench/` uses no test internals: the tests may use bench's harness (bench/lib: the noisy-neighbour
world, the unabridged method scanner, the test CA, the closed namespace network), never the other way,
so a benchmark does not break when a suite's helpers change."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("mitmproxy", "addons", "h11", "h2", "hpack", "wsproto", "aioquic")



def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_core_imports_no_proxy_and_no_adapter():
    found = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for module in _imports(path):
            if module.split(".")[0] in FORBIDDEN:
                found.append(f"{relative}: {module}")
    assert found == []


def test_importing_every_core_module_loads_no_mitmproxy():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for p in (ROOT / "gateway").rglob("*.py") if p.name != "__main__.py")
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_run_is_composed_outside_the_core():
    """`egress-gateway run` (mitmproxy + the addons) is registered from addons/ through the
    egress_gateway.commands entry point; the supervisor side of it imports no mitmproxy."""
    code = ("import sys\n"
            "from gateway.cli import _registrars\n"
            "run = _registrars()['run']\n"
            "print(run.__module__, sorted(m for m in sys.modules if m.split('.')[0] == 'mitmproxy'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "addons.run_command []"


def test_bench_imports_nothing_from_tests():
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for module in _imports(path):
            if module.split(".")[0] == "tests":
                found.append(f"{relative}: import {module}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            # a module run by name (`python -m tests...`) is an import too
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("tests."):
                found.append(f"{relative}: {node.value!r}")
    assert found == []
