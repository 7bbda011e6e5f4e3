"""One gateway for the whole credentials suite (a process start costs seconds), its secrets and the
echo upstreams it talks to.

Upstreams (TLS on port 443, in the session's 127.X.0.0/24 block next to the standard ones):
- `echo`   (.20): echo.test (rule `echo`, Authorization from env secret api_token, paths /v1/**),
                  qecho.test (rule `qecho`, query parameter api_key from env secret query_key),
                  ph.test (rule `ph`, X-Api-Key from file secret ph_token; for placeholders)
- `mirror` (.21): mirror.test (rule `mirror`, no credential; it knows api_token by itself and
                  leaks it in response headers)
- `void`   (.22): missing-env.test, missing-file.test, dir-file.test (rules whose secret cannot be read)
- `rotate` (.23): rotate.test (file secret rewritten in place), k8s.test (Kubernetes-style
                  `..data` symlink volume)
The standard recording upstreams are used too: allowed.test/other.test (rule `mirror`, no
credential), deep.wild.test (rule `wild`, `*.wild.test` with allow_wildcard_credentials) and
api.test (rule `plain`, http and https with allow_plaintext_credentials).

Sandboxes: clients from 127.0.0.2 are sandbox `alpha`, every other client is `default`; both may
use every rule (placeholders differ per sandbox).
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.helpers import shared_gateway
from tests.support.gateway import GatewayProcess

from .servers import EchoUpstream

SECRETS = {
    "api_token": "tok-A1b2+C3d4/E5f6=G7h8&I9j0_live",
    "query_key": "qk 7Hh/9Kk+3Mm=5Nn?6Pp#8Rr",
    "ph_token": "ph-Secret_Zz9Yy8Xx7Ww6Vv5Uu4",
    "wild_token": "wild-Aa11Bb22Cc33Dd44Ee",
    "plain_token": "plain-Ee55Ff66Gg77Hh88Ii",
}
ENV = {
    "api_token": "EGRESS_CRED_API_TOKEN",
    "query_key": "EGRESS_CRED_QUERY_KEY",
    "wild_token": "EGRESS_CRED_WILD_TOKEN",
    "plain_token": "EGRESS_CRED_PLAIN_TOKEN",
}
MISSING_ENV = "EGRESS_CRED_NEVER_SET"
ROTATE_INITIAL = "rot-0000-Initial-Value-aaaa"
K8S_INITIAL = "k8s-0000-Initial-Value-bbbb"
ALPHA_SOURCE = "127.0.0.2"

RULES = """
- id: echo
  hosts: [echo.test]
  paths: ["/v1/**"]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.api_token}"
- id: qecho
  hosts: [qecho.test]
  paths: ["/v1/**"]
  inject:
    - query: api_key
      value: "${secrets.query_key}"
- id: ph
  hosts: [ph.test]
  inject:
    - header: X-Api-Key
      value: "${secrets.ph_token}"
- id: mirror
  hosts: [mirror.test, allowed.test, other.test]
- id: wild
  hosts: ["*.wild.test"]
  allow_wildcard_credentials: true
  inject:
    - header: X-Wild-Token
      value: "${secrets.wild_token}"
- id: plain
  hosts: [api.test]
  schemes: [http, https]
  allow_plaintext_credentials: true
  inject:
    - header: Authorization
      value: "token ${secrets.plain_token}"
- id: missing-env
  hosts: [missing-env.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.missing_env}"
- id: missing-file
  hosts: [missing-file.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.missing_file}"
- id: dir-file
  hosts: [dir-file.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.dir_file}"
- id: rotate
  hosts: [rotate.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.rotating}"
- id: k8s
  hosts: [k8s.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.k8s_token}"
"""
RULE_IDS = ["echo", "qecho", "ph", "mirror", "wild", "plain", "missing-env", "missing-file", "dir-file", "rotate",
            "k8s"]

SERVERS = {
    "echo": (20, ["echo.test", "qecho.test", "ph.test"]),
    "mirror": (21, ["mirror.test"]),
    "void": (22, ["missing-env.test", "missing-file.test", "dir-file.test"]),
    "rotate": (23, ["rotate.test", "k8s.test"]),
}


@dataclass
class Cred:
    gateway: GatewayProcess
    policy: Path
    servers: dict[str, EchoUpstream]
    secret_dir: Path
    rotating_file: Path
    k8s_dir: Path
    # every secret value the gateway ever held in this session (rotations add to it)
    values: dict[str, str] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)

    @property
    def echo(self) -> EchoUpstream:
        return self.servers["echo"]

    @property
    def mirror(self) -> EchoUpstream:
        return self.servers["mirror"]

    @property
    def void(self) -> EchoUpstream:
        return self.servers["void"]

    @property
    def rotate(self) -> EchoUpstream:
        return self.servers["rotate"]

    def remember(self, value: str) -> None:
        if value not in self.history:
            self.history.append(value)

    def all_values(self) -> dict[str, str]:
        found = dict(self.values)
        for i, value in enumerate(self.history):
            found[f"history[{i}]"] = value
        return found


def write_secret(path: Path, value: str) -> None:
    """Rewrite a secret file in place (same inode), as an editor or `kubectl cp` would."""
    with open(path, "w") as handle:
        handle.write(value + "\n")


def k8s_publish(directory: Path, value: str, stamp: str) -> None:
    """Kubernetes' atomic Secret volume update: a new timestamped dir, then `..data` swapped to it."""
    target = directory / f"..{stamp}"
    target.mkdir()
    (target / "token").write_text(value + "\n")
    tmp_link = directory / "..data_tmp"
    if tmp_link.is_symlink():
        tmp_link.unlink()
    os.symlink(f"..{stamp}", tmp_link)
    os.replace(tmp_link, directory / "..data")


