"""What every namespace world (tests/transparent, tests/passthrough, the red team's transparent
world, tests/streaming's sandbox) starts and ends the same way: a topology of its own, gateways in
its gateway namespace behind the sandboxes' redirect, ready once their DNS listener answers, and
afterwards nothing left behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.lib.pki import TestPKI
from tests.support.gateway import GatewayProcess, NamespacedGateway
from tests.support.topology import Sandbox, Topology, unavailable_reason, wait_dns_answers


@dataclass
class Site:
    """A sandbox and the gateway its traffic is redirected to."""

    sandbox: Sandbox
    gateway: GatewayProcess

    @property
    def ca(self):
        return self.gateway.ca_cert

    @property
    def ns(self) -> str:
        return self.sandbox.ns

    def audit_mark(self) -> int:
        return len(self.gateway.audit())

    def audit_since(self, mark: int, settle: float = 0.1, **match) -> list[dict]:
        """Audit lines after `mark` whose fields equal `match`, once there is one (waiting up to 3 s),
        and then `settle` seconds more for the last ones."""
        self.gateway.audit_lines(mark, 1, 3.0, **match)  # none after 3 s: the caller's assertion says so
        # Not synchronisation (no event says the last line is written): a window for lines after
        # the first, as the callers do not say how many they expect.
        time.sleep(settle)
        return self.gateway.audit_lines(mark, 0, 0, **match)


@contextlib.contextmanager
def built_topology(prefix: str, pki: TestPKI | None = None) -> Iterator[tuple[Topology, Path]]:
    """(the created topology, its directory). The directory is our own, not pytest's numbered
    basetemp, which a concurrent pytest run may prune: the CA (unless `pki` is given), the upstream
    certificates, the gateways' confdirs and audit logs live as long as the topology. Skips the
    test where namespaces cannot be made; destroys everything afterwards and checks that nothing
    is left."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    topology = Topology(pki or TestPKI(root / "pki"))
    try:
        try:
            topology.create()
        except Exception as exc:  # noqa: BLE001  (e.g. veth or namespaces not supported by this kernel)
            pytest.skip(f"cannot build the namespace topology: {exc}")
        yield topology, root
    finally:
        topology.destroy()
        shutil.rmtree(root, ignore_errors=True)
        leftovers = topology.leftovers()
        assert leftovers == [], f"not cleaned up: {leftovers}"


def transparent_gateway(topology: Topology, workdir: Path, policy: str, regular_port: int, proxy_port: int,
                        dns_port: int, extra_args: Iterable[str] = ()) -> NamespacedGateway:
    """A gateway (not started yet) in the topology's gateway namespace: regular mode on
    127.0.0.1:`regular_port` there, transparent and DNS modes on every address (where the
    sandboxes' traffic is redirected), `policy` written to workdir/policy.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.yaml").write_text(policy)
    return NamespacedGateway(
        workdir / "policy.yaml", workdir, host="127.0.0.1", port=regular_port, upstream_ca=topology.pki.ca_cert,
        command_prefix=["ip", "netns", "exec", topology.gw],
        extra_args=["--mode", f"transparent@0.0.0.0:{proxy_port}", "--mode", f"dns@0.0.0.0:{dns_port}",
                    *extra_args])


def start_gateways(topology: Topology, gateways: Iterable[NamespacedGateway], sandboxes: Iterable[Sandbox]) -> None:
    """Start the gateways at once (each takes seconds on a busy machine), wait until each sandbox's
    DNS redirect is answered, check that no namespace has a way off the machine, and clear what the
    recorders saw of the start-up."""
    gateways = list(gateways)
    with concurrent.futures.ThreadPoolExecutor(len(gateways)) as pool:
        list(pool.map(lambda gateway: gateway.start(), gateways))
    for sandbox in sandboxes:
        wait_dns_answers(topology, sandbox)
    topology.check_closed()
    topology.reset()
