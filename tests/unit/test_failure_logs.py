"""The one failure hook (tests/conftest.py) finds every gateway a test used, however its suite
wraps them, each once, and reports the end of its log (tests/support/failure_logs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from tests.support.failure_logs import LOG_LINES, gateways_in, log_sections, watch
from tests.support.gateway import GatewayProcess


@dataclass
class _Site:
    gateway: GatewayProcess


@dataclass
class _World:
    sites: dict = field(default_factory=dict)


def _gateway(tmp_path, name: str, lines: int = 3) -> GatewayProcess:
    gateway = GatewayProcess(None, tmp_path / name)
    gateway.workdir.mkdir(exist_ok=True)  # (GatewayProcess makes it)
    gateway.log_path.write_text("".join(f"{name} line {n}\n" for n in range(lines)))
    return gateway


def test_gateways_are_found_directly_in_a_wrapper_and_in_a_world_of_sites_each_once(tmp_path):
    a, b = _gateway(tmp_path, "a"), _gateway(tmp_path, "b")
    world = _World({"one": _Site(a), "two": _Site(b), "again": _Site(a)})
    assert list(gateways_in(a)) == [a]
    assert list(gateways_in(_Site(b))) == [b]
    assert list(gateways_in(world)) == [a, b]
    item = SimpleNamespace(funcargs={"world": world, "site": _Site(a), "other": 42})
    assert [title for title, _ in log_sections(item)] == [f"gateway log {a.workdir}", f"gateway log {b.workdir}"]


def test_gateways_a_fixture_starts_later_are_reported_and_only_the_end_of_a_log(tmp_path):
    started: list[GatewayProcess] = []
    item = SimpleNamespace(funcargs={})
    watch(SimpleNamespace(node=item), started)
    assert log_sections(item) == []
    started.append(_gateway(tmp_path, "late", lines=LOG_LINES + 10))  # after watch: still seen
    [(title, tail)] = log_sections(item)
    assert tail.splitlines() == [f"late line {n}" for n in range(10, LOG_LINES + 10)]


def test_the_walk_is_bounded_and_leaves_foreign_objects_alone(tmp_path):
    deep = _gateway(tmp_path, "deep")
    nested = {"a": {"b": {"c": {"d": deep}}}}
    assert list(gateways_in(nested)) == []  # deeper than a fixture's value wraps a gateway
    foreign = SimpleNamespace(gateway=deep)  # not a tests.* object: its attributes are not walked
    assert list(gateways_in(foreign)) == []
    loop = _World()
    loop.sites["self"] = loop
    assert list(gateways_in(loop)) == []
