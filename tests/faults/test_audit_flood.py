"""A flood of refusals cannot fill the disk or drown the audit log.

One client sends thousands of denied requests (and, separately, opens hundreds of connections over
its connection limit). The audit log gets a burst of verbatim refusal lines, then the sandbox's
budget, and `suppressed` summary lines whose counts make up the rest exactly; every allowed request
in the middle of the flood keeps its own line, the chain stays valid, and the metrics count every
refusal. Before the aggregation, the flood wrote one line per refusal.
"""

from __future__ import annotations

import re
import time
import urllib.request

from gateway.audit import verify_chain
from tests.e2e.helpers import H2Client, connect_proxy, get, tls_tunnel, tunnel
from tests.support.gateway import free_port
from tests.support.waiting import value_when, wait_for

RULES = """
- id: allowed
  hosts: [allowed.test]
  schemes: [http]
- id: api
  hosts: [api.test]
  paths: ["/ok/**"]
"""

FLOOD = 1500
ALLOW_EVERY = 100


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    found = 0.0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$|^{name} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found += float(match.group(2) or match.group(3))
    return found


def wait_accounted(gateway, event: str, reason: str, expected: int, wait: float = 10.0):
    """(verbatim lines, summary lines) of this refusal, once verbatim + sum(count) == expected."""
    def accounted() -> tuple[list[dict], list[dict]]:
        lines = gateway.audit()
        verbatim = [r for r in lines if r["event"] == event and r["reason"] == reason]
        summaries = [r for r in lines if r["event"] == "suppressed" and r["suppressed_event"] == event
                     and r["reason"] == reason]
        return verbatim, summaries

    return value_when(accounted, lambda found: len(found[0]) + sum(s["count"] for s in found[1]) >= expected, wait)


def test_a_flood_of_denied_requests_is_aggregated_allows_keep_their_lines(start_gateway, upstreams):
    metrics = free_port()
    # Denied requests take tokens of the request rate too (its own tests): off here, this is about the log.
    gateway = start_gateway(RULES, args=["--audit-chain", "--metrics", f"127.0.0.1:{metrics}",
                                         "--set", "egress_max_requests_per_second_per_sandbox=0"])
    allowed = []
    started = time.monotonic()
    with connect_proxy(gateway) as conn:
        for n in range(FLOOD):
            response = get(conn, f"http://other.test/flood/{n}", "other.test")
            assert (response.status, response.egress_reason) == (403, "no_rule"), n
            if n % ALLOW_EVERY == 0:
                assert get(conn, f"http://allowed.test/ok/{n}", "allowed.test").status == 200
                allowed.append(f"/ok/{n}")
    elapsed = time.monotonic() - started

    verbatim, summaries = wait_accounted(gateway, "request", "no_rule", FLOOD)
    counted = sum(s["count"] for s in summaries)
    assert len(verbatim) + counted == FLOOD, (len(verbatim), counted)
    # Bounded: a burst of 4 s worth (10 a second for one kind), then 10 a second, and one summary a
    # second at most. Without aggregation: FLOOD lines.
    assert len(verbatim) <= 40 + 10 * (elapsed + 2), (len(verbatim), elapsed)
    assert 1 <= len(summaries) <= elapsed + 3, (len(summaries), elapsed)
    summary = summaries[0]
    assert (summary["decision"], summary["host"], summary["client"], summary["sandbox"]) == \
        ("deny", "other.test", "127.0.0.1", None)
    assert summary["window_start"] <= summary["first"] <= summary["last"] <= summary["window_end"]
    # Every request that left has its line.
    records = gateway.audit()
    assert [r["path"] for r in records if r["event"] == "request" and r["decision"] == "allow"] == allowed
    assert {r.path for r in upstreams.plain["allowed.test"].requests} == set(allowed)
    assert upstreams.untouched("other.test")
    assert verify_chain([str(gateway.audit_path)]).ok
    # The metrics count every refusal, not every line.
    assert total(scrape(metrics), "egress_requests_total", decision="deny", reason="no_rule") == FLOOD
    text = value_when(lambda: scrape(metrics), lambda text: total(text, "egress_audit_suppressed_refusals_total") >= counted,
                      interval=0.2)
    assert total(text, "egress_audit_suppressed_refusals_total") == counted


