"""Passthrough rules (`inspect: false`) end to end: a real gateway, real upstreams with their own
certificates, real clients (curl, httpx, openssl s_client, Python ssl, hand-built ClientHellos).

Upstreams (loopback, the session's 127.X.0.0/24 block; .161-.165 belong to this suite):
- pass.test   (.161): TLS on 443 with a certificate for pass.test and *.pass.test from the session's
                      test CA (the "upstream CA", bench/lib/pki.py), plain HTTP on 80
- pass2.test  (.162): TLS on 443, certificate for pass2.test (another passthrough name)
The standard allowed.test (.2) stays an inspected destination, other.test (.3) has no rule.

A client that sees the upstream's own certificate trusts `pki.ca_cert`; one that sees the gateway's
(interception) trusts `gateway.ca_cert`. The two CAs are different keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import policy_text
from tests.e2e.helpers import extra_static_hosts
from tests.support.gateway import GatewayProcess
from tests.support.upstream import RecordingUpstream

PASS_RULES = """
- id: pass
  hosts: [pass.test, "*.pass.test"]
  inspect: false
- id: pass2
  hosts: [pass2.test]
  inspect: false
- id: inspected
  hosts: [allowed.test]
"""


@dataclass
class PassUpstreams:
    pass_tls: RecordingUpstream
    pass_plain: RecordingUpstream
    pass2_tls: RecordingUpstream
    addresses: dict[str, str]

    def all(self) -> list[RecordingUpstream]:
        return [self.pass_tls, self.pass_plain, self.pass2_tls]

    def reset(self) -> None:
        for server in self.all():
            server.reset()


@pytest.fixture(scope="session")
def pass_upstreams(upstreams, pki):
    block = upstreams.block
    pass_ip, pass2_ip = f"{block}.161", f"{block}.162"
    cert, key = pki.issue(["pass.test", "*.pass.test"], [pass_ip], stem="passthrough-pass")
    cert2, key2 = pki.issue(["pass2.test"], [pass2_ip], stem="passthrough-pass2")
    servers = PassUpstreams(
        RecordingUpstream("pass.test", pass_ip, 443, cert, key),
        RecordingUpstream("pass.test", pass_ip, 80),
        RecordingUpstream("pass2.test", pass2_ip, 443, cert2, key2),
        {"pass.test": pass_ip, "sub.pass.test": pass_ip, "pass2.test": pass2_ip},
    )
    servers.cert_path = cert
    yield servers
    for server in servers.all():
        server.stop()


def pass_policy(upstreams, pass_upstreams, rules: str = PASS_RULES) -> str:
    return policy_text(upstreams, rules, extra_static_hosts(pass_upstreams.addresses))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstreams, pki, pass_upstreams):
    """One gateway with the passthrough policy for a whole module."""
    workdir = tmp_path_factory.mktemp("passthrough")
    policy = workdir / "policy.yaml"
    policy.write_text(pass_policy(upstreams, pass_upstreams))
    process = GatewayProcess(policy, workdir / "gw", upstream_ca=pki.ca_cert)
    process.start()
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def _fresh(upstreams, pass_upstreams):
    upstreams.reset()
    pass_upstreams.reset()
    yield