def extra_sections(upstreams, secret_dir: Path, rotating: Path, k8s_dir: Path) -> str:
    hosts = []
    for _, (last, names) in SERVERS.items():
        hosts += [f'    {name}: ["{upstreams.block}.{last}"]' for name in names]
    rules = ", ".join(RULE_IDS)
    return "\n".join([
        "# credentials suite: extra static hosts, secrets and sandboxes",
        *hosts,
        "secrets:",
        *[f"  {name}: {{env: {var}}}" for name, var in ENV.items()],
        f"  missing_env: {{env: {MISSING_ENV}}}",
        f"  ph_token: {{file: {secret_dir / 'ph_token'}}}",
        f"  missing_file: {{file: {secret_dir / 'does-not-exist'}}}",
        f"  dir_file: {{file: {secret_dir / 'a-directory'}}}",
        f"  rotating: {{file: {rotating}}}",
        f"  k8s_token: {{file: {k8s_dir / 'token'}}}",
        "sandboxes:",
        "  - id: alpha",
        f"    source_ips: [{ALPHA_SOURCE}/32]",
        f"    rules: [{rules}]",
        "  - id: default",
        f"    rules: [{rules}]",
    ]) + "\n"


@pytest.fixture(scope="session")
def cred(tmp_path_factory, upstreams, pki) -> Cred:
    servers = {}
    for key, (last, names) in SERVERS.items():
        address = f"{upstreams.block}.{last}"
        cert, cert_key = pki.issue(names, [address], stem=f"cred-{key}")
        servers[key] = EchoUpstream(key, address, 443, cert, cert_key,
                                    fallback_token=SECRETS["api_token"] if key == "mirror" else None)
    secret_dir = tmp_path_factory.mktemp("secrets")
    (secret_dir / "a-directory").mkdir()
    write_secret(secret_dir / "ph_token", SECRETS["ph_token"])
    rotating = secret_dir / "rotating"
    write_secret(rotating, ROTATE_INITIAL)
    k8s_dir = secret_dir / "k8s"
    k8s_dir.mkdir()
    k8s_publish(k8s_dir, K8S_INITIAL, "2026_01_01_00_00_00.000000001")
    os.symlink("..data/token", k8s_dir / "token")

    patch = pytest.MonkeyPatch()
    try:
        for name, var in ENV.items():
            patch.setenv(var, SECRETS[name])
        patch.delenv(MISSING_ENV, raising=False)
        gateway = shared_gateway(tmp_path_factory, upstreams, pki, RULES,
                                 extra_sections(upstreams, secret_dir, rotating, k8s_dir), name="cred")
    finally:
        patch.undo()  # the gateway read its env secrets at load; the tests' own env stays clean
    state = Cred(gateway, gateway.policy, servers, secret_dir, rotating, k8s_dir, values=dict(SECRETS))
    state.remember(ROTATE_INITIAL)
    state.remember(K8S_INITIAL)
    yield state
    gateway.stop()
    for server in servers.values():
        server.stop()


def another_gateway(cred: Cred, workdir: Path, pki, args: list[str]) -> GatewayProcess:
    """A gateway of its own on the shared world's policy and origins, started with `args` (its env
    secrets set only while it loads, as for the shared one)."""
    patch = pytest.MonkeyPatch()
    try:
        for name, var in ENV.items():
            patch.setenv(var, SECRETS[name])
        return GatewayProcess(cred.policy, workdir, upstream_ca=pki.ca_cert, extra_args=args).start()
    finally:
        patch.undo()


@pytest.fixture(autouse=True)
def _fresh(request, upstreams):
    """Empty upstream records before every test (the shared gateway is not restarted)."""
    upstreams.reset()
    if "cred" in request.fixturenames:
        for server in request.getfixturevalue("cred").servers.values():
            server.reset()
    yield


def dedent(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def pytest_collection_modifyitems(session, config, items):
    """The log search (test_logs.py) runs last, so it sees everything the rest of the suite made the
    shared gateway write (rotated values included)."""
    last = [item for item in items if item.nodeid.startswith("tests/credentials/test_logs.py")]
    if last:
        items[:] = [item for item in items if item not in last] + last
