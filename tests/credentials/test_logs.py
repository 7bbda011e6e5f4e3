"""Nothing the gateway writes holds a secret value: its log and its audit file are searched for
every form of every value it held in this session (rotated ones included), after traffic that
exercises every path a value takes (header and query injection, placeholder swaps in headers,
placeholder_misuse and foreign_credential refusals, redaction of bodies and headers, unreadable secrets, refusals). Audit lines name secrets
(`injected`, redaction events), never their values."""

from __future__ import annotations

import pytest

from gateway.redact import forms_of
from tests.e2e.helpers import disconnected, get
from tests.support.waiting import wait_for

from .clients import leaks, tls_to
from .conftest import SECRETS
from .test_placeholders import env_name, run_placeholders, parse_env_lines


@pytest.fixture(scope="module")
def traffic(cred):
    """Every kind of request that touches a secret, once."""
    placeholders = parse_env_lines(run_placeholders(cred, "--sandbox", "default").stdout)
    ph = placeholders[env_name("ph_token")]
    clients = {}
    fetched: list[str] = []  # the fetch()es' clients ("ip:port")

    def fetch(gateway, host: str, path: str):
        with tls_to(gateway, host) as tls:
            fetched.append(tls.client)
            return get(tls, path, host)

    cred.gateway.mark()  # (the gateway serves the session: an earlier test's client port may come back)
    with tls_to(cred.gateway, "echo.test") as tls:
        assert get(tls, "/v1/anything", "echo.test", extra=[("Authorization", "Bearer x")]).status == 200
        assert get(tls, "/v1/error", "echo.test").status == 401
        assert get(tls, "/v1/headers", "echo.test").status == 200
        assert get(tls, "/admin", "echo.test").status == 403
        clients["echo"] = tls.client
    with tls_to(cred.gateway, "qecho.test") as tls:
        assert get(tls, "/v1/anything?api_key=mine&q=1", "qecho.test").status == 200
        clients["qecho"] = tls.client
    with tls_to(cred.gateway, "ph.test") as tls:
        assert get(tls, "/v1/anything/x?k=1", "ph.test", extra=[("Authorization", f"Bearer {ph}"),
                                                                  ("X-Note", f"a, {ph}")]).status == 200
        clients["ph"] = tls.client
    # refusals before anything is injected: a placeholder where it is never swapped, a key of the
    # sandbox's own on a bound rule
    assert fetch(cred.gateway, "ph.test", f"/v1/anything/{ph}?k={ph}").status == 403
    assert fetch(cred.gateway, "echo.test", "/v1/anything?key=sandbox-own").status == 403
    assert fetch(cred.gateway, "mirror.test", "/v1/headers").status == 200
    assert fetch(cred.gateway, "echo.test", "/v1/gzip?enc=gzip").status == 200
    assert fetch(cred.gateway, "echo.test", "/v1/gzip?enc=x-unknown").status == 502
    assert fetch(cred.gateway, "missing-env.test", "/v1/anything").status == 502
    assert fetch(cred.gateway, "rotate.test", "/v1/anything").status == 200
    assert fetch(cred.gateway, "k8s.test", "/v1/anything").status == 200
    assert fetch(cred.gateway, "deep.wild.test", "/").status == 200
    # Both files are written as things are decided, so what is left to come is each connection's
    # ending: wait until the gateway has logged every one of them finished.
    ended = set(clients.values()) | set(fetched)
    wait_for(lambda: ended <= disconnected(cred.gateway), what="every connection's client disconnect",
             detail=lambda: f"missing {ended - disconnected(cred.gateway)}")
    return clients


def test_audit_lines_name_the_secret(cred, traffic):
    audit = cred.gateway.audit_since_mark()

    def requests_of(client):
        return [line for line in audit if line["client"] == client and line["event"] == "request"]

    echo = requests_of(traffic["echo"])
    assert [line.get("injected") for line in echo] == [["api_token"], ["api_token"], ["api_token"], None]
    assert echo[-1]["reason"] == "path_not_allowed"
    assert [line.get("injected") for line in requests_of(traffic["qecho"])] == [["query_key"]]
    assert [line.get("injected") for line in requests_of(traffic["ph"])] == [["ph_token"]]
    redactions = [line for line in audit if line["event"] == "redaction"]
    assert redactions and {line["secret"] for line in redactions} >= {"api_token", "query_key", "ph_token"}
    assert all(line["secret"] in line["message"] for line in redactions)


@pytest.mark.parametrize("what", ["audit file", "gateway log"])
def test_no_secret_value_in_anything_the_gateway_wrote(cred, traffic, what):
    if what == "audit file":
        data = cred.gateway.audit_path.read_bytes()
    else:
        data = cred.gateway.log_path.read_bytes()
    assert data, f"the {what} is empty"
    found = {}
    for name, value in cred.all_values().items():
        hits = leaks(data, value)
        if hits:
            forms = [form.decode() for form in forms_of(value)]
            lines = [line[:300] for line in data.decode("utf-8", "replace").splitlines()
                     if any(form in line for form in forms)]
            found[name] = {"forms": hits[:4], "lines": lines[:3]}
    assert not found, f"secret values in the {what}: {found}"


def test_secret_names_do_appear(cred, traffic):
    """The check above is not vacuous: the audit file does talk about these secrets, by name."""
    text = cred.gateway.audit_path.read_text()
    for name in ("api_token", "query_key", "ph_token", "missing_env"):
        assert name in text
    assert set(SECRETS) <= set(cred.all_values())
