"""A gateway for the two bound-rule leak classes (placeholder positions, foreign credentials), started
per test module with tests.e2e.helpers.shared_gateway, in front of real echo origins
(tests.credentials.servers.EchoUpstream: they reflect every credential they get, decoded and
re-encoded, and count TCP connections).

Rules (all names on one echo origin at BLOCK.<first>, `open.test` on its own at BLOCK.<first+1>):
- `pos`      pos.test: injects X-Injected; placeholders in header values, the query parameters
             api_key and sig, and whole path segments (`placeholders: {query: [api_key, sig], path: true}`)
- `strict`   strict.test: injects X-Api-Key; placeholders in header values only (the defaults)
- `anthropic` anthropic.test: like policies/model-api.yaml (POST /v1/messages, injects x-api-key)
- `partner`  partner.test: injects the query parameter sig; its own foreign set
             (`headers: [Authorization, X-Partner-Token, Cookie], query: [token]`)
- `report`   report.test: mode report, paths /v1/ok/**, injects X-Api-Key
- `plainph`  api.test (the standard recording upstream, plain http too): allow_plaintext_credentials
- `open`     open.test: no credential at all
Sandboxes: 127.0.0.2 is `alpha`, everyone else `default`; both may use every rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from gateway.credentials import load_placeholder_key, placeholder
from tests.e2e.helpers import shared_gateway
from tests.support.gateway import GatewayProcess

from .servers import EchoUpstream

# The pos secret starts with a hex digit: after a sandbox's `%2`, its encoded form would complete an
# escape (`%2e` is "."), the issue's example.
SECRETS = {
    "pos_key": "e4Rf/Ab+Cd=Ef&Gh9_live",
    "strict_key": "sk-Strict7Yy8Xx/9Ww+0Vv=",
    "anthropic_key": "sk-ant-api03-Platform9Key8Zz7",
    "partner_key": "pt-Partner+Sig/5Qq=6Rr",
}
ENV = {name: f"EGRESS_BOUND_{name.upper()}" for name in SECRETS}
ALPHA_SOURCE = "127.0.0.2"
ECHO_NAMES = ["pos.test", "strict.test", "anthropic.test", "partner.test", "report.test"]

RULES = """
- id: pos
  hosts: [pos.test]
  inject:
    - header: X-Injected
      value: "${secrets.pos_key}"
  placeholders:
    query: [api_key, sig]
    path: true
- id: strict
  hosts: [strict.test]
  inject:
    - header: X-Api-Key
      value: "${secrets.strict_key}"
- id: anthropic
  hosts: [anthropic.test]
  methods: [POST]
  paths: [/v1/messages, /v1/messages/count_tokens]
  inject:
    - header: x-api-key
      value: "${secrets.anthropic_key}"
- id: partner
  hosts: [partner.test]
  inject:
    - query: sig
      value: "${secrets.partner_key}"
  foreign_credentials:
    headers: [Authorization, X-Partner-Token, Cookie]
    query: [token]
- id: report
  hosts: [report.test]
  mode: report
  paths: ["/v1/ok/**"]
  inject:
    - header: X-Api-Key
      value: "${secrets.strict_key}"
- id: plainph
  hosts: [api.test]
  schemes: [http, https]
  allow_plaintext_credentials: true
  inject:
    - header: X-Injected
      value: "${secrets.pos_key}"
- id: open
  hosts: [open.test]
"""
RULE_IDS = "pos, strict, anthropic, partner, report, plainph, open"


@dataclass
class Bound:
    gateway: GatewayProcess
    echo: EchoUpstream
    open: EchoUpstream
    upstreams: object
    secrets: dict[str, str]

    def ph(self, secret: str, sandbox: str = "default") -> str:
        return placeholder(load_placeholder_key(self.gateway.confdir), secret, sandbox)

    def reset(self) -> None:
        self.echo.reset()
        self.open.reset()
        self.upstreams.reset()

    def assert_nothing_sent(self) -> None:
        """Not even a TCP connection reached an origin."""
        assert self.echo.connections == 0 and not self.echo.requests, [(r.method, r.path) for r in self.echo.requests]
        assert self.open.connections == 0
        assert not self.upstreams.tls["api.test"].touched and not self.upstreams.plain["api.test"].touched

    def audit_line(self, reason: str) -> dict:
        lines = [line for line in self.gateway.audit() if line.get("event") == "request" and line["reason"] == reason]
        assert lines, f"no audit line with reason {reason}"
        return lines[-1]


def start(tmp_path_factory, upstreams, pki, first: int, name: str) -> Bound:
    block = upstreams.block
    cert, key = pki.issue(ECHO_NAMES, [f"{block}.{first}"], stem=f"{name}-echo")
    echo = EchoUpstream(f"{name}-echo", f"{block}.{first}", 443, cert, key)
    cert, key = pki.issue(["open.test"], [f"{block}.{first + 1}"], stem=f"{name}-open")
    open_ = EchoUpstream(f"{name}-open", f"{block}.{first + 1}", 443, cert, key)
    hosts = [f'    {n}: ["{block}.{first}"]' for n in ECHO_NAMES] + [f'    open.test: ["{block}.{first + 1}"]']
    extra = "\n".join([
        "# the bound-rule leak classes: static hosts, secrets, sandboxes",
        *hosts,
        "secrets:",
        *[f"  {secret}: {{env: {var}}}" for secret, var in ENV.items()],
        "sandboxes:",
        "  - id: alpha",
        f"    source_ips: [{ALPHA_SOURCE}/32]",
        f"    rules: [{RULE_IDS}]",
        "  - id: default",
        f"    rules: [{RULE_IDS}]",
    ]) + "\n"
    patch = pytest.MonkeyPatch()
    try:
        for secret, var in ENV.items():
            patch.setenv(var, SECRETS[secret])
        gateway = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name=name)
    finally:
        patch.undo()
    return Bound(gateway, echo, open_, upstreams, dict(SECRETS))


def stop(bound: Bound) -> None:
    bound.gateway.stop()
    bound.echo.stop()
    bound.open.stop()


def fixtures(first: int, label: str, name: str = "b"):
    """A test module's two fixtures, assigned at its top level (`b, _fresh_b = bound.fixtures(...)`):
    `name`, this world for the module (its origins at BLOCK.<first> and <first + 1>), and an autouse
    one that gives every test using it empty records."""
    @pytest.fixture(scope="module", name=name)
    def world(tmp_path_factory, upstreams, pki):
        state = start(tmp_path_factory, upstreams, pki, first, label)
        yield state
        stop(state)

    @pytest.fixture(autouse=True, name=f"_fresh_{name}")
    def fresh(request):
        if name in request.fixturenames:
            request.getfixturevalue(name).reset()
        yield

    return world, fresh


def sdk_env(bound: Bound, **extra: str) -> dict[str, str]:
    """The environment of a process in the sandbox: the gateway as HTTPS proxy, its CA trusted,
    no proxy exceptions, no real secret anywhere."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("no_proxy", "http_proxy", "https_proxy", "all_proxy") and not k.startswith("EGRESS_")
           and not k.startswith("ANTHROPIC_")}
    env.update(HTTPS_PROXY=bound.gateway.proxy_url, SSL_CERT_FILE=str(bound.gateway.ca_cert), **extra)
    return env
