"""Leak class 9 of issue 13, end to end: a bound rule carries only the platform's credential.

Exfiltration through an allowed API with the attacker's own key: a request on a rule bound to a
secret that carries another credential in an auth header or query parameter is refused (403
foreign_credential, audited with which header or parameter, never its value) before a byte goes
upstream. What the rule injects is replaced anyway, and a placeholder the gateway swaps is the
platform's. A real SDK (anthropic, from PyPI) holding only a placeholder keeps working; the same
SDK with a key of its own is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from urllib.parse import parse_qsl, urlsplit

import httpx
import pytest
import requests

from tests.e2e.helpers import H2Client, assert_refused, client_tls_context, curl, tls_tunnel

from . import bound as world
from .clients import assert_no_leak, fetch, response_bytes

STRICT = world.SECRETS["strict_key"]
ANTHROPIC = world.SECRETS["anthropic_key"]


b, _fresh_b = world.fixtures(42, "foreign")


def _refused(b, response, location: str, own: str = "sk-own-key-0001") -> dict:
    assert_refused(response, 403, "foreign_credential")
    b.assert_nothing_sent()
    text = response_bytes(response).decode("utf-8", "replace") if hasattr(response, "body") else response.text
    assert location.lower() in text.lower() and own not in text
    line = b.audit_line("foreign_credential")
    assert line["location"].lower() == location.lower() and not line.get("injected")
    assert own not in json.dumps(line), line  # which header or parameter, never its value
    return line


# --- the attacker's own key: every client, every spelling ----------------------------------------


def test_curl_own_authorization_on_a_rule_that_injects_another_header(b):
    result = curl(b.gateway, "https://strict.test/v1/anything", "-H", "Authorization: Bearer sk-own-key-0001")
    assert result.status == 403 and result.header("X-Egress-Reason") == "foreign_credential", result
    assert "header authorization" in result.body.lower() and "sk-own-key-0001" not in result.body
    b.assert_nothing_sent()
    assert b.audit_line("foreign_credential")["location"].lower() == "header authorization"  # curl may speak h2


def test_requests_own_key_in_the_query_is_refused_and_not_logged(b):
    response = requests.get("https://strict.test/v1/anything", params={"q": "1", "key": "sk-own-key-0001"},
                            proxies={"https": b.gateway.proxy_url}, verify=str(b.gateway.ca_cert), timeout=10)
    assert response.status_code == 403 and response.headers["X-Egress-Reason"] == "foreign_credential"
    b.assert_nothing_sent()
    line = b.audit_line("foreign_credential")
    assert line["location"] == "query parameter key"
    assert line["path"] == "/v1/anything?q=1&key=[REDACTED]"


def test_httpx_over_http2_lowercase_and_underscore_spellings(b):
    with httpx.Client(proxy=b.gateway.proxy_url, verify=client_tls_context(b.gateway), timeout=10,
                      http2=False) as client:
        for name in ("x_goog_api_key", "Api-Key", "PROXY-AUTHORIZATION"):
            response = client.get("https://strict.test/v1/anything", headers={name: "sk-own-key-0001"})
            assert response.status_code == 403 and response.headers["x-egress-reason"] == "foreign_credential", name
    with tls_tunnel(b.gateway, "strict.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.send("strict.test", "/v1/anything", extra=[("authorization", "token sk-own-key-0001")])
        h2.wait(stream)
    assert h2.responses[stream]["status"] == 403
    assert h2.header(stream, "x-egress-reason") == "foreign_credential"
    b.assert_nothing_sent()


@pytest.mark.parametrize("path, headers, location", [
    ("/v1/anything", [("X_Api_Key", "sk-own-key-0001")], "header X_Api_Key"),   # a look-alike of the injected one
    ("/v1/anything", [("Authorization", "Bearer {ph} sk-own-key-0001")], "header Authorization"),
    ("/v1/anything", [("Authorization", "sk-own-key-0001 {ph}")], "header Authorization"),
    ("/v1/anything", [("Authorization", "Bearer {ph}"), ("authorization", "sk-own-key-0001")], "header authorization"),
    ("/v1/anything?API_KEY=sk-own-key-0001", [], "query parameter API_KEY"),
    ("/v1/anything?api%5Fkey=sk-own-key-0001", [], "query parameter api%5Fkey"),
    ("/v1/anything?key[]=sk-own-key-0001", [], "query parameter key[]"),
    ("/v1/anything?q=1;access_token=sk-own-key-0001", [], "query parameter access_token"),
], ids=lambda v: str(v)[:40])
def test_spellings_of_an_own_key(b, path, headers, location):
    ph = b.ph("strict_key")
    response = fetch(b.gateway, "strict.test", path, headers=[(k, v.format(ph=ph)) for k, v in headers])
    _refused(b, response, location)


# --- the platform's credential passes -----------------------------------------------------------


def test_the_injected_header_sent_by_the_sandbox_is_replaced_not_refused(b):
    response = fetch(b.gateway, "strict.test", "/v1/anything", headers=[("X-Api-Key", "sk-own-key-0001"),
                                                                         ("x-api-key", "another")])
    assert response.status == 200
    seen = b.echo.requests[0]
    assert seen.header_all("x-api-key") == [STRICT]
    assert "sk-own-key-0001" not in seen.everything()
    assert_no_leak(response_bytes(response), b.secrets)


@pytest.mark.parametrize("value", ["Bearer {ph}", "{ph}", "token {ph}"])
def test_a_swapped_placeholder_is_the_platforms(b, value):
    ph = b.ph("strict_key")
    response = fetch(b.gateway, "strict.test", "/v1/anything", headers=[("Authorization", value.format(ph=ph))])
    assert response.status == 200, response.text
    assert b.echo.requests[0].header_all("authorization") == [value.format(ph=STRICT)]
    assert_no_leak(response_bytes(response), b.secrets)


def test_empty_and_unrelated_values_pass(b):
    response = fetch(b.gateway, "strict.test", "/v1/anything?key=&monkey=1",
                     headers=[("Authorization", ""), ("X-Authorization-Hint", "x"), ("Cookie", "lb=node-7")])
    assert response.status == 200, response.text


def test_a_query_placeholder_swapped_where_the_rule_allows_it(b):
    ph = b.ph("pos_key")
    assert fetch(b.gateway, "pos.test", f"/v1/anything?api_key={ph}").status == 200  # api_key: a default name


# --- configuration: a rule's own set, report mode, unbound rules --------------------------------


def test_a_rules_own_set_replaces_the_default(b):
    """partner: headers [Authorization, X-Partner-Token, Cookie], query [token]; injects sig."""
    allowed = fetch(b.gateway, "partner.test", "/v1/anything?key=k&sig=mine", headers=[("X-Api-Key", "x")])
    assert allowed.status == 200, allowed.text  # X-Api-Key and key are not partner's; sig is replaced
    [seen] = b.echo.requests
    assert parse_qsl(urlsplit(seen.path).query) == [("key", "k"), ("sig", world.SECRETS["partner_key"])]
    assert "mine" not in seen.path
    b.reset()
    for path, headers, location in (
        ("/v1/anything", [("Cookie", "session=own")], "header Cookie"),
        ("/v1/anything", [("X-Partner-Token", "own")], "header X-Partner-Token"),
        ("/v1/anything?token=own", [], "query parameter token"),
        ("/v1/anything?SIG=own", [], "query parameter SIG"),  # a look-alike of the injected parameter
    ):
        _refused(b, fetch(b.gateway, "partner.test", path, headers=headers), location, own="own")


def test_report_mode_lets_through_without_credentials_but_never_with_an_own_key(b):
    passed = fetch(b.gateway, "report.test", "/v1/elsewhere")
    assert passed.status == 200  # would_deny: through, with no credential
    assert not b.echo.requests[0].header_all("x-api-key")
    b.reset()
    response = fetch(b.gateway, "report.test", "/v1/elsewhere", headers=[("X-Api-Key", "sk-own-key-0001")])
    assert_refused(response, 403, "foreign_credential")
    b.assert_nothing_sent()


def test_an_unbound_rule_forwards_the_sandboxs_own_key(b):
    response = fetch(b.gateway, "open.test", "/v1/anything?key=own", headers=[("Authorization", "Bearer own")])
    assert response.status == 200
    assert b.open.requests[0].header_all("authorization") == ["Bearer own"]


# --- a real SDK holding a placeholder ------------------------------------------------------------

SDK = textwrap.dedent("""
    import json, os, ssl, sys
    import anthropic
    mode = sys.argv[1]
    kwargs = {"base_url": "https://anthropic.test", "max_retries": 0}
    if mode == "api_key_env":          # the SDK reads ANTHROPIC_API_KEY and HTTPS_PROXY itself
        client = anthropic.Anthropic(**kwargs)
    else:                              # an explicit http_client, as an agent framework would pass
        ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
        http_client = anthropic.DefaultHttpxClient(proxy=os.environ["HTTPS_PROXY"], verify=ctx)
        if mode == "auth_token":
            client = anthropic.Anthropic(auth_token=os.environ["TOKEN"], api_key=None, http_client=http_client, **kwargs)
        else:
            client = anthropic.Anthropic(api_key=os.environ["TOKEN"], http_client=http_client, **kwargs)
    try:
        raw = client.messages.with_raw_response.create(
            model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "hello"}])
        print(json.dumps({"status": raw.status_code, "body": raw.http_response.text, "reason": None}))
    except anthropic.APIStatusError as exc:
        print(json.dumps({"status": exc.status_code, "body": exc.response.text,
                          "reason": exc.response.headers.get("x-egress-reason"), "error": type(exc).__name__}))
