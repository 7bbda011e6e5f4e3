"""YAML that remembers where every value came from.

Policy errors must name the file, line, column and key path; PyYAML's composer keeps marks on
nodes, so the loader walks nodes instead of plain dicts. Duplicate mapping keys are an error here
(plain PyYAML silently keeps the last one, which would let a second `hosts:` hide the first).
`Validator` checks the shapes of such a tree (the policy's and the policy tests'), collecting every
issue instead of stopping at the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml


@dataclass(frozen=True)
class Location:
    file: str
    line: int  # 1-based
    column: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass
class ConfigIssue:
    location: Location
    path: str
    message: str
    severity: str = "error"

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.location}: {where}{self.message}"


class PolicyError(ValueError):
    """A policy that does not parse or validate. str() lists every problem found."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = sorted(issues, key=lambda i: (i.location.file, i.location.line, i.location.column))
        super().__init__("\n".join(str(i) for i in self.issues))


@dataclass
class Node:
    """A YAML value with its location; mappings keep key locations too."""

    value: object
    location: Location
    key_locations: dict[str, Location] = field(default_factory=dict)


def _location(file: str, node: yaml.Node) -> Location:
    return Location(file, node.start_mark.line + 1, node.start_mark.column + 1)


# libyaml's parser (when PyYAML was built with it) is several times faster on big policies and
# keeps the same marks; the constructors are the safe ones either way.
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    pass


MAX_NODES = 2_000_000  # after alias expansion; a 100,000-rule policy needs ~600,000
MAX_ALIAS_REVISITS = 100_000  # nodes reached again through aliases (a "billion laughs" needs far more)


class _Budget:
    """Counts converted nodes and tracks the nodes being converted: an alias bomb (each level
    doubling the tree) runs out of budget, a cyclic alias is seen on the way down."""

    def __init__(self, limit: int = MAX_NODES, revisits: int = MAX_ALIAS_REVISITS):
        self.left = limit
        self.revisits = revisits  # conversions of a node already converted once (alias uses)
        self.active: set[int] = set()
        self.seen: set[int] = set()


def _convert(file: str, node: yaml.Node, loader: _Loader, issues: list[ConfigIssue], path: str,
             budget: _Budget | None = None) -> Node:
    budget = budget or _Budget()
    budget.left -= 1
    if id(node) in budget.seen:
        budget.revisits -= 1
    else:
        budget.seen.add(id(node))
    if budget.left < 0 or budget.revisits < 0:
        raise PolicyError([ConfigIssue(_location(file, node), path, "the policy is too large once its YAML "
                                                                      "aliases are expanded (alias bomb?)")])
    if id(node) in budget.active:
        raise PolicyError([ConfigIssue(_location(file, node), path, "a YAML alias refers to itself")])
    budget.active.add(id(node))
    try:
        return _convert_node(file, node, loader, issues, path, budget)
    finally:
        budget.active.discard(id(node))


def _convert_node(file: str, node: yaml.Node, loader: _Loader, issues: list[ConfigIssue], path: str,
                  budget: _Budget) -> Node:
    location = _location(file, node)
    if isinstance(node, yaml.MappingNode):
        explicit = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
        loader.flatten_mapping(node)
        # flatten_mapping puts merged (<<) pairs first: an explicit key may override those.
        merged_count = len(node.value) - explicit
        merged_keys: set[str] = set()
        result: dict[str, Node] = {}
        keys: dict[str, Location] = {}
        for index, (key_node, value_node) in enumerate(node.value):
            key = loader.construct_object(key_node, deep=True)
            key_location = _location(file, key_node)
            if not isinstance(key, str):
                issues.append(ConfigIssue(key_location, path, f"mapping key {key!r} must be a string"))
                continue
            child_path = f"{path}.{key}" if path else key
            if key in result:
                if key in merged_keys and index >= merged_count:
                    merged_keys.discard(key)  # an explicit key overrides a merged one
                elif index < merged_count:
                    continue  # several merge sources: the first one wins
                else:
                    issues.append(ConfigIssue(key_location, child_path, "duplicate key"))
                    continue
            elif index < merged_count:
                merged_keys.add(key)
            keys[key] = key_location
            result[key] = _convert(file, value_node, loader, issues, child_path, budget)
        return Node(result, location, keys)
    if isinstance(node, yaml.SequenceNode):
        items = [
            _convert(file, child, loader, issues, f"{path}[{index}]", budget)
            for index, child in enumerate(node.value)
        ]
        return Node(items, location)
    return Node(loader.construct_object(node, deep=True), location)


