"""addons/channels.py is the whole list of the gateway's hidden channels: the source of addons/ is
read (ast, nothing imported) for every `flow.metadata` key, every `_egress_*` attribute and every
private import of mitmproxy or h11, and each must be a row of its table, with exactly the modules
that write and read it; the addon order must be the one `make_addons()` returns."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from addons.channels import ADDON_ORDER, ATTRIBUTES, METADATA, PRIVATE_IMPORTS

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"addons.channels", "addons.patches"}  # they name the channels; they do not use them
ATTRIBUTE = re.compile(r"_egress_\w+")
PRIVATE_ROOTS = ("mitmproxy", "h11", "h2", "wsproto")


def _string_constants(body: list[ast.stmt], prefix: str = "") -> dict[str, str]:
    found = {}
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update({prefix + t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.ClassDef) and not prefix:
            found.update(_string_constants(node.body, node.name + "."))
    return found


class Module:
    def __init__(self, name: str, tree: ast.Module):
        self.name, self.tree = name, tree
        self.constants = _string_constants(tree.body)
        self.names: dict[str, tuple[str, str]] = {}  # alias -> (module, constant) from `from X import Y`
        self.modules: dict[str, str] = {}  # alias -> module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = ("addons." + (node.module or "")).rstrip(".") if node.level == 1 else (node.module or "")
                for alias in node.names:
                    self.names[alias.asname or alias.name] = (base, alias.name)
                    self.modules[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.modules[alias.asname] = alias.name


def _modules() -> dict[str, Module]:
    found = {}
    for path in sorted((ROOT / "addons").glob("*.py")):
        name = "addons." + path.stem
        if name not in TABLES:
            found[name] = Module(name, ast.parse(path.read_text(), str(path)))
    return found


MODULES = _modules()


def resolve(module: Module, node: ast.expr, cls: str | None = None) -> str | None:
    """The string an expression names, when it is a literal, a constant of the addons (imported or
    not, a class's through self/cls) or a sum of them; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = resolve(module, node.left, cls), resolve(module, node.right, cls)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Name):
        if node.id in module.constants:
            return module.constants[node.id]
        source, name = module.names.get(node.id, (None, None))
        return MODULES[source].constants.get(name) if source in MODULES else None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id in ("self", "cls") and cls:
            return module.constants.get(f"{cls}.{node.attr}")
        if f"{node.value.id}.{node.attr}" in module.constants:  # a class's constant, by its class
            return module.constants[f"{node.value.id}.{node.attr}"]
        source = module.modules.get(node.value.id)
        return MODULES[source].constants.get(node.attr) if source in MODULES else None
    return None


def _dict_key_use(node: ast.AST, container: str) -> tuple[ast.expr, str] | None:
    """(key, "write"/"read") when the node uses a key of `<x>.<container>`."""
    def holds(value):
        return isinstance(value, ast.Attribute) and value.attr == container
    if isinstance(node, ast.Subscript) and holds(node.value):
        return node.slice, "read" if isinstance(node.ctx, ast.Load) else "write"
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and holds(node.func.value)
            and node.func.attr in ("get", "pop", "setdefault") and node.args):
        return node.args[0], "write" if node.func.attr == "setdefault" else "read"
    if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and holds(node.comparators[0])):
        return node.left, "read"
    return None


