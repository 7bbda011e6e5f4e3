"""Proxy tokens end to end (policy `identity: tokens:`, docs/identity.md): real clients send a signed
token as their proxy password; the gateway names the sandbox by the token's subject and judges it by
its profile, answers 407 for a missing, expired or bad one before any upstream connection, never
forwards Proxy-Authorization, never writes the token down, picks up rotated keys without a restart,
and does not let one connection switch sandboxes."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import requests

from bench.lib.tokens import claims, kubernetes_claims, new_signer, write_jwks
from tests.e2e.helpers import Conn, assert_untouched, connect_proxy, fresh_upstreams  # noqa: F401
from tests.conftest import policy_text
from tests.support.gateway import wait_for_port
from tests.support.mitmdump import clean_env, start_mitmdump, stop
from tests.support.waiting import wait_for

RULES = """
- id: web
  hosts: [allowed.test]
  schemes: [https, http]
- id: other
  hosts: [other.test]
  schemes: [https, http]
"""
SIGNER = new_signer("EdDSA")
CLUSTER = new_signer("RS256")  # a Kubernetes cluster's service-account key


def _extra(required: bool = True, profile_claim: str = "egress_profile") -> str:
    return f"""\
sandboxes:
  - id: agent
    rules: [web]
  - id: default
    rules: [other]
identity:
  tokens:
    keys: jwks.json
    audience: egress-gateway
    profile_claim: {profile_claim}
    required: {str(required).lower()}
"""


@pytest.fixture()
def token_gateway(start_gateway, tmp_path):
    def start(required: bool = True, profile_claim: str = "egress_profile", signers=(SIGNER,)):
        write_jwks(tmp_path / "jwks.json", *signers)
        return start_gateway(RULES, extra=_extra(required, profile_claim))
    return start


def _proxy(gateway, token: str | None, user: str = "sandbox") -> str:
    return f"http://{user}:{token}@{gateway.host}:{gateway.port}" if token else gateway.proxy_url


def _curl(gateway, url: str, token: str | None, *args: str) -> tuple[int, str, str]:
    """(CONNECT or request status, body, stderr) with the token as curl's proxy password."""
    out = subprocess.run(["curl", "-sS", "--max-time", "10", "--cacert", str(gateway.ca_cert), "-x",
                          _proxy(gateway, token), "-w", "\n%{http_connect} %{http_code}", url, *args],
                         capture_output=True, timeout=30)
    body, _, codes = out.stdout.decode().rpartition("\n")
    connect, _, code = codes.partition(" ")
    status = int(code) if code not in ("", "000") else int(connect or 0)
    return status, body, out.stderr.decode()


def _lines(gateway, **match) -> list[dict]:
    return [a for a in gateway.audit() if all(a.get(k) == v for k, v in match.items())]


def _no_token_anywhere(gateway, *tokens: str) -> None:
    text = gateway.audit_path.read_text() + gateway.log()
    for token in tokens:
        assert token not in text
        assert token.split(".")[2] not in text  # not even its signature


def test_a_valid_token_is_allowed_as_its_profile_with_curl_httpx_and_requests(token_gateway, upstreams):
    gateway = token_gateway()
    token = SIGNER.mint(claims("task-42", "agent"))
    status, body, err = _curl(gateway, "https://allowed.test/curl", token)
    assert status == 200 and "upstream allowed.test" in body, err
    with httpx.Client(proxy=_proxy(gateway, token), verify=str(gateway.ca_cert)) as client:
        assert client.get("https://allowed.test/httpx").status_code == 200
        assert client.get("http://allowed.test/httpx-plain").status_code == 200  # absolute-form
        denied = client.get("http://other.test/x")  # the profile does not grant it
        assert denied.status_code == 403 and denied.headers["X-Egress-Reason"] == "no_rule"
    with requests.Session() as session:
        session.proxies = {"https": _proxy(gateway, token), "http": _proxy(gateway, token)}
        session.verify = str(gateway.ca_cert)
        assert session.get("https://allowed.test/requests", verify=str(gateway.ca_cert)).status_code == 200
    lines = _lines(gateway, sandbox="task-42", decision="allow")
    assert {line["event"] for line in lines} >= {"connect", "request"}
    assert all(line["profile"] == "agent" and line["identity"] == "token" for line in lines)
    assert any(line.get("token") for line in lines if line["event"] == "connect")
    received = upstreams.tls["allowed.test"].requests + upstreams.plain["allowed.test"].requests
    assert len(received) == 4
    for request in received:  # the proxy credential stays on the sandbox's hop
        assert not any(name.lower() == "proxy-authorization" for name, _ in request.headers), request.headers
    _no_token_anywhere(gateway, token)