def parse(text: str, file: str) -> tuple[Node, list[ConfigIssue]]:
    """Parse one YAML document into located nodes.

    Syntax errors raise PolicyError; structural issues found on the way (duplicate keys,
    non-string keys) are returned so the caller can report them with its own findings."""
    issues: list[ConfigIssue] = []
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                raise PolicyError([ConfigIssue(Location(file, 1, 1), "", "the file is empty")])
            tree = _convert(file, root, loader, issues, "")
        finally:
            loader.dispose()
    except RecursionError:
        raise PolicyError([ConfigIssue(Location(file, 1, 1), "", "the YAML nests too deeply (a recursive alias?)")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        location = Location(file, mark.line + 1, mark.column + 1) if mark else Location(file, 1, 1)
        raise PolicyError([ConfigIssue(location, "", f"YAML syntax error: {exc.problem or exc}")]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([ConfigIssue(Location(file, 1, 1), "", f"YAML error: {exc}")]) from None
    return tree, issues


class Validator:
    """Walks located nodes, collecting every issue instead of stopping at the first."""

    def __init__(self) -> None:
        self.issues: list[ConfigIssue] = []

    def error(self, node: Node | Location, path: str, message: str) -> None:
        location = node.location if isinstance(node, Node) else node
        self.issues.append(ConfigIssue(location, path, message))

    def mapping(self, node: Node, path: str, allowed: set[str]) -> dict[str, Node] | None:
        if not isinstance(node.value, dict):
            self.error(node, path, f"must be a mapping, not {value_kind(node.value)}")
            return None
        for key in node.value:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                self.error(node.key_locations[key], _join(path, key), f"unknown key (allowed: {hint})")
        return node.value

    def required(self, node: Node, path: str, fields: dict[str, Node], keys: tuple[str, ...]) -> None:
        """An issue at `node` for each of `keys` its mapping `fields` lacks."""
        for key in keys:
            if key not in fields:
                self.error(node, path, f"missing required key {key!r}")

    def sequence(self, node: Node, path: str, *, non_empty: bool = False) -> list[Node] | None:
        if not isinstance(node.value, list):
            self.error(node, path, f"must be a list, not {value_kind(node.value)}")
            return None
        if non_empty and not node.value:
            self.error(node, path, "must not be empty")
        return node.value

    def string(self, node: Node, path: str) -> str | None:
        if not isinstance(node.value, str) or not node.value:
            self.error(node, path, f"must be a non-empty string, not {value_kind(node.value)}")
            return None
        return node.value

    def strings(self, node: Node, path: str) -> list[tuple[Node, str]] | None:
        """A list's non-empty strings, each with its node (an item that is none is an issue)."""
        items = self.sequence(node, path)
        if items is None:
            return None
        found = []
        for i, item in enumerate(items):
            value = self.string(item, f"{path}[{i}]")
            if value is not None:
                found.append((item, value))
        return found


def value_kind(value: object) -> str:
    """What a value is, for an error message: `a mapping`, `a list`, `null`..."""
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def parse_checked(text: str, file: str, keys: set[str]) -> tuple[Validator, Node, dict[str, Node]]:
    """Parse a document whose top level is a mapping of these keys: the validator (holding the
    issues found so far), the root and its keys. PolicyError when the top level is no such mapping."""
    root, issues = parse(text, file)
    v = Validator()
    v.issues.extend(issues)
    top = v.mapping(root, "", keys)
    if top is None:
        raise PolicyError(v.issues)
    return v, root, top


def node_at(root: "Node | None", *keys: str | int) -> "Node | None":
    """The node at a key path (mapping keys and list indexes), or None where the path leaves the tree."""
    node = root
    for key in keys:
        if node is None:
            return None
        value = node.value
        if isinstance(key, int):
            node = value[key] if isinstance(value, list) and 0 <= key < len(value) else None
        else:
            node = value.get(key) if isinstance(value, dict) else None
    return node