""")


def _sdk(b, tmp_path, mode: str, **env) -> dict:
    pytest.importorskip("anthropic", reason="the anthropic SDK comes with the test extra")
    script = tmp_path / "sdk.py"
    script.write_text(SDK)
    result = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60,
                            env=world.sdk_env(b, **env))
    assert result.returncode == 0, result.stderr
    assert_no_leak(result.stdout + result.stderr, b.secrets, "SDK output")
    return json.loads(result.stdout)


def _only_the_platforms_key(seen) -> None:
    """The SDK sends its api_key as X-Api-Key (older releases) or as `Authorization: Bearer`
    (newer ones): whichever, the upstream sees the platform's key and nothing else."""
    assert seen.header_all("x-api-key") == [ANTHROPIC]
    assert seen.header_all("authorization") in ([], [f"Bearer {ANTHROPIC}"])
    assert "egress-placeholder" not in seen.everything() and "attacker" not in seen.everything()


@pytest.mark.parametrize("mode", ["api_key_env", "api_key"])
def test_anthropic_sdk_with_the_placeholder_as_api_key(b, tmp_path, mode):
    ph = b.ph("anthropic_key")
    out = _sdk(b, tmp_path, mode, ANTHROPIC_API_KEY=ph, TOKEN=ph)
    assert out["status"] == 200, out
    [seen] = b.echo.requests
    assert seen.method == "POST" and seen.path == "/v1/messages"
    _only_the_platforms_key(seen)
    assert json.loads(seen.body)["messages"] == [{"role": "user", "content": "hello"}]


