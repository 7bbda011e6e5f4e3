"""HTTPS through the transparent listener: the sandbox has no proxy settings, its resolver is the
gateway's DNS mode, and iptables (from docker/sandbox-net.sh) redirects TCP 443 to the gateway.

The TLS SNI names the destination; the gateway decides, resolves and pins it itself and never
dials the address the sandbox dialled. Everything is asserted from the upstream side."""

from __future__ import annotations

import pytest

from .clients import curl, python_get, tls_get
from tests.support.topology import ALLOWED, OTHER

pytestmark = pytest.mark.netns


# -- 1. an allowed name, resolved by the gateway's DNS --------------------------------------------


def test_curl_by_name(topology, main):
    mark = main.audit_mark()
    result = curl(main.sandbox, main.ca, "https://allowed.test/curl?x=1")
    assert result.status == 200, result
    assert result.headers.get("x-upstream") == "allowed.test"
    upstream = topology.server(f"{ALLOWED}:443")
    assert [(r.method, r.path, r.sni) for r in upstream.requests] == [("GET", "/curl?x=1", "allowed.test")]
    assert topology.touched() == [f"{ALLOWED}:443"]

    dns = main.audit_since(mark, event="dns", host="allowed.test", dns_type="A")
    assert dns and dns[0]["rcode"] == "NOERROR" and dns[0]["address"] == ALLOWED and dns[0]["mode"] == "dns"
    requests = main.audit_since(mark, event="request")
    assert len(requests) == 1, requests
    line = requests[0]
    assert (line["mode"], line["decision"], line["original_destination"], line["sni"], line["host"],
            line["address"], line["rule"]) == (
        "transparent", "allow", f"{ALLOWED}:443", "allowed.test", "allowed.test", ALLOWED, "web")
    assert line["client"].startswith(main.sandbox.address + ":")
    tls = main.audit_since(mark, event="tls")
    assert [(e["decision"], e["sni"], e["address"]) for e in tls] == [("allow", "allowed.test", ALLOWED)]


@pytest.mark.parametrize("library", ["httpx", "requests"])
def test_python_clients_by_name(topology, main, library):
    if library == "requests":
        pytest.importorskip("requests")
    mark = main.audit_mark()
    result = python_get(main.sandbox, library, main.ca, f"https://allowed.test/{library}")
    assert result.status == 200, result
    upstream = topology.server(f"{ALLOWED}:443")
    assert [(r.path, r.sni) for r in upstream.requests] == [(f"/{library}", "allowed.test")]
    assert topology.touched() == [f"{ALLOWED}:443"]
    requests = main.audit_since(mark, event="request", decision="allow")
    assert [(e["mode"], e["original_destination"]) for e in requests] == [("transparent", f"{ALLOWED}:443")]


# -- 2. SNI of an allowed name, dialled to another IP --------------------------------------------


def test_sni_to_another_ip_reaches_only_the_names_address(topology, main):
    mark = main.audit_mark()
    result = curl(main.sandbox, main.ca, "https://allowed.test/fronted", "--resolve", f"allowed.test:443:{OTHER}")
    assert result.status == 200, result
    assert [(r.path, r.sni) for r in topology.server(f"{ALLOWED}:443").requests] == [("/fronted", "allowed.test")]
    assert topology.touched() == [f"{ALLOWED}:443"], "the dialled IP (other.test) must not be touched"
    line = main.audit_since(mark, event="request")[0]
    assert (line["original_destination"], line["address"]) == (f"{OTHER}:443", ALLOWED)


def test_strict_mode_refuses_sni_to_another_ip(topology, strict):
    mark = strict.audit_mark()
    result = curl(strict.sandbox, strict.ca, "https://allowed.test/fronted", "--resolve", f"allowed.test:443:{OTHER}")
    assert result.status == 421, result
    assert result.egress_reason == "original_destination_mismatch", result
    assert topology.touched() == []
    tls = strict.audit_since(mark, event="tls")
    assert [(e["decision"], e["reason"], e["original_destination"]) for e in tls] == [
        ("deny", "original_destination_mismatch", f"{OTHER}:443")]


def test_strict_mode_allows_the_names_own_address(topology, strict):
    result = curl(strict.sandbox, strict.ca, "https://allowed.test/strict-ok")
    assert result.status == 200, result
    assert [r.path for r in topology.server(f"{ALLOWED}:443").requests] == ["/strict-ok"]
    assert topology.touched() == [f"{ALLOWED}:443"]


