"""Two sandboxes (built by sandbox-net.sh with different namespaces, veths and subnets) behind one
gateway whose policy has a `sandboxes:` section: each sandbox's source range names its rules.
alpha may reach allowed.test only, beta other.test only; DNS answers follow the same split, and
every audit line carries the sandbox id."""

from __future__ import annotations

import pytest

from .clients import curl, http_exchange, http_request
from tests.support.topology import ALLOWED, OTHER, dns_query

pytestmark = pytest.mark.netns


def test_each_sandbox_reaches_only_its_own_host(topology, alpha, beta):
    mark = alpha.audit_mark()  # alpha and beta share the gateway (and its audit log)
    own = curl(alpha.sandbox, alpha.ca, "https://allowed.test/alpha")
    assert own.status == 200, own
    assert [(r.path, r.sni) for r in topology.server(f"{ALLOWED}:443").requests] == [("/alpha", "allowed.test")]
    assert topology.touched() == [f"{ALLOWED}:443"]
    topology.reset()

    own = curl(beta.sandbox, beta.ca, "https://other.test/beta")
    assert own.status == 200, own
    assert [(r.path, r.sni) for r in topology.server(f"{OTHER}:443").requests] == [("/beta", "other.test")]
    assert topology.touched() == [f"{OTHER}:443"]
    topology.reset()

    foreign = curl(alpha.sandbox, alpha.ca, "https://other.test/x", "--resolve", f"other.test:443:{OTHER}")
    assert (foreign.status, foreign.egress_reason) == (403, "no_rule"), foreign
    foreign = curl(beta.sandbox, beta.ca, "https://allowed.test/x", "--resolve", f"allowed.test:443:{ALLOWED}")
    assert (foreign.status, foreign.egress_reason) == (403, "no_rule"), foreign
    assert topology.touched() == []

    lines = [e for e in alpha.audit_since(mark) if e["event"] in ("tls", "request")]
    by_sandbox = {(e["sandbox"], e["event"], e["sni"], e["decision"]) for e in lines}
    assert by_sandbox == {
        ("alpha", "tls", "allowed.test", "allow"), ("alpha", "request", "allowed.test", "allow"),
        ("beta", "tls", "other.test", "allow"), ("beta", "request", "other.test", "allow"),
        ("alpha", "tls", "other.test", "deny"), ("alpha", "request", "other.test", "deny"),
        ("beta", "tls", "allowed.test", "deny"), ("beta", "request", "allowed.test", "deny"),
    }
    for line in lines:
        expected = alpha.sandbox.address if line["sandbox"] == "alpha" else beta.sandbox.address
        assert line["client"].startswith(expected + ":"), line


def test_dns_answers_only_the_sandboxs_own_names(topology, alpha, beta):
    mark = alpha.audit_mark()
    answers = {}
    for site in (alpha, beta):
        for name in ("allowed.test", "other.test"):
            reply = dns_query(topology, site.ns, site.sandbox.gateway_address, name, "A")
            assert reply is not None
            answers[(site.sandbox.key, name)] = (reply.rcode, reply.addresses)
    assert answers == {
        ("alpha", "allowed.test"): ("NOERROR", [ALLOWED]), ("alpha", "other.test"): ("NXDOMAIN", []),
        ("beta", "allowed.test"): ("NXDOMAIN", []), ("beta", "other.test"): ("NOERROR", [OTHER]),
    }
    lines = alpha.audit_since(mark, event="dns")
    assert {(e["sandbox"], e["host"], e["rcode"]) for e in lines} == {
        ("alpha", "allowed.test", "NOERROR"), ("alpha", "other.test", "NXDOMAIN"),
        ("beta", "allowed.test", "NXDOMAIN"), ("beta", "other.test", "NOERROR")}
    assert topology.touched() == []


def test_curl_by_name_follows_the_sandboxs_dns(topology, alpha, beta):
    refused = curl(alpha.sandbox, alpha.ca, "https://other.test/")
    assert refused.rc == 6, refused  # could not resolve: the name does not exist for alpha
    refused = curl(beta.sandbox, beta.ca, "https://allowed.test/")
    assert refused.rc == 6, refused
    assert topology.touched() == []


def test_plain_http_per_sandbox(topology, alpha, beta):
    with topology.connect(alpha.sandbox, ALLOWED, 80) as sock:
        (reply,) = http_exchange(sock, [http_request("other.test", "/", close=True)])
    assert (reply.status, reply.egress_reason) == (403, "no_rule"), reply.text()
    with topology.connect(beta.sandbox, ALLOWED, 80) as sock:
        (reply,) = http_exchange(sock, [http_request("other.test", "/beta-plain", close=True)])
    assert reply.status == 200, reply.text()
    assert [r.path for r in topology.server(f"{OTHER}:80").requests] == ["/beta-plain"]
    assert topology.touched() == [f"{OTHER}:80"]