@pytest.mark.parametrize("case, reason", [("missing", "proxy_auth_required"), ("expired", "token_expired"),
                                          ("bad", "token_invalid"), ("wrong_audience", "token_invalid"),
                                          ("unknown_profile", "token_invalid")])
def test_a_missing_expired_or_bad_token_is_407_before_any_upstream(token_gateway, upstreams, case, reason):
    gateway = token_gateway()
    token = {
        "missing": None,
        "expired": SIGNER.mint(claims("t", "agent", now=time.time() - 3600, ttl=60)),
        "bad": new_signer("EdDSA", kid=SIGNER.kid).mint(claims("t", "agent")),
        "wrong_audience": SIGNER.mint(claims("t", "agent", audience="another")),
        "unknown_profile": SIGNER.mint(claims("t", "admin")),
    }[case]
    for url in ("https://allowed.test/x", "http://allowed.test/x"):
        with httpx.Client(proxy=_proxy(gateway, token), verify=str(gateway.ca_cert)) as client:
            if url.startswith("https"):
                with pytest.raises(httpx.ProxyError, match="407"):
                    client.get(url)
            else:
                response = client.get(url)
                assert response.status_code == 407 and response.headers["X-Egress-Reason"] == reason
                assert response.headers.get_list("Proxy-Authenticate") == ['Basic realm="egress-gateway"',
                                                                           'Bearer realm="egress-gateway"']
                assert response.headers["Connection"] == "close"
    refusals = _lines(gateway, reason=reason)
    assert {line["event"] for line in refusals} == {"connect", "request"} and all(l["status"] == 407 for l in refusals)
    assert_untouched(upstreams, "allowed.test")
    if token:
        _no_token_anywhere(gateway, token)


