"""Placeholders: `egress-gateway placeholders` prints env lines a sandbox can hold instead of the
real secrets (stable, different per sandbox). The gateway swaps a placeholder for the real value
only on an approved request to a rule bound to that secret, for the sandbox it was issued to, where
it stands as a whole token in a position the rule allows; on such a rule any other placeholder is
refused (placeholder_misuse: tests/credentials/test_placeholder_positions.py has the whole class).
On a rule with no credential it is forwarded unchanged."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from gateway.credentials import load_placeholder_key, placeholder
from tests.e2e.helpers import audit_for, get
from tests.support.gateway import PROJECT_ROOT

from .clients import assert_no_leak, fetch, response_bytes, tls_to
from .conftest import ALPHA_SOURCE, ENV, MISSING_ENV, SECRETS

FILE_SECRETS = ("ph_token", "missing_file", "dir_file", "rotating", "k8s_token")


def run_placeholders(cred, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    return subprocess.run([sys.executable, "-m", "gateway", "placeholders", "--policy", str(cred.policy),
                           "--confdir", str(cred.gateway.confdir), *args],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, env=env, timeout=30)


def parse_env_lines(stdout: str) -> dict[str, str]:
    found = {}
    for line in stdout.splitlines():
        [assignment] = shlex.split(line)
        name, _, value = assignment.partition("=")
        found[name] = value
    return found


@pytest.fixture(scope="module")
def issued(cred) -> dict[str, dict[str, str]]:
    """Placeholder env lines per sandbox, from the real CLI (run twice: they must be stable)."""
    result = {}
    for sandbox in ("default", "alpha"):
        first = run_placeholders(cred, "--sandbox", sandbox)
        second = run_placeholders(cred, "--sandbox", sandbox)
        assert first.returncode == 0, first.stderr
        assert first.stdout == second.stdout, "placeholders changed between two calls"
        result[sandbox] = parse_env_lines(first.stdout)
        result[f"{sandbox}:stdout"] = first.stdout
    return result


def env_name(secret: str) -> str:
    return {**ENV, "missing_env": MISSING_ENV}.get(secret, secret.upper())


def test_placeholders_output(cred, issued):
    key = load_placeholder_key(cred.gateway.confdir)
    for sandbox in ("default", "alpha"):
        lines = issued[f"{sandbox}:stdout"].splitlines()
        secrets = sorted([*ENV, "missing_env", *FILE_SECRETS])
        assert [line.split("=", 1)[0] for line in lines] == [env_name(s) for s in secrets]
        values = issued[sandbox]
        for secret in secrets:
            value = values[env_name(secret)]
            assert re.fullmatch(rf"egress-placeholder-{secret}-[0-9a-f]{{40}}", value), value
            assert value == placeholder(key, secret, sandbox)
        assert_no_leak(issued[f"{sandbox}:stdout"], cred.all_values(), "placeholders output")
    # different per sandbox, and different from clients outside any sandbox
    assert not set(issued["default"].values()) & set(issued["alpha"].values())
    assert issued["default"][env_name("api_token")] != placeholder(key, "api_token", None)


def test_placeholders_refuses_an_unknown_sandbox(cred):
    result = run_placeholders(cred, "--sandbox", "nope")
    assert result.returncode == 2
    assert "nope" in result.stderr and not result.stdout


def _ph(issued, sandbox: str, secret: str = "ph_token") -> str:
    return issued[sandbox][env_name(secret)]


def test_placeholder_is_swapped_on_the_bound_host(cred, issued):
    token = _ph(issued, "default")
    response = fetch(cred.gateway, "ph.test", "/v1/anything?q=1",
                     headers=[("Authorization", f"Bearer {token}"), ("X-Note", f"prefix {token} suffix")])
    assert response.status == 200
    [seen] = cred.echo.for_host("ph.test")
    real = SECRETS["ph_token"]
    assert seen.header_all("authorization") == [f"Bearer {real}"]
    assert seen.header_all("x-note") == [f"prefix {real} suffix"]
    assert seen.header_all("x-api-key") == [real]  # the rule's own injection
    assert seen.path == "/v1/anything?q=1"
    assert token not in seen.everything()
    assert_no_leak(response_bytes(response), SECRETS)
    lines = [line for line in cred.gateway.audit() if line["event"] == "request" and line["host"] == "ph.test"]
    assert lines and lines[-1]["injected"] == ["ph_token"]


def test_placeholder_of_a_bound_secret_in_another_header(cred, issued):
    token = _ph(issued, "default", "api_token")
    response = fetch(cred.gateway, "echo.test", "/v1/anything", headers=[("X-Other-Key", token)])
    assert response.status == 200
    [seen] = cred.echo.for_host("echo.test")
    assert seen.header_all("x-other-key") == [SECRETS["api_token"]]
    assert_no_leak(response_bytes(response), SECRETS)


def test_placeholder_in_a_query_parameter_the_rule_does_not_name_is_refused(cred, issued):
    """Rule ph names no query parameter for placeholders (placeholders.query): `?key=<ph>` is
    refused before anything is sent, not swapped into a URL the sandbox chose the bytes of."""
    token = _ph(issued, "default")
    response = fetch(cred.gateway, "ph.test", f"/v1/anything?key={token}")
    assert response.status == 403 and response.egress_reason == "placeholder_misuse", response.text
    assert "query parameter key" in response.text
    assert not cred.echo.touched
    [line] = [line for line in cred.gateway.audit() if line["event"] == "request" and line["host"] == "ph.test"
              and line["reason"] == "placeholder_misuse"][-1:]
    assert line["location"] == "query parameter key" and not line.get("injected")


@pytest.mark.parametrize("host, secret", [
    ("echo.test", "ph_token"),       # bound, but to another secret
    ("ph.test", "api_token"),
])
def test_placeholder_of_another_secret_on_a_bound_rule_is_refused(cred, issued, host, secret):
    token = _ph(issued, "default", secret)
    response = fetch(cred.gateway, host, "/v1/anything", headers=[("X-Other-Key", token)])
    assert response.status == 403 and response.egress_reason == "placeholder_misuse", response.text
    assert not cred.echo.touched


@pytest.mark.parametrize("host, secret", [
    ("mirror.test", "ph_token"),     # a host with no credential at all
    ("allowed.test", "api_token"),
])
def test_placeholder_elsewhere_is_forwarded_unchanged(cred, upstreams, issued, host, secret):
    token = _ph(issued, "default", secret)
    response = fetch(cred.gateway, host, f"/v1/anything?key={token}", headers=[("X-Other-Key", token)])
    assert response.status == 200
    if host == "allowed.test":
        [received] = upstreams.tls[host].requests
        headers = dict((k.lower(), v) for k, v in received.headers)
        assert headers["x-other-key"] == token and received.path.endswith(token)
        return
    server = cred.mirror if host == "mirror.test" else cred.echo
    [seen] = server.for_host(host)
    assert seen.header_all("x-other-key") == [token]
    assert seen.path == f"/v1/anything?key={token}"
    assert SECRETS[secret] not in seen.everything()


def test_placeholders_belong_to_their_sandbox(cred, issued):
    mine, theirs = _ph(issued, "alpha"), _ph(issued, "default")
    with tls_to(cred.gateway, "ph.test", source=ALPHA_SOURCE) as tls:
        assert get(tls, "/v1/anything/a", "ph.test", extra=[("Authorization", f"Bearer {mine}")]).status == 200
        refused = get(tls, "/v1/anything/b", "ph.test", extra=[("Authorization", f"Bearer {theirs}")])
        client = tls.client
    assert client.startswith(ALPHA_SOURCE)
    assert refused.status == 403 and refused.egress_reason == "placeholder_misuse"  # another sandbox's
    [first] = cred.echo.for_host("ph.test")
    assert first.header_all("authorization") == [f"Bearer {SECRETS['ph_token']}"]
    lines = [line for line in audit_for(cred.gateway, client, count=3) if line["event"] == "request"]
    assert {line["sandbox"] for line in lines} == {"alpha"}
    # and the other way round: alpha's placeholder from the default sandbox
    cred.echo.reset()
    response = fetch(cred.gateway, "ph.test", "/v1/anything", headers=[("Authorization", f"Bearer {mine}")])
    assert response.status == 403 and response.egress_reason == "placeholder_misuse"
    assert not cred.echo.touched


SDK_SCRIPT = textwrap.dedent("""
    # What an SDK does: the key from the environment, a base URL, HTTPS_PROXY and SSL_CERT_FILE honoured.
    import json, os, sys
    import httpx
    key = os.environ["PH_TOKEN"]
    with httpx.Client(base_url="https://ph.test", timeout=10) as client:
        response = client.post("/v1/anything/chat/completions", json={"model": "m", "messages": []},
                               headers={"Authorization": f"Bearer {key}"})
    print(json.dumps({"status": response.status_code, "body": response.text}))
""")


def test_sdk_style_client_holding_only_the_placeholder(cred, issued, tmp_path):
    script = tmp_path / "sdk.py"
    script.write_text(SDK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy",
                                                                    "all_proxy")}
    env.update(issued["default"])
    env.update(HTTPS_PROXY=cred.gateway.proxy_url, SSL_CERT_FILE=str(cred.gateway.ca_cert))
    for secret_env in ENV.values():
        env.pop(secret_env, None)
        env[secret_env] = issued["default"][secret_env]  # the sandbox holds placeholders only
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert_no_leak(result.stdout + result.stderr, SECRETS, "SDK output")
    output = json.loads(result.stdout)
    assert output["status"] == 200
    [seen] = cred.echo.for_host("ph.test")
    assert seen.method == "POST" and seen.header_all("authorization") == [f"Bearer {SECRETS['ph_token']}"]
    assert json.loads(seen.body) == {"model": "m", "messages": []}
