"""Spec 1 and 2: the destination is decided once, when it is named (CONNECT authority), from its
canonical form; the gateway resolves it itself, checks every address and never dials itself.
Also: ports and wildcard rules at CONNECT time."""

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
    ipv4_spellings,
    start_tls,
    tunnel,
)


# --- canonical names ------------------------------------------------------------------------


@pytest.mark.parametrize("authority", ["allowed.test:443", "ALLOWED.TEST:443", "allowed.test.:443", "AlLoWeD.TeSt.:443"])
def test_connect_name_spellings_are_one_destination(gateway, upstreams, authority):
    conn, answer = tunnel(gateway, authority)
    with conn:
        assert answer.status == 200, answer
        tls = start_tls(conn, gateway, sni=None)
        response = get(tls, "/spelling", authority.rsplit(":", 1)[0])
        assert response.status == 200, response.text
        assert "upstream allowed.test: GET /spelling" in response.text
    [received] = upstreams.tls["allowed.test"].requests
    assert received.sni == "allowed.test"  # the upstream SNI is the canonical pinned name
    [line] = [a for a in audit_for(gateway, conn.client, 2) if a["event"] == "connect"]
    assert (line["decision"], line["host"], line["port"], line["rule"]) == ("allow", "allowed.test", 443, "allowed")
    assert line["address"] == upstreams.hosts["allowed.test"]


def test_idna_u_label_rule_matches_a_label_connect(gateway, upstreams):
    """The policy names `bücher.test`; the sandbox sends A-labels in any case; the Host header may
    even carry the U-label. All of them are the one canonical destination xn--bcher-kva.test."""
    for authority in ("xn--bcher-kva.test:80", "XN--BCHER-KVA.TEST.:80"):
        conn, answer = tunnel(gateway, authority)
        with conn:
            assert answer.status == 200, answer
            assert get(conn, "/idn-a", "xn--bcher-kva.test").status == 200
            assert get(conn, "/idn-u", "BÜCHER.test").status == 200
            line = audit_for(gateway, conn.client)[0]
            assert (line["host"], line["rule"]) == ("xn--bcher-kva.test", "plain")
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/idn-a", "/idn-u"] * 2
    # curl converts the U-label itself (libidn2) and sends an absolute-form request.
    result = curl(gateway, "http://bücher.test/idn-curl")
    assert result.status == 200, result
    assert upstreams.plain["allowed.test"].requests[-1].path == "/idn-curl"


BAD_HOSTS = {
    "percent": "allowed%2etest",
    "at": "user@allowed.test",
    "backslash": "allowed.test\\@other.test",
    "ideographic-dot": "allowed\u3002test",
    "fullwidth-dot": "allowed\uff0etest",
    "halfwidth-dot": "allowed\uff61test",
    "brackets": "[allowed.test]",
    "nul": "allowed.test\x00.other.test",
    "empty-label": "allowed..test",
}


@pytest.mark.parametrize("kind", sorted(BAD_HOSTS))
def test_connect_bad_host_is_400_bad_host(gateway, upstreams, kind):
    conn, answer = tunnel(gateway, f"{BAD_HOSTS[kind]}:443")
    conn.close()
    assert answer.status == 400, answer
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert_refused(answer, 400, "bad_host")
    lines = audit_for(gateway, conn.client)
    assert [(a["event"], a["decision"], a["reason"], a["status"]) for a in lines] == [("connect", "deny", "bad_host", 400)]


# --- IP literals ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decimal", "hex", "octal", "short", "mixed"])
def test_ip_literal_spelling_matches_ip_rule(gateway, upstreams, kind):
    address = upstreams.hosts["allowed.test"]
    weird = ipv4_spellings(address)[kind]
    conn, answer = tunnel(gateway, f"{weird}:443")
    with conn:
        assert answer.status == 200, answer
        tls = start_tls(conn, gateway, sni=None)  # an IP destination: no SNI
        assert get(tls, "/ip-weird", weird).status == 200  # Host in the same weird spelling
        assert get(tls, "/ip-plain", address).status == 200  # or canonical
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/ip-weird", "/ip-plain"]
    line = audit_for(gateway, conn.client)[0]
    assert (line["event"], line["host"], line["address"], line["rule"]) == ("connect", address, address, "ip-literal")


@pytest.mark.parametrize("kind", ["decimal", "hex", "octal", "short", "mixed"])
def test_ip_literal_spelling_of_unlisted_address_is_denied(gateway, upstreams, kind):
    address = upstreams.hosts["other.test"]  # no rule names other.test or its address
    conn, answer = tunnel(gateway, f"{ipv4_spellings(address)[kind]}:443")
    conn.close()
    assert_refused(answer, 403, "no_rule")
    assert_untouched(upstreams, "other.test")
    [line] = audit_for(gateway, conn.client)
    assert (line["decision"], line["reason"], line["host"], line["address"]) == ("deny", "no_rule", address, None)


