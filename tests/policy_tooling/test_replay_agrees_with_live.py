"""`replay` and live traffic cannot disagree: over random policies and requests, the audit lines live
traffic writes under one policy (tests/policy_tooling/live_walk.py: the session the guards drive,
the credential verdict, the guards' own audit fields), replayed under another, get the verdict
(decision, reason, rule, injected) live traffic gets under that other policy; replayed under the
same one, they come back unchanged, and no line the policy decided is skipped. Transparent TLS lines
are replayed as the ClientHello they were.

The other policy lists every name's addresses in static_hosts, the requests carry no header but a
method override, and a name that does not resolve is left out: what replay cannot know (addresses
not recorded, headers and lookup failures, which no audit line keeps) is not what this compares."""

from __future__ import annotations

import json
from collections import Counter

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.engine import Engine
from gateway.policy import compile_policy
from gateway.replay import HEADER_REASONS, POLICY_REASONS, parse_audit, redecide

from .live_walk import HEADERS, NAMES, Live, policies, requests

DIALLED = ["203.0.113.1", "203.0.113.3", "198.51.100.7", "169.254.169.254"]
RECORDED_HEADERS = [h for h in HEADERS if all(k.startswith("X-HTTP-Method") for k, _ in h)]
SEEN: Counter = Counter()  # what the examples covered: (event, decision, reason, injected)


def _verdict(line: dict) -> tuple:
    return line["decision"], line["reason"], line["rule"], set(line.get("injected") or ())


def _replay(engine: Engine, lines: list[dict], expected) -> None:
    """Every line replay re-decides under `engine` gets `expected(line)`; none the policy decided is skipped."""
    records, result = parse_audit(json.dumps(line) for line in lines)
    replayed = {r.line for r in records}
    for number, line in enumerate(lines, 1):
        SEEN[(line["event"], line["decision"], line["reason"], bool(line.get("injected")))] += 1
        decided = line["reason"] in POLICY_REASONS and not (line["decision"] == "deny" and line["reason"] in HEADER_REASONS)
        assert not decided or number in replayed, (line, result.skipped)
    for record in records:
        new, _ = redecide(engine, record)
        want = expected(lines[record.line - 1])
        assert (new.verdict, new.reason, new.rule, set(new.injected)) == want, (record, new.message)


def _unresolved(live: Live) -> bool:
    """A name that does not resolve (gone.test): no audit line says so, so replay cannot know it."""
    return any(line["reason"] == "resolve_failed" for line in live.lines)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(sandboxes=True), requests())
def test_replayed_under_its_own_policy_a_request_keeps_its_verdict(drawn, request):
    text, headers = drawn
    scheme, host, port, path, method = request
    engine = Engine.build(compile_policy(text, "random.yaml"))
    client = Live(engine)
    path, headers = client.placeholders(path, headers)
    client.request(scheme, host, port, path, method, headers)
    _replay(engine, client.lines, _verdict)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(sandboxes=True), policies(sandboxes=True, every_address=True), requests(),
       st.sampled_from(RECORDED_HEADERS))
def test_replayed_under_another_policy_a_request_gets_what_live_traffic_gets_there(old, new, request, headers):
    scheme, host, port, path, method = request
    before, after = (Engine.build(compile_policy(text, "random.yaml")) for text, _ in (old, new))
    recorded, now = Live(before), Live(after)
    path, headers = recorded.placeholders(path, headers)
    recorded.request(scheme, host, port, path, method, headers)
    now.request(scheme, host, port, path, method, headers)
    assume(not _unresolved(now))
    # what the line does not keep (headers, a query's placeholder) cannot be judged again: replay's blind spot
    assume(not any(line["reason"] in HEADER_REASONS for line in now.lines))
    by_event = {line["event"]: line for line in now.lines}
    # a request line is re-decided as the whole walk: under the new policy its CONNECT may be what refuses it
    _replay(after, recorded.lines, lambda line: _verdict(by_event.get(line["event"], now.lines[-1])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(sandboxes=True), st.sampled_from(NAMES + [None]), st.sampled_from(DIALLED),
       st.sampled_from([443, 8443]))
def test_replayed_under_its_own_policy_a_client_hello_keeps_its_verdict(drawn, sni, dialled, port):
    engine = Engine.build(compile_policy(drawn[0], "random.yaml"))
    client = Live(engine, "transparent")
    client.client_hello(sni, (dialled, port))
    _replay(engine, client.lines, _verdict)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(sandboxes=True), policies(sandboxes=True, every_address=True), st.sampled_from(NAMES + [None]),
       st.sampled_from(DIALLED), st.sampled_from([443, 8443]))
def test_replayed_under_another_policy_a_client_hello_gets_what_live_traffic_gets_there(old, new, sni, dialled,
                                                                                         port):
    before, after = (Engine.build(compile_policy(text, "random.yaml")) for text, _ in (old, new))
    recorded, now = Live(before, "transparent"), Live(after, "transparent")
    recorded.client_hello(sni, (dialled, port))
    now.client_hello(sni, (dialled, port))
    assume(not _unresolved(now))
    _replay(after, recorded.lines, lambda line: _verdict(now.lines[-1]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(sandboxes=True), policies(sandboxes=True, every_address=True),
       st.sampled_from(NAMES + ["203.0.113.1", "bad..name"]), st.sampled_from(["A", "AAAA", "HTTPS", "TXT"]))
def test_replayed_a_dns_question_gets_what_live_traffic_gets(old, new, name, query_type):
    """Under its own policy a dns line keeps its verdict; under another, it gets that policy's."""
    before, after = (Engine.build(compile_policy(text, "random.yaml")) for text, _ in (old, new))
    recorded, now = Live(before, "dns"), Live(after, "dns")
    recorded.dns(name, query_type)
    _replay(before, recorded.lines, _verdict)
    now.dns(name, query_type)
    assume(not _unresolved(now))
    _replay(after, recorded.lines, lambda line: _verdict(now.lines[-1]))