def test_the_connect_407_carries_the_challenges_and_closes(token_gateway, upstreams):
    gateway = token_gateway()
    conn = connect_proxy(gateway)
    conn.send(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
    response = conn.read_response(head_only=True)
    assert response.status == 407 and response.header("X-Egress-Reason") == "proxy_auth_required"
    assert [v for k, v in response.headers if k.lower() == "proxy-authenticate"] == [
        'Basic realm="egress-gateway"', 'Bearer realm="egress-gateway"']
    conn.read_exactly(int(response.header("Content-Length")))
    assert conn.sock.recv(1) == b""  # closed: a client retries with its credential on a new connection
    assert_untouched(upstreams, "allowed.test")


def test_without_required_a_client_without_a_token_is_named_by_its_address(token_gateway, upstreams):
    gateway = token_gateway(required=False)
    with httpx.Client(proxy=gateway.proxy_url) as client:
        assert client.get("http://other.test/anon").status_code == 200  # the default entry
        assert client.get("http://allowed.test/anon").status_code == 403
    with httpx.Client(proxy=_proxy(gateway, "not.a.token")) as client:
        assert client.get("http://allowed.test/bad").headers["X-Egress-Reason"] == "token_invalid"


def test_one_connection_cannot_switch_identity(token_gateway, upstreams):
    gateway = token_gateway(required=False)
    first, second = SIGNER.mint(claims("task-1", "agent")), SIGNER.mint(claims("task-2", "agent"))

    def request(conn: Conn, token: str | None, path: str):
        auth = f"Proxy-Authorization: Bearer {token}\r\n" if token else ""
        conn.send(f"GET http://allowed.test{path} HTTP/1.1\r\nHost: allowed.test\r\n{auth}\r\n".encode())
        return conn.read_response()

    conn = connect_proxy(gateway)
    assert request(conn, first, "/one").status == 200
    assert request(conn, first, "/two").status == 200
    switched = request(conn, second, "/three")
    assert (switched.status, switched.header("X-Egress-Reason")) == (407, "identity_changed")
    assert conn.sock.recv(1) == b""
    conn = connect_proxy(gateway)
    assert request(conn, first, "/four").status == 200
    assert request(conn, None, "/five").header("X-Egress-Reason") == "identity_changed"
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/one", "/two", "/four"]
    assert {line["sandbox"] for line in _lines(gateway, decision="allow")} == {"task-1"}


def test_a_proxy_authorization_inside_a_tunnel_is_not_identity_and_not_forwarded(token_gateway, upstreams):
    """The tunnel's identity is its CONNECT's; a Proxy-Authorization inside it (HTTP/1 here, h2 by
    the same request guard) names nobody and never reaches the origin."""
    gateway = token_gateway()
    token, other = SIGNER.mint(claims("task-1", "agent")), SIGNER.mint(claims("task-2", "agent"))
    with httpx.Client(proxy=_proxy(gateway, token), verify=str(gateway.ca_cert), http2=True) as client:
        response = client.get("https://allowed.test/inner", headers={"Proxy-Authorization": f"Bearer {other}"})
    assert response.status_code == 200
    [received] = upstreams.tls["allowed.test"].requests
    assert not any(name.lower() == "proxy-authorization" for name, _ in received.headers)
    assert {line["sandbox"] for line in _lines(gateway, event="request")} == {"task-1"}


def test_a_kubernetes_projected_token_works_as_it_is(start_gateway, tmp_path, upstreams):
    write_jwks(tmp_path / "jwks.json", CLUSTER)
    extra = _extra(profile_claim="kubernetes.io.serviceaccount.name").replace(
        "    audience: egress-gateway\n",
        "    audience: egress-gateway\n    issuer: https://kubernetes.default.svc.cluster.local\n    algorithms: [RS256]\n")
    gateway = start_gateway(RULES, extra=extra)
    token = CLUSTER.mint(kubernetes_claims("ci-jobs", "agent"))
    status, _body, err = _curl(gateway, "https://allowed.test/pod", token)
    assert status == 200, err
    [line] = _lines(gateway, event="request", decision="allow")
    assert line["sandbox"] == "system:serviceaccount:ci-jobs:agent" and line["profile"] == "agent"


def test_a_rotated_key_file_is_picked_up_without_a_restart(token_gateway, tmp_path, upstreams):
    old, new = new_signer("EdDSA"), new_signer("EdDSA")
    gateway = token_gateway(signers=(old,))
    old_token, new_token = old.mint(claims("t", "agent")), new.mint(claims("t", "agent"))

    def status(token: str) -> int:
        with httpx.Client(proxy=_proxy(gateway, token)) as client:
            return client.get("http://allowed.test/rotate").status_code

    assert (status(old_token), status(new_token)) == (200, 407)
    write_jwks(tmp_path / "jwks.json", new)  # the old key withdrawn, atomically (a ConfigMap update)
    wait_for(lambda: status(new_token) == 200, 10, "the new key to be picked up", interval=0.2)
    assert status(old_token) == 407


def test_git_and_pip_authenticate_with_the_proxy_url(token_gateway, upstreams, tmp_path):
    """Both take the token from the proxy URL as every client does; the recording upstream is no
    git server or package index, so what is checked is that their requests went through as the
    token's sandbox, without the credential."""
    gateway = token_gateway()
    token = SIGNER.mint(claims("ci-build-7", "agent"))
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", HOME=str(tmp_path), GIT_SSL_CAINFO=str(gateway.ca_cert))
    subprocess.run(["git", "-c", f"http.proxy={_proxy(gateway, token)}",
                    "ls-remote", "https://allowed.test/repo.git"], capture_output=True, env=env, timeout=60)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "0",
                    "--timeout", "10", "--no-cache-dir", "--isolated", "--proxy", _proxy(gateway, token), "--cert",
                    str(gateway.ca_cert), "--index-url", "https://allowed.test/simple/", "-d", str(tmp_path / "dl"),
                    "somepackage"], capture_output=True, env=env, timeout=120)
    paths = [r.path for r in upstreams.tls["allowed.test"].requests]
    assert any(p.startswith("/repo.git/info/refs") for p in paths), paths
    assert any(p.startswith("/simple/somepackage") for p in paths), paths
    for request in upstreams.tls["allowed.test"].requests:
        assert not any(name.lower() == "proxy-authorization" for name, _ in request.headers)
    assert {line["sandbox"] for line in _lines(gateway, event="request")} == {"ci-build-7"}
    _no_token_anywhere(gateway, token)