def test_ip_literal_spelling_is_checked_against_the_rule_for_that_ip(gateway, upstreams):
    # 2130706433 is 127.0.0.1, which only the `self` rule names, and only for the gateway's port.
    conn, answer = tunnel(gateway, "2130706433:443")
    conn.close()
    assert_refused(answer, 403, "port_not_allowed", rule="self")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert audit_for(gateway, conn.client)[0]["host"] == "127.0.0.1"


# --- addresses: deny list and the gateway itself --------------------------------------------


@pytest.mark.parametrize("authority", [
    "meta.test:443",  # static_hosts -> 169.254.169.254
    "mapped.test:443",  # static_hosts -> ::ffff:169.254.169.254 (IPv4-mapped)
    "169.254.169.254:443",
    "0xa9fea9fe:443",
    "0251.0376.0251.0376:443",
    "169.254.43518:443",
])
def test_address_in_deny_list_is_403_denied_address(gateway, upstreams, authority):
    conn, answer = tunnel(gateway, authority)
    conn.close()
    assert_refused(answer, 403, "denied_address")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    [line] = audit_for(gateway, conn.client)
    assert (line["event"], line["decision"], line["reason"], line["status"]) == ("connect", "deny", "denied_address", 403)
    assert line["address"] is None  # nothing was pinned, nothing dialled


def test_absolute_form_to_denied_address_is_403(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", "http://meta.test/latest/meta-data/", [("Host", "meta.test")])
    assert_refused(response, 403, "denied_address", rule="metadata")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("host", ["127.0.0.1", "0x7f000001", "2130706433", "127.1", "0177.0.0.01", "[::ffff:127.0.0.1]", "self.test"])
def test_connect_to_gateway_itself_is_403_self_address(gateway, upstreams, host):
    conn, answer = tunnel(gateway, f"{host}:{gateway.port}")
    conn.close()
    assert_refused(answer, 403, "self_address")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    lines = audit_for(gateway, conn.client)
    assert [(a["event"], a["reason"]) for a in lines] == [("connect", "self_address")]


def test_absolute_form_to_gateway_itself_is_403_self_address(gateway, upstreams):
    before = len(gateway.audit())
    with connect_proxy(gateway) as conn:
        target = f"127.0.0.1:{gateway.port}"
        response = conn.request("GET", f"http://{target}/loop", [("Host", target)])
    assert_refused(response, 403, "self_address", rule="self")
    # One decision, no second request arriving back at the gateway through a loop.
    lines = gateway.audit()[before:]
    assert [(a["event"], a["reason"]) for a in lines] == [("request", "self_address")], lines


def test_unresolvable_name_is_502_resolve_failed(gateway, upstreams):
    conn, answer = tunnel(gateway, "nowhere.invalid:443")
    conn.close()
    assert_refused(answer, 502, "resolve_failed")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


# --- ports and wildcards --------------------------------------------------------------------


def test_port_not_in_rule_is_403_port_not_allowed(gateway, upstreams):
    conn, answer = tunnel(gateway, "allowed.test:8443")
    conn.close()
    assert_refused(answer, 403, "port_not_allowed", rule="allowed")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    [line] = audit_for(gateway, conn.client)
    assert (line["reason"], line["rule"], line["host"], line["port"]) == ("port_not_allowed", "allowed", "allowed.test", 8443)
    # curl sees the refused CONNECT too (and no HTTP status of its own).
    result = curl(gateway, "https://allowed.test:8443/")
    assert (result.status, result.connect_status, result.header("X-Egress-Reason")) == (0, 403, "port_not_allowed")


def test_wildcard_covers_subdomain_with_curl(gateway, upstreams):
    result = curl(gateway, "https://deep.wild.test/wild")
    assert result.status == 200, result
    assert "upstream deep.wild.test: GET /wild" in result.body
    assert upstreams.tls["deep.wild.test"].requests[0].sni == "deep.wild.test"


@pytest.mark.parametrize("authority", ["wild.test:443", "WILD.TEST.:443"])
def test_wildcard_never_covers_apex(gateway, upstreams, authority):
    conn, answer = tunnel(gateway, authority)
    conn.close()
    assert_refused(answer, 403, "no_rule")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_unlisted_host_denied_for_every_client(gateway, upstreams):
    # raw socket: status and reason of the refused CONNECT
    conn, answer = tunnel(gateway, "other.test:443")
    conn.close()
    assert_refused(answer, 403, "no_rule")
    # curl: no HTTP status, the CONNECT answer in its headers
    result = curl(gateway, "https://other.test/")
    assert (result.status, result.connect_status, result.header("X-Egress-Reason")) == (0, 403, "no_rule")
    # httpx: a ProxyError naming the status
    with httpx.Client(proxy=gateway.proxy_url, verify=client_tls_context(gateway)) as client:
        with pytest.raises(httpx.ProxyError, match="403"):
            client.get("https://other.test/")
    assert_untouched(upstreams, "other.test")
    reasons = [a["reason"] for a in gateway.audit() if a["host"] == "other.test"][-3:]
    assert reasons == ["no_rule"] * 3
