"""What a failed test's report carries: the end of the log of every gateway process it used.

The gateways a test used are found in its fixtures' values, however a suite wraps them (a
`GatewayProcess` itself, an object with a `gateway`, a world of sites each with one...), by a
bounded walk of their attributes, and in `item.egress_gateways` (gateways a test starts itself).
"""

from __future__ import annotations

from collections.abc import Iterator

from tests.support.gateway import GatewayProcess

LOG_LINES = 40
_DEPTH = 3  # fixture value -> its attribute -> a dict or list in it -> a gateway


def gateways_in(value, depth: int = _DEPTH, seen: set[int] | None = None) -> Iterator[GatewayProcess]:
    seen = set() if seen is None else seen
    if id(value) in seen or depth < 0:
        return
    seen.add(id(value))
    if isinstance(value, GatewayProcess):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from gateways_in(item, depth - 1, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from gateways_in(item, depth - 1, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and type(value).__module__.startswith("tests."):
        for item in vars(value).values():
            yield from gateways_in(item, depth - 1, seen)


def watch(request, gateways) -> None:
    """Report the logs of `gateways` (a list a fixture keeps appending to) if the test fails."""
    request.node.__dict__.setdefault("egress_gateways", []).append(gateways)


def log_sections(item) -> list[tuple[str, str]]:
    """(title, log tail) for each gateway the test item used, each once."""
    found: list[GatewayProcess] = []
    roots = list(getattr(item, "funcargs", {}).values()) + list(getattr(item, "egress_gateways", []))
    seen: set[int] = set()
    for root in roots:
        for gateway in gateways_in(root, seen=seen):
            if gateway not in found:
                found.append(gateway)
    return [(f"gateway log {gateway.workdir}", "\n".join(gateway.log().splitlines()[-LOG_LINES:]))
            for gateway in found]