def test_explain_sandbox_profile_agrees_with_a_token_of_that_profile(token_gateway, upstreams):
    gateway = token_gateway()
    token = SIGNER.mint(claims("task-1", "agent"))
    for url in ("http://allowed.test/e", "http://other.test/e"):
        with httpx.Client(proxy=_proxy(gateway, token)) as client:
            live = client.get(url).headers.get("X-Egress-Reason", "allowed")
        out = subprocess.run([sys.executable, "-m", "gateway", "explain", "--policy",
                              str(gateway.policy), "--sandbox", "agent", "--format", "json", url],
                             capture_output=True, text=True, env=dict(os.environ), timeout=60)
        assert json.loads(out.stdout)["decision"]["reason"] == live, out.stdout + out.stderr



def test_limits_come_from_the_profile_and_count_per_token_subject(start_gateway, tmp_path, upstreams):
    write_jwks(tmp_path / "jwks.json", SIGNER)
    extra = _extra().replace("  - id: agent\n    rules: [web]\n",
                             "  - id: agent\n    rules: [web]\n    limits: {requests_per_minute: 2}\n")
    gateway = start_gateway(RULES, extra=extra)
    one, two = SIGNER.mint(claims("task-1", "agent")), SIGNER.mint(claims("task-2", "agent"))

    def status(token: str) -> int:
        with httpx.Client(proxy=_proxy(gateway, token)) as client:
            return client.get("http://allowed.test/limited").status_code

    assert [status(one), status(one), status(one)] == [200, 200, 429]
    assert [status(two), status(two), status(two)] == [200, 200, 429]  # its own window, the same limit


def test_the_flow_printer_never_shows_a_token_even_of_a_refused_request(tmp_path, pki, upstreams):
    """Review 23: under mitmdump with flow_detail=2 (the most the gateway allows), mitmproxy printed
    the Proxy-Authorization of refused requests and CONNECTs whole: a valid token anyone reading
    the output could reuse. The header leaves the flow as soon as it is read, whatever the verdict."""
    write_jwks(tmp_path / "jwks.json", SIGNER)
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES, _extra()))
    proc, proxy = start_mitmdump(tmp_path, policy, pki.ca_cert, ["--set", "flow_detail=2"], clean_env())
    token = SIGNER.mint(claims("task-7", "agent"))
    try:
        wait_for_port("127.0.0.1", proxy.port, process=proc)
        assert _curl(proxy, "https://allowed.test/ok", token)[0] == 200
        assert _curl(proxy, "https://other.test/refused-connect", token)[0] == 403
        assert _curl(proxy, "http://other.test/refused-plain", token)[0] == 403
    finally:
        stop(proc)
    out = proxy.log()
    assert "refused-plain" in out and "other.test:443" in out, out[-3000:]  # the refusals were printed
    assert token.split(".")[2] not in out and token.split(".")[1] not in out
    assert "proxy-authorization" not in out.lower(), out[-3000:]


def test_a_client_without_a_token_cannot_take_the_connections_of_token_sandboxes(start_gateway, tmp_path, upstreams):
    """Review 23: at accept, before any token is read, every client no source range names counted
    against `sandbox:default`: one client holding the cap (or draining the connection rate) reset
    every token sandbox's connections. Until its token names it, a connection counts against its
    own address."""
    write_jwks(tmp_path / "jwks.json", SIGNER)
    gateway = start_gateway(RULES, extra=_extra(), args=["--set", "egress_max_connections_per_sandbox=5"])
    other = ("127.0.0.3", 0)
    held = [socket.create_connection((gateway.host, gateway.port), timeout=10, source_address=other)
            for _ in range(6)]
    try:  # the sixth is refused at accept: the five before it are counted
        wait_for(lambda: _lines(gateway, reason="too_many_connections"), 10.0, "the sixth connection refused")
        token = SIGNER.mint(claims("task-8", "agent"))
        status, _, err = _curl(gateway, "https://allowed.test/after", token)
        assert status == 200, err
    finally:
        for sock in held:
            sock.close()
    refused = _lines(gateway, reason="too_many_connections")
    assert len(refused) == 1 and refused[0]["client"].startswith("127.0.0.3:"), refused
