"""Refusals an agent can act on (policy `refusals:`, gateway/refusal_page.py), through a real gateway:
the JSON body over plain HTTP, inside an intercepted CONNECT tunnel and over HTTP/2, the text
template otherwise, a refused CONNECT, a refusal made before any HTTP parsing, and a reload that
changes the format. Headers and the audit line are what they always were."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.conftest import policy_text
from tests.e2e.helpers import H2Client, TIMEOUT, connect_proxy, curl, get, tls_tunnel
from tests.support.gateway import GatewayProcess
from tests.support.waiting import wait_for

RULES = """
- id: api
  hosts: [allowed.test]
  schemes: [https, http]
  paths: ["/ok/**"]
"""
MESSAGE = "Blocked ({reason}, {status}). Ask in #platform-access quoting rule {rule}, host {host}, sandbox {sandbox}."
REFUSALS = f"""
sandboxes:
  - id: agent
    source_ips: [127.0.0.0/8]
    rules: [api]
refusals:
  message: "{MESSAGE}"
  format: negotiate
"""
JSON_KEYS = ["reason", "status", "message", "detail", "rule", "host", "sandbox", "retry_after", "notes"]
WANTS_JSON = ("Accept", "application/json")


def _message(reason: str, status: int, rule: str | None, host: str | None, sandbox: str | None = "agent") -> str:
    return MESSAGE.format(reason=reason, status=status, rule=rule or "(none)", host=host or "(none)",
                          sandbox=sandbox or "(none)")


@pytest.fixture
def refusing_gateway(tmp_path, pki, upstreams):
    """A gateway whose policy is written with `refusals` (`extra`, replaced on `rewrite`) and reloaded
    on SIGHUP only, so that a test knows when a new policy is in force."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES, REFUSALS))
    gateway = GatewayProcess(policy, tmp_path / "gw", upstream_ca=pki.ca_cert,
                             extra_args=["--set", "egress_policy_poll=0"])
    gateway.start()
    upstreams.reset()
    yield gateway
    gateway.stop()


def _json_error(body: str | bytes) -> dict:
    document = json.loads(body)
    assert list(document) == ["error"] and list(document["error"]) == JSON_KEYS, document
    return document["error"]


def _headers_as_always(headers, reason: str, rule: str | None) -> None:
    get_header = headers.get if hasattr(headers, "get") else headers
    assert get_header("X-Egress-Reason") == reason
    assert get_header("X-Egress-Rule") == rule
    assert get_header("Cache-Control") == "no-store"


def test_plain_http_json_with_curl_and_text_with_httpx(refusing_gateway):
    gateway = refusing_gateway
    refused = curl(gateway, "http://other.test/x", "-H", "Accept: application/json")
    assert refused.status == 403
    assert refused.header("Content-Type") == "application/json"
    assert refused.header("X-Egress-Reason") == "no_rule" and refused.header("X-Egress-Rule") is None
    error = _json_error(refused.body)
    assert error["reason"] == "no_rule" and error["status"] == 403
    assert error["message"] == _message("no_rule", 403, None, "other.test")
    assert (error["rule"], error["host"], error["sandbox"], error["retry_after"]) == (None, "other.test", "agent", None)
    # The audit line is unchanged: the gateway's own message, not the template.
    line = wait_for(lambda: [a for a in gateway.audit() if a.get("event") == "request" and a.get("host") == "other.test"],
                    TIMEOUT, "the refusal's audit line")[-1]
    assert line["message"] == error["detail"] and line["reason"] == "no_rule"

    with httpx.Client(proxy=gateway.proxy_url) as client:  # Accept: */*
        text = client.get("http://allowed.test/not-ok")
    assert text.status_code == 403 and text.headers["Content-Type"] == "text/plain; charset=utf-8"
    _headers_as_always(text.headers, "path_not_allowed", "api")
    lines = text.text.splitlines()
    assert lines[0] == _message("path_not_allowed", 403, "api", "allowed.test")
    assert lines[1].startswith("egress gateway: ") and "reason: path_not_allowed" in lines and "rule: api" in lines