# -- 3. an SNI no rule allows ----------------------------------------------------------------------


def test_denied_sni_gets_403_after_the_handshake(topology, main):
    mark = main.audit_mark()
    result = curl(main.sandbox, main.ca, "https://other.test/secret", "--resolve", f"other.test:443:{OTHER}")
    assert result.status == 403, result
    assert result.egress_reason == "no_rule", result
    assert topology.touched() == []
    tls = main.audit_since(mark, event="tls")
    assert [(e["decision"], e["reason"], e["sni"]) for e in tls] == [("deny", "no_rule", "other.test")]
    requests = main.audit_since(mark, event="request")
    assert requests and all(e["decision"] == "deny" and e["reason"] == "no_rule" for e in requests)


def test_refused_request_lines_name_the_destination(topology, main):
    """docs/audit-log.md: `host` is "the destination as decided". On a connection refused at its
    ClientHello, every request line should still say which destination was refused (other.test),
    as the `tls` line does, not null."""
    mark = main.audit_mark()
    result = curl(main.sandbox, main.ca, "https://other.test/secret", "--resolve", f"other.test:443:{OTHER}")
    assert result.status == 403, result
    tls = main.audit_since(mark, event="tls")
    requests = main.audit_since(mark, event="request")
    assert [(e["host"], e["port"]) for e in tls] == [("other.test", 443)]
    assert [(e["host"], e["port"]) for e in requests] == [("other.test", 443)], requests


def test_denied_name_does_not_even_resolve(topology, main):
    result = curl(main.sandbox, main.ca, "https://other.test/")
    assert result.rc == 6, result  # curl: could not resolve host
    assert topology.touched() == []


def test_every_request_on_a_refused_connection_is_refused(topology, main):
    """Several requests on one keep-alive connection with a refused SNI: each one gets 403."""
    mark = main.audit_mark()
    result = curl(main.sandbox, main.ca, "https://other.test/two", "--resolve", f"other.test:443:{OTHER}",
                  "--http1.1", "https://other.test/one")  # curl fetches /one first
    assert result.rc == 0, result
    assert result.status == 403 and result.body.count("X-Egress-Reason: no_rule") == 1, result  # 2nd reply
    assert result.body.count("\nreason: no_rule\n") == 2, result  # both bodies
    assert topology.touched() == []
    assert len(main.audit_since(mark, event="tls")) == 1, "curl should have reused its connection"
    requests = main.audit_since(mark, event="request")
    assert [(e["path"], e["status"], e["reason"]) for e in requests] == [("/one", 403, "no_rule"),
                                                                         ("/two", 403, "no_rule")]


# -- 4. TLS without SNI ----------------------------------------------------------------------------


def test_no_sni_to_an_ip_no_rule_names_is_refused(topology, main):
    reply = tls_get(topology, main.sandbox, OTHER, None, main.ca, OTHER, "/no-sni")
    assert (reply.status, reply.egress_reason) == (403, "no_rule"), reply
    assert topology.touched() == []


def test_no_sni_to_an_ip_a_rule_names_is_allowed(topology, main):
    mark = main.audit_mark()
    reply = tls_get(topology, main.sandbox, ALLOWED, None, main.ca, ALLOWED, "/by-ip")
    assert reply.status == 200, reply.text()
    assert [r.path for r in topology.server(f"{ALLOWED}:443").requests] == ["/by-ip"]
    assert topology.touched() == [f"{ALLOWED}:443"]
    line = main.audit_since(mark, event="tls")[0]
    assert (line["decision"], line["sni"], line["host"], line["rule"]) == ("allow", None, ALLOWED, "web-by-ip")


def test_curl_to_an_ip_without_sni(topology, main, strict):
    allowed = curl(main.sandbox, main.ca, f"https://{ALLOWED}/curl-ip", "-k")
    assert allowed.status == 200, allowed
    assert topology.touched() == [f"{ALLOWED}:443"]
    topology.reset()
    refused = curl(strict.sandbox, strict.ca, f"https://{ALLOWED}/curl-ip", "-k")  # no IP rule there
    assert (refused.status, refused.egress_reason) == (403, "no_rule"), refused
    assert topology.touched() == []