def test_anthropic_sdk_with_the_placeholder_as_auth_token(b, tmp_path):
    """Authorization: Bearer <placeholder> on a rule that injects x-api-key: swapped, the platform's."""
    out = _sdk(b, tmp_path, "auth_token", TOKEN=b.ph("anthropic_key"))
    assert out["status"] == 200, out
    [seen] = b.echo.requests
    assert seen.header_all("authorization") == [f"Bearer {ANTHROPIC}"]
    assert seen.header_all("x-api-key") == [ANTHROPIC]


def test_anthropic_sdk_with_a_key_of_its_own_is_refused(b, tmp_path):
    out = _sdk(b, tmp_path, "auth_token", TOKEN="sk-ant-attacker-own-key")
    assert out["status"] == 403 and out["reason"] == "foreign_credential", out
    assert out["error"] == "PermissionDeniedError"
    b.assert_nothing_sent()
    # as api_key: refused too when the SDK sends it as Authorization; replaced by the rule's own
    # x-api-key when it sends it there. Either way the attacker's key never leaves.
    out = _sdk(b, tmp_path, "api_key", TOKEN="sk-ant-attacker-own-key")
    if out["status"] == 403:
        assert out["reason"] == "foreign_credential", out
        b.assert_nothing_sent()
    else:
        assert out["status"] == 200, out
        [seen] = b.echo.requests
        _only_the_platforms_key(seen)