def test_https_inside_a_tunnel_with_httpx(refusing_gateway):
    gateway = refusing_gateway
    with httpx.Client(proxy=gateway.proxy_url, verify=str(gateway.ca_cert)) as client:
        refused = client.get("https://allowed.test/admin", headers={"Accept": "application/json, text/plain, */*"})
        text = client.get("https://allowed.test/admin")
    assert refused.status_code == 403 and refused.headers["Content-Type"] == "application/json"
    _headers_as_always(refused.headers, "path_not_allowed", "api")
    error = _json_error(refused.content)
    assert error["message"] == _message("path_not_allowed", 403, "api", "allowed.test")
    assert (error["rule"], error["host"]) == ("api", "allowed.test")
    assert text.status_code == 403 and text.text.startswith(_message("path_not_allowed", 403, "api", "allowed.test"))


def test_http2_json_and_text(refusing_gateway):
    gateway = refusing_gateway
    conn = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])
    try:
        client = H2Client(conn)
        wants_json = client.send("allowed.test", "/admin", extra=[("accept", "application/json")])
        wants_text = client.send("allowed.test", "/admin", extra=[("accept", "text/plain")])
        client.wait(wants_json, wants_text)
    finally:
        conn.close()
    assert client.responses[wants_json]["status"] == 403
    assert client.header(wants_json, "content-type") == "application/json"
    assert client.header(wants_json, "x-egress-reason") == "path_not_allowed"
    assert client.header(wants_json, "x-egress-rule") == "api"
    assert _json_error(client.responses[wants_json]["body"])["host"] == "allowed.test"
    assert client.header(wants_text, "content-type") == "text/plain; charset=utf-8"
    assert client.responses[wants_text]["body"].decode().startswith(
        _message("path_not_allowed", 403, "api", "allowed.test"))


def test_a_refused_connect_answers_in_json_when_asked(refusing_gateway):
    with connect_proxy(refusing_gateway) as conn:
        conn.send(b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\nAccept: application/json\r\n\r\n")
        response = conn.read_response()
    assert response.status == 403 and response.header("Content-Type") == "application/json"
    error = _json_error(response.body)
    assert (error["reason"], error["host"], error["rule"]) == ("no_rule", "other.test", None)


def test_a_reload_changes_the_format_and_a_refusal_before_http_parsing_follows_it(refusing_gateway, upstreams):
    gateway = refusing_gateway
    # h2c prior knowledge on the proxy port is refused before any HTTP parsing: no Accept to
    # negotiate on, so text.
    with connect_proxy(gateway) as conn:
        conn.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        before = conn.read_response()
    assert before.status == 400 and before.header("Content-Type") == "text/plain; charset=utf-8"
    assert before.text.splitlines()[0] == _message("h2c_refused", 400, None, None)

    gateway.policy.write_text(policy_text(upstreams, RULES, REFUSALS.replace("negotiate", "json").replace(
        "#platform-access", "#egress-help")))
    gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: [a for a in gateway.audit() if a.get("event") == "policy_reload" and a.get("result") == "ok"],
             8.0, "the SIGHUP reload", detail=lambda: gateway.log()[-2000:])

    with connect_proxy(gateway) as conn:
        conn.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        after = conn.read_response()
    assert after.status == 400 and after.header("Content-Type") == "application/json"
    assert after.header("X-Egress-Reason") == "h2c_refused"
    error = _json_error(after.body)
    assert error["message"] == _message("h2c_refused", 400, None, None).replace("#platform-access", "#egress-help")
    assert (error["host"], error["rule"]) == (None, None)

    with connect_proxy(gateway) as conn:  # no Accept at all: json is json
        plain = get(conn, "http://other.test/x", "other.test")
    assert plain.status == 403 and _json_error(plain.body)["reason"] == "no_rule"
