"""Rule matching by method and path (rule `api`: api.test, methods [GET], paths ["/ok/**"]),
including the path spellings that servers resolve differently from naive matchers."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    assert_refused,
    assert_untouched,
    audit_for,
    client_tls_context,
    connect_proxy,
    curl,
    fresh_upstreams,
    gateway,
    get,
    tls_tunnel,
)


@pytest.mark.parametrize("path", ["/ok", "/ok/", "/ok/x", "/ok/a/b/c?q=1", "/ok/./x", "/ok/a/../b", "/ok/%41"])
def test_allowed_paths(gateway, upstreams, path):
    with tls_tunnel(gateway, "api.test:443") as tls:
        response = get(tls, path, "api.test")
    assert response.status == 200, response.text
    assert [r.path for r in upstreams.tls["api.test"].requests] == [path]  # forwarded as sent


PATH_TRICKS = [
    "/admin",
    "/ok/../admin",
    "/ok/%2e%2e/admin",
    "/ok/%2E%2E/admin",
    "/ok/.%2e/admin",
    "/ok/..;/admin",
    "/ok/..;jsessionid=1/admin",
    "/ok/%252e%252e/admin",
    "/ok/%25252e%25252e/admin",
    "/ok/..%2fadmin",
    "/ok/..%5cadmin",
    "/ok\\..\\admin",
    "/ok/%2e%2e%2fadmin",
    "//admin",
    "/okay",
    "/OK/x",
]


@pytest.mark.parametrize("path", PATH_TRICKS)
def test_path_tricks_are_403_path_not_allowed(gateway, upstreams, path):
    with tls_tunnel(gateway, "api.test:443") as tls:
        response = get(tls, path, "api.test")
        client = tls.client
    assert_refused(response, 403, "path_not_allowed", rule="api")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    [line] = [a for a in audit_for(gateway, client, 2) if a["event"] == "request"]
    assert (line["decision"], line["reason"], line["rule"], line["path"]) == ("deny", "path_not_allowed", "api", path)


@pytest.mark.parametrize("path", ["/ok/%2e%2e/%2e%2e/etc/passwd", "/ok/%00", "/ok/%0d%0aX-Injected:%201", "/ok/%ff"])
def test_unnormalisable_paths_are_400_bad_path(gateway, upstreams, path):
    with tls_tunnel(gateway, "api.test:443") as tls:
        response = get(tls, path, "api.test")
    assert_refused(response, 400, "bad_path")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_path_tricks_with_curl(gateway, upstreams):
    result = curl(gateway, "https://api.test/ok/../admin", "--path-as-is")
    assert (result.status, result.header("X-Egress-Reason"), result.header("X-Egress-Rule")) == (403, "path_not_allowed", "api")
    result = curl(gateway, "https://api.test/ok/%2e%2e/admin", "--path-as-is", "--http2")
    assert (result.status, result.header("X-Egress-Reason")) == (403, "path_not_allowed"), result
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
def test_method_not_in_rule_is_403_method_not_allowed(gateway, upstreams, method):
    with tls_tunnel(gateway, "api.test:443") as tls:
        response = get(tls, "/ok/x", "api.test", method=method, body=b"data" if method in ("POST", "PUT", "PATCH") else b"")
    assert response.status == 403
    if method != "HEAD":
        assert_refused(response, 403, "method_not_allowed", rule="api")
    else:
        assert (response.egress_reason, response.egress_rule) == ("method_not_allowed", "api")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_method_and_path_with_httpx(gateway, upstreams):
    with httpx.Client(proxy=gateway.proxy_url, verify=client_tls_context(gateway)) as client:
        ok = client.get("https://api.test/ok/httpx")
        post = client.post("https://api.test/ok/httpx", content=b"x")
        admin = client.get("https://api.test/admin")
    assert ok.status_code == 200
    assert_refused(post, 403, "method_not_allowed", rule="api")
    assert_refused(admin, 403, "path_not_allowed", rule="api")
    assert [(r.method, r.path) for r in upstreams.tls["api.test"].requests] == [("GET", "/ok/httpx")]


def test_unrestricted_rule_allows_standard_methods(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            body = b"" if method in ("GET", "DELETE", "OPTIONS") else b"b"  # no body where none is defined
            assert get(tls, "/m", "allowed.test", method=method, body=body).status == 200, method
    assert [r.method for r in upstreams.tls["allowed.test"].requests] == ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


def test_nonstandard_method_needs_a_rule(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        response = get(tls, "/m", "allowed.test", method="PROPFIND")
    assert_refused(response, 403, "method_not_allowed", rule="allowed")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_absolute_form_to_https_only_rule_is_refused_before_path(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        # api.test's only rule is https: plain http fails on the scheme, before the path (which
        # would fail too) is looked at.
        response = conn.request("GET", "http://api.test/ok/../admin", [("Host", "api.test")])
    assert_refused(response, 403, "scheme_not_allowed", rule="api")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