def test_a_flood_of_connections_over_the_limit_is_aggregated(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_max_connections_per_sandbox=1"])
    # the start-up probe's connection may still count for a moment: the only slot is free once a
    # connection of ours is served
    held = wait_for(lambda: _served_connection(gateway), what="the only connection served", interval=0.1)
    before = len([r for r in gateway.audit() if r["reason"] == "too_many_connections"])
    refused = 400
    for _ in range(refused):
        conn = connect_proxy(gateway)
        assert conn.closed(), "a connection over the limit must be closed at once"
        conn.close()
    verbatim, summaries = wait_accounted(gateway, "connection", "too_many_connections", refused + before)
    assert len(verbatim) + sum(s["count"] for s in summaries) == refused + before
    assert len(verbatim) < refused / 2 and summaries, (len(verbatim), len(summaries))
    held.close()


def test_the_budget_is_an_option_and_zero_writes_every_refusal(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_audit_max_refusals_per_second_per_sandbox=0"])
    with connect_proxy(gateway) as conn:
        for n in range(150):
            assert get(conn, f"http://other.test/{n}", "other.test").status == 403
    verbatim, summaries = wait_accounted(gateway, "request", "no_rule", 150)
    assert (len(verbatim), summaries) == (150, [])


def _denied_connects(gateway, n: int) -> None:
    for _ in range(n):
        conn, response = tunnel(gateway, "other.test:443")
        conn.close()
        assert (response.status, response.egress_reason) == (403, "no_rule")


def _denied_h2_streams(gateway, n: int) -> None:
    client = H2Client(tls_tunnel(gateway, "api.test:443", alpn=["h2"]))
    for batch in range(0, n, 50):
        streams = [client.send("api.test", f"/admin/{i}") for i in range(batch, min(n, batch + 50))]
        client.wait(*streams)
        assert all(client.responses[s]["status"] == 403 for s in streams)
    client.conn.close()


def test_other_protocols_are_aggregated_too(start_gateway, upstreams):
    """The aggregation is in the one write path, so every kind of refusal is covered: denied CONNECTs
    (one connection each) and refused HTTP/2 streams (one connection), here."""
    # 300 connections at once: the per-sandbox connection rate (its own test) is off here
    # (and the request rate, which denied CONNECTs and streams take tokens of)
    gateway = start_gateway(RULES, args=["--set", "egress_max_new_connections_per_second_per_sandbox=0",
                                         "--set", "egress_max_requests_per_second_per_sandbox=0"])
    cases = ((_denied_connects, "connect", "no_rule"), (_denied_h2_streams, "request", "path_not_allowed"))
    for flood, event, reason in cases:
        flood(gateway, 300)
        verbatim, summaries = wait_accounted(gateway, event, reason, 300)
        assert len(verbatim) + sum(s["count"] for s in summaries) == 300, (event, len(verbatim), summaries)
        assert len(verbatim) < 200 and summaries, (event, len(verbatim))


# --- cycling source addresses (review of issue 15) ------------------------------------------------

CYCLING = [240 + i for i in range(10)]  # this helper's loopback octets


def _from(gateway, source: str):
    import socket

    from tests.e2e.helpers import Conn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect((gateway.host, gateway.port))
    return Conn(sock)


def test_cycling_uncovered_addresses_share_one_aggregation_source(start_gateway, upstreams):
    """With a sandboxes section, every client no sandbox covers is one source (as the rate limiter
    counts them): ten addresses get one burst between them, not ten."""
    sandboxes = f"sandboxes:\n  - id: b\n    source_ips: [{upstreams.block}.230/32]\n    rules: [allowed]\n"
    gateway = start_gateway(RULES, extra=sandboxes, args=[
        "--audit-chain", "--set", "egress_audit_max_refusals_per_second_per_sandbox=2",
        "--set", "egress_audit_max_refusals_per_second_per_key=2"])
    sent = 0
    for octet in CYCLING:
        with _from(gateway, f"{upstreams.block}.{octet}") as conn:
            for n in range(10):
                response = get(conn, f"http://other.test/c/{n}", "other.test")
                assert response.status == 403, response.text
                sent += 1
    verbatim, summaries = wait_accounted(gateway, "request", "no_rule", sent)
    assert len(verbatim) + sum(s["count"] for s in summaries) == sent
    # One burst (4 s x 2 a second) for all ten addresses, plus what refilled meanwhile; before: 8 each.
    assert len(verbatim) <= 8 + 2 * 3, len(verbatim)
    assert all(s["client"] is None and s["sandbox"] is None for s in summaries)
    assert verify_chain([str(gateway.audit_path)]).ok


def test_a_gateway_wide_budget_bounds_cycling_addresses_without_sandboxes(start_gateway, upstreams):
    gateway = start_gateway(RULES, args=["--set", "egress_audit_max_refusals_per_second=3"])
    sent = 0
    for octet in CYCLING:
        with _from(gateway, f"{upstreams.block}.{octet}") as conn:
            for n in range(10):
                assert get(conn, f"http://other.test/c/{n}", "other.test").status == 403
                sent += 1
    verbatim, summaries = wait_accounted(gateway, "request", "no_rule", sent)
    assert len(verbatim) + sum(s["count"] for s in summaries) == sent
    assert len(verbatim) <= 12 + 3 * 3, len(verbatim)  # the gateway-wide burst; before: all 100
    assert any("gateway-wide" in s["message"] for s in summaries)


def _served_connection(gateway):
    """A connection the gateway served a request on, or None when it was refused."""
    held = connect_proxy(gateway)
    try:
        if get(held, "http://allowed.test/held", "allowed.test").status == 200:
            return held
    except OSError:
        pass
    held.close()
    return None