class Scan(ast.NodeVisitor):
    def __init__(self):
        self.metadata: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"write": set(), "read": set()})
        self.attributes: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"write": set(), "read": set()})
        self.mentioned: dict[str, set[str]] = defaultdict(set)  # every "_egress_*" string, where
        self.private: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"names": set(), "by": set()})
        self.unresolved: list[str] = []
        for self.module in MODULES.values():
            self.cls = None
            self.visit(self.module.tree)

    def where(self, node) -> str:
        return f"{self.module.name}:{node.lineno}"

    def visit_ClassDef(self, node):
        outer, self.cls = self.cls, node.name
        for inner in node.body:
            names = []
            if isinstance(inner, ast.Assign):
                names = [t.id for t in inner.targets if isinstance(t, ast.Name)]
                if "__slots__" in names and isinstance(inner.value, (ast.Tuple, ast.List)):
                    names = [e.value for e in inner.value.elts if isinstance(e, ast.Constant)]
            elif isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [inner.name]
            for name in names:
                if ATTRIBUTE.fullmatch(name):
                    self.attributes[name]["write"].add(self.module.name)
        self.generic_visit(node)
        self.cls = outer

    def generic_visit(self, node):
        use = _dict_key_use(node, "metadata")
        if use:
            key = resolve(self.module, use[0], self.cls)
            if key is None:
                self.unresolved.append(f"{self.where(node)} flow.metadata[{ast.unparse(use[0])}]")
            else:
                self.metadata[key][use[1]].add(self.module.name)
        use = _dict_key_use(node, "__dict__")
        if use and (key := resolve(self.module, use[0], self.cls)) and ATTRIBUTE.fullmatch(key):
            self.attributes[key][use[1]].add(self.module.name)
        if isinstance(node, ast.Attribute) and ATTRIBUTE.fullmatch(node.attr):
            self.attributes[node.attr]["read" if isinstance(node.ctx, ast.Load) else "write"].add(self.module.name)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")):
            name = resolve(self.module, node.args[1], self.cls)
            if name is not None and ATTRIBUTE.fullmatch(name):
                kind = "read" if node.func.id in ("getattr", "hasattr") else "write"
                self.attributes[name][kind].add(self.module.name)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ATTRIBUTE.fullmatch(node.value):
            self.mentioned[node.value].add(self.module.name)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            self._private_import(node.module, [a.name for a in node.names])
        if isinstance(node, ast.Import):
            for alias in node.names:
                self._private_import(alias.name, [])
        super().generic_visit(node)

    def _private_import(self, module: str, names: list[str]):
        if module.split(".")[0] not in PRIVATE_ROOTS:
            return
        private_names = [n for n in names if n.startswith("_")]
        if any(part.startswith("_") for part in module.split(".")):
            private_names = names or [""]
        if private_names:
            self.private[module]["names"].update(n for n in private_names if n)
            self.private[module]["by"].add(self.module.name)


@pytest.fixture(scope="module")
def scan() -> Scan:
    return Scan()


def _set(column: str) -> set[str]:
    return set(column.split(", ")) if column else set()


def test_every_metadata_key_is_spelled_so_it_can_be_read(scan):
    assert scan.unresolved == [], "a flow.metadata key the scan cannot name: use a constant"


def test_every_metadata_key_is_in_the_table_with_its_writers_and_readers(scan):
    table = {row.key: {"write": _set(row.written_by), "read": _set(row.read_by)} for row in METADATA}
    assert len(table) == len(METADATA), "a key listed twice"
    assert {k: v for k, v in scan.metadata.items()} == table


def test_every_egress_attribute_is_in_the_table_with_its_writers_and_readers(scan):
    table = {row.name: {"write": _set(row.written_by), "read": _set(row.read_by)} for row in ATTRIBUTES}
    assert len(table) == len(ATTRIBUTES), "an attribute listed twice"
    assert {k: v for k, v in scan.attributes.items()} == table
    unlisted = {name: sorted(where) for name, where in scan.mentioned.items() if name not in table}
    assert unlisted == {}, "an _egress_ name spelled in a string but not in the table"


def test_every_private_import_is_in_the_table(scan):
    table = {row.module: {"names": _set(row.names), "by": _set(row.imported_by)} for row in PRIVATE_IMPORTS}
    assert len(table) == len(PRIVATE_IMPORTS)
    assert {k: v for k, v in scan.private.items()} == table


@pytest.mark.parametrize("row", METADATA + ATTRIBUTES, ids=lambda row: getattr(row, "key", None) or row.name)
def test_a_defined_name_is_the_constant_its_module_owns(row):
    name = getattr(row, "key", None) or row.name
    assert row.why
    if not row.defined:
        owned = {m: c for m, module in MODULES.items() for c, v in module.constants.items() if v == name}
        assert owned == {}, f"{name} has a constant: name it in `defined`"
        return
    module, expression = row.defined.split(":", 1)
    assert resolve(MODULES[module], ast.parse(expression, mode="eval").body) == name


def test_every_private_import_row_says_why():
    for row in PRIVATE_IMPORTS:
        assert row.why, row


def test_the_addon_order_is_what_make_addons_returns():
    code = ("import json\nfrom addons.egress import make_addons\n"
            "print(json.dumps([f'{type(a).__module__}.{type(a).__name__}' for a in make_addons()]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout.strip().splitlines()[-1])
    assert made == [f"{row.owner}.{row.addon}" for row in ADDON_ORDER]
    assert all(row.why for row in ADDON_ORDER)


if __name__ == "__main__":  # print what the scan finds, to write or check the table by hand
    found = Scan()
    for title, table in (("metadata", found.metadata), ("attributes", found.attributes), ("private", found.private)):
        print(f"## {title}")
        for key, uses in sorted(table.items()):
            print(key, {k: sorted(v) for k, v in uses.items()})
    print("## mentioned", {k: sorted(v) for k, v in found.mentioned.items()})
    print("## unresolved", found.unresolved)
