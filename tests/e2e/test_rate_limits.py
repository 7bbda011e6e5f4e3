"""Rates and budgets per sandbox (addons/rate_limits.py), against a real gateway.

Deterministic without sleeping: the gateway-wide buckets get a refill rate so small (one token in
~17 minutes) that only the burst counts, and the policy's windows are a minute or an hour long, far
longer than a test. Each test drives a budget to empty and checks that the next request is refused
with its reason and Retry-After, and that no upstream saw it.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from tests.e2e.helpers import H2Client, audit_for, build_request, connect_proxy, tls_tunnel, start_tls, tunnel
from tests.support.waiting import wait_for

SLOW = "0.001"  # tokens a second: nothing refills during a test


def _sandboxes(upstreams, *, a_limits: str = "", b_rules: str = "[plain, other]") -> str:
    """Sandbox a: every loopback client but one address; sandbox b: 127.X.0.230 only."""
    block = upstreams.block
    return (f"sandboxes:\n"
            f"  - id: a\n    source_ips: [127.0.0.0/8]\n    rules: [plain, other, tls]\n{a_limits}"
            f"  - id: b\n    source_ips: [{block}.230/32]\n    rules: {b_rules}\n")


RULES = """
- id: plain
  hosts: [allowed.test]
  schemes: [http]
  methods: [GET, POST]
- id: other
  hosts: [other.test]
  schemes: [http]
- id: tls
  hosts: [allowed.test]
"""


def _connect_from(gateway, source: str | None = None, timeout: float = 3.0):
    from tests.e2e.helpers import Conn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if source:
        sock.bind((source, 0))
    sock.connect((gateway.host, gateway.port))
    return Conn(sock)


def _get(conn, url: str, method: str = "GET", headers: list | None = None, body: bytes = b""):
    host = url.split("/")[2]
    return conn.request(method, url, [("Host", host), *(headers or [])], body)


def _lines(gateway, reason: str, wait: float = 2.0) -> list[dict]:
    """The audit lines with `reason`, once there is one (after `wait` s: none)."""
    try:
        return wait_for(lambda: [a for a in gateway.audit() if a.get("reason") == reason], wait, reason, interval=0.02)
    except AssertionError:
        return []


# --- the gateway-wide defence ---------------------------------------------------------------


def test_requests_over_the_sandbox_bucket_get_429_and_never_go_upstream(start_gateway, upstreams):
    gateway = start_gateway(RULES, extra=_sandboxes(upstreams), args=[
        "--set", f"egress_max_requests_per_second_per_sandbox={SLOW}", "--set", "egress_request_burst_per_sandbox=3"])
    with connect_proxy(gateway) as conn:
        for i in range(3):
            assert _get(conn, f"http://allowed.test/ok{i}").status == 200
        refused = _get(conn, "http://allowed.test/over")
        # Decided before any rule is looked at: the bucket is taken first, so no rule is named.
        assert (refused.status, refused.egress_reason, refused.egress_rule) == (429, "rate_limited", None)
        assert int(refused.header("Retry-After")) >= 1
        assert refused.header("Connection") == "close"
        client = conn.client
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/ok0", "/ok1", "/ok2"]
    line = [a for a in audit_for(gateway, client, count=4) if a["reason"] == "rate_limited"]
    assert len(line) == 1 and line[0]["decision"] == "deny" and line[0]["status"] == 429
    assert line[0]["sandbox"] == "a"
    # Another sandbox has a bucket of its own: still served.
    with _connect_from(gateway, f"{upstreams.block}.230") as other:
        assert _get(other, "http://allowed.test/b").status == 200


def test_denied_requests_and_connects_take_tokens_too_and_a_429_closes_the_connection(start_gateway, upstreams):
    """A sandbox flooding requests the rules deny spends its own bucket: every request head and
    CONNECT takes a token before it is decided, and the HTTP/1 connection answered 429 is closed."""
    gateway = start_gateway(RULES, extra=_sandboxes(upstreams), args=[
        "--set", f"egress_max_requests_per_second_per_sandbox={SLOW}", "--set", "egress_request_burst_per_sandbox=4"])
    with connect_proxy(gateway) as conn:
        for i in range(3):  # denied by the rules (403), on one kept-alive connection
            assert _get(conn, f"http://api.test/denied{i}").status == 403
        conn.send(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")  # a denied CONNECT too
        assert conn.read_response().status == 403
        refused = _get(conn, "http://allowed.test/allowed")  # allowed by the rules, but the bucket is empty
        assert (refused.status, refused.egress_reason) == (429, "rate_limited")
        assert refused.header("Connection") == "close"
        conn.sock.settimeout(3)
        assert conn.sock.recv(1) == b""  # closed by the gateway after the answer
    with connect_proxy(gateway) as conn:  # a denied CONNECT over the bucket: 429 as well
        conn.send(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        assert conn.read_response().egress_reason == "rate_limited"
    assert upstreams.plain["allowed.test"].requests == []
    with _connect_from(gateway, f"{upstreams.block}.230") as other:  # sandbox b: its own bucket
        assert _get(other, "http://allowed.test/b").status == 200


def test_http2_rate_refusals_count_as_resets_and_a_flood_ends_in_goaway(start_gateway, upstreams):
    """Streams answered 429 count toward the connection's reset tracker: past egress_h2_max_resets
    the connection gets GOAWAY (reset_flood), so a flood of refused streams cannot go on forever."""
    import pytest

    gateway = start_gateway(RULES, extra=_sandboxes(upstreams), args=[
        "--set", f"egress_max_requests_per_second_per_sandbox={SLOW}", "--set", "egress_request_burst_per_sandbox=2",
        "--set", "egress_h2_max_resets=5", "--set", "egress_h2_reset_window=600"])
    conn = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])  # the CONNECT took one token
    client = H2Client(conn)
    first = client.send("allowed.test", "/s0")
    client.wait(first)
    assert client.responses[first]["status"] == 200
    for i in range(5):  # five refusals: at the limit, not over it
        stream = client.send("allowed.test", f"/r{i}")
        client.wait(stream)
        assert client.header(stream, "x-egress-reason") == "rate_limited"
    flood = _lines(gateway, "reset_flood", wait=0.5)
    assert not flood, gateway.audit()
    with pytest.raises(ConnectionError, match="GOAWAY|closed"):
        stream = client.send("allowed.test", "/r5")  # the sixth: answered, then GOAWAY and close
        client.wait(stream)
        client.wait(client.send("allowed.test", "/r6"))
    flood = _lines(gateway, "reset_flood")
    assert len(flood) == 1 and flood[0]["sandbox"] == "a"
    assert len(upstreams.tls["allowed.test"].requests) == 1
    conn.close()


def test_a_rate_too_small_to_invert_is_refused_at_start(start_gateway, upstreams):
    """1e-320 a second made every wait infinite, and every refusal a 500 (Retry-After overflowed)."""
    import pytest

    for option in ("egress_max_requests_per_second_per_sandbox", "egress_max_new_connections_per_second_per_sandbox"):
        with pytest.raises(RuntimeError, match=rf"{option}: a rate must be 0 \(no limit\) or at least 0.001"):
            start_gateway(RULES, extra=_sandboxes(upstreams), args=["--set", f"{option}=1e-320"])


def test_http2_streams_over_the_bucket_are_refused_one_by_one(start_gateway, upstreams):
    gateway = start_gateway(RULES, extra=_sandboxes(upstreams), args=[
        "--set", f"egress_max_requests_per_second_per_sandbox={SLOW}", "--set", "egress_request_burst_per_sandbox=3"])
    conn = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])  # the CONNECT takes a token too
    client = H2Client(conn)
    streams = [client.send("allowed.test", f"/s{i}") for i in range(3)]
    client.wait(*streams)
    statuses = [client.responses[s]["status"] for s in streams]
    assert sorted(statuses) == [200, 200, 429]
    refused = streams[statuses.index(429)]
    assert client.header(refused, "x-egress-reason") == "rate_limited"
    assert int(client.header(refused, "retry-after")) >= 1
    assert len(upstreams.tls["allowed.test"].requests) == 2
    conn.close()


def test_new_connections_over_the_sandbox_bucket_are_closed_at_accept(start_gateway, upstreams):
    gateway = start_gateway(RULES, extra=_sandboxes(upstreams), args=[
        "--set", f"egress_max_new_connections_per_second_per_sandbox={SLOW}",
        "--set", "egress_new_connection_burst_per_sandbox=4"])
    served = closed = 0
    for i in range(8):
        with connect_proxy(gateway) as conn:
            try:
                conn.send(build_request("GET", f"http://allowed.test/c{i}", [("Host", "allowed.test")]))
                response = conn.read_response()
            except (ConnectionError, OSError):
                response = None
            if response is not None and response.status == 200:
                assert not closed, "a connection was served after one was refused: the bucket refilled"
                served += 1
            else:
                closed += 1
    # The start-up probe took a token or two of the burst of 4; every later connection was closed.
    assert 1 <= served <= 4 and served + closed == 8
    assert len(upstreams.plain["allowed.test"].requests) == served
    lines = _lines(gateway, "connection_rate_limited")
    deadline = time.monotonic() + 2
    while len(lines) < closed and time.monotonic() < deadline:
        lines = _lines(gateway, "connection_rate_limited")
    assert len(lines) == closed
    assert all(a["decision"] == "deny" and a["status"] is None and a["sandbox"] == "a" for a in lines)
    # Sandbox b opens connections from its own bucket.
    with _connect_from(gateway, f"{upstreams.block}.230") as other:
        assert _get(other, "http://allowed.test/b").status == 200


# --- the policy's limits: -------------------------------------------------------------------


def test_rule_requests_per_minute_is_per_sandbox_and_per_rule(start_gateway, upstreams):
    rules = RULES.replace("  methods: [GET, POST]\n", "  methods: [GET, POST]\n  limits:\n    requests_per_minute: 2\n")
    gateway = start_gateway(rules, extra=_sandboxes(upstreams))
    with connect_proxy(gateway) as conn:
        assert [_get(conn, f"http://allowed.test/{i}").status for i in range(2)] == [200, 200]
        refused = _get(conn, "http://allowed.test/third")
        assert (refused.status, refused.egress_reason, refused.egress_rule) == (429, "rate_limited", "plain")
        assert 1 <= int(refused.header("Retry-After")) <= 60
        assert "limits.requests_per_minute" in refused.text
        assert refused.header("Connection") == "close"  # a 429 closes an HTTP/1 connection
    with connect_proxy(gateway) as conn:
        assert _get(conn, "http://other.test/x").status == 200  # another rule: its own (no) limit
    assert len(upstreams.plain["allowed.test"].requests) == 2
    with _connect_from(gateway, f"{upstreams.block}.230") as other:  # sandbox b: its own count on the rule
        assert _get(other, "http://allowed.test/b").status == 200


def test_sandbox_requests_per_minute_counts_every_rule(start_gateway, upstreams):
    extra = _sandboxes(upstreams, a_limits="    limits:\n      requests_per_minute: 3\n")
    gateway = start_gateway(RULES, extra=extra)
    with connect_proxy(gateway) as conn:
        assert _get(conn, "http://allowed.test/1").status == 200
        assert _get(conn, "http://other.test/2").status == 200
        assert _get(conn, "http://allowed.test/3").status == 200
        refused = _get(conn, "http://other.test/4")
        assert (refused.status, refused.egress_reason) == (429, "rate_limited")
    with connect_proxy(gateway) as conn:
        # A refused request costs nothing: a denied destination is still just denied (403), uncounted.
        assert _get(conn, "http://api.test/").status == 403
    assert [r.path for r in upstreams.plain["other.test"].requests] == ["/2"]


def test_upload_budget_refuses_a_declared_body_at_its_head(start_gateway, upstreams):
    rules = RULES.replace("  methods: [GET, POST]\n",
                          "  methods: [GET, POST]\n  limits:\n    upload_bytes_per_hour: 1KiB\n")
    gateway = start_gateway(rules, extra=_sandboxes(upstreams))
    with connect_proxy(gateway) as conn:
        assert _get(conn, "http://allowed.test/up1", "POST", body=b"x" * 600).status == 200
        refused = _get(conn, "http://allowed.test/up2", "POST", body=b"y" * 600)
        assert (refused.status, refused.egress_reason) == (429, "upload_quota_exceeded")
        assert refused.header("Retry-After") is not None
    with connect_proxy(gateway) as conn:
        assert _get(conn, "http://allowed.test/up3", "POST", body=b"z" * 400).status == 200  # 1000 of 1024
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/up1", "/up3"]


class _Sink:
    """A plain TCP origin that records every byte it receives and answers nothing."""

    def __init__(self, host: str):
        import threading

        self.received = b""
        self.closed = threading.Event()  # the gateway closed (or reset) its upstream connection
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 80))
        self._sock.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            client, _ = self._sock.accept()
        except OSError:
            return
        client.settimeout(10)
        try:
            while chunk := client.recv(65536):
                self.received += chunk
        except OSError:
            pass
        client.close()
        self.closed.set()

    def close(self) -> None:
        self._sock.close()


def test_upload_budget_cuts_off_a_streamed_body_before_its_end(start_gateway, upstreams):
    from tests.e2e.helpers import extra_static_hosts

    sink = _Sink(f"{upstreams.block}.231")
    rules = RULES + "- id: sink\n  hosts: [sink.test]\n  schemes: [http]\n  methods: [POST]\n" \
                    "  limits:\n    upload_bytes_per_hour: 1000\n"
    extra = extra_static_hosts({"sink.test": f"{upstreams.block}.231"}) + _sandboxes(upstreams).replace(
        "rules: [plain, other, tls]", "rules: [plain, other, tls, sink]")
    gateway = start_gateway(rules, extra=extra)
    try:
        conn = connect_proxy(gateway)
        conn.send(b"POST http://sink.test/stream HTTP/1.1\r\nHost: sink.test\r\nContent-Type: application/octet-stream"
                  b"\r\nTransfer-Encoding: chunked\r\n\r\n" + b"258\r\n" + b"a" * 600 + b"\r\n")
        wait_for(lambda: b"a" * 600 in sink.received, 3, "the first 600 bytes upstream (streamed)",
                 detail=lambda: repr(sink.received[:300]))
        conn.send(b"258\r\n" + b"b" * 600 + b"\r\n0\r\n\r\n")
        response = conn.read_response()
        assert (response.status, response.egress_reason) == (429, "upload_quota_exceeded")
        lines = [a for a in audit_for(gateway, conn.client, count=2) if a["event"] == "request_body"]
        assert len(lines) == 1 and lines[0]["reason"] == "upload_quota_exceeded" and lines[0]["rule"] == "sink"
        assert sink.closed.wait(5)  # the gateway aborted the upstream request: nothing more can arrive
        conn.close()
        assert b"b" not in sink.received.split(b"\r\n\r\n", 1)[1]  # nothing of the chunk that passed the budget
        assert not sink.received.endswith(b"0\r\n\r\n")  # and the origin never had a complete request
    finally:
        sink.close()


def test_upload_budget_refuses_an_http2_body_of_unknown_length(start_gateway, upstreams):
    rules = RULES.replace("- id: tls\n  hosts: [allowed.test]\n",
                          "- id: tls\n  hosts: [allowed.test]\n  limits:\n    upload_bytes_per_hour: 1000\n")
    gateway = start_gateway(rules, extra=_sandboxes(upstreams))
    conn = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])
    client = H2Client(conn)
    small = client.send("allowed.test", "/small", "POST", body=b"s" * 600)
    client.wait(small)
    big = client.send("allowed.test", "/big", "POST", body=b"b" * 600)  # no content-length: counted as it comes
    client.wait(big)
    assert client.responses[small]["status"] == 200
    assert client.responses[big]["status"] == 429
    assert client.header(big, "x-egress-reason") == "upload_quota_exceeded"
    assert client.header(big, "retry-after") is not None
    # The refused stream's head may have gone upstream (its body streams); that no byte of a body past
    # the budget does is test_upload_budget_cuts_off_a_streamed_body_before_its_end's (a raw origin).
    assert upstreams.tls["allowed.test"].requests[0].path == "/small"
    conn.close()


def test_download_budget_refuses_a_declared_length_over_what_is_left_and_then_the_next_request(
        start_gateway, upstreams):
    from tests.support.gateway import free_port

    extra = _sandboxes(upstreams, a_limits="    limits:\n      download_bytes_per_hour: 1000\n")
    metrics_port = free_port("127.0.0.1")
    gateway = start_gateway(RULES, extra=extra, args=["--metrics", f"127.0.0.1:{metrics_port}"])
    with connect_proxy(gateway) as conn:
        first = _get(conn, "http://allowed.test/bytes/800")
        assert first.status == 200 and len(first.body) == 800
        # 800 of 1000 used: a response declaring 800 more is refused at its head, none of its body sent.
        second = _get(conn, "http://allowed.test/bytes/800")
        assert (second.status, second.egress_reason) == (429, "download_quota_exceeded")
        assert second.header("Retry-After") is not None and b"\x00" * 10 not in second.body
        assert "800 bytes" in second.text
    line = _lines(gateway, "download_quota_exceeded")
    assert len(line) == 1 and line[0]["event"] == "response" and line[0]["sandbox"] == "a"
    with connect_proxy(gateway) as conn:  # a 429 closed the connection
        streamed = _get(conn, "http://allowed.test/chunked/300")  # unknown length: counted, not cut off
        assert streamed.status == 200 and len(streamed.body) == 300
        refused = _get(conn, "http://allowed.test/bytes/10")  # spent (1100 of 1000): refused at the request head
        assert (refused.status, refused.egress_reason) == (429, "download_quota_exceeded")
    assert len(upstreams.plain["allowed.test"].requests) == 3
    with _connect_from(gateway, f"{upstreams.block}.230") as other:  # b has no download budget
        assert _get(other, "http://allowed.test/bytes/2000").status == 200
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert 'egress_limited_bytes_total{direction="download",rule="plain",sandbox="a"} 1100.0' in text
    assert 'reason="download_quota_exceeded",rule="plain",sandbox="a"} 1.0' in text  # the request refused
    # The response refused after its request was allowed counts with the refusals after the policy.
    assert any("download_quota_exceeded" in line and line.endswith(" 1.0") and "sandbox" not in line
               for line in text.splitlines()), text
    assert 'sandbox="b"' not in text.split("egress_limited_bytes_total", 1)[1].split("# HELP", 1)[0]  # b has no budget


def test_parallel_responses_reserve_their_declared_length_and_cannot_overshoot(start_gateway, upstreams):
    """Five HTTP/2 streams of 30,000 bytes at once against 100,000: the heads reserve their lengths, so
    three are served and two refused, whatever order their bodies would have arrived in."""
    extra = _sandboxes(upstreams, a_limits="    limits:\n      download_bytes_per_hour: 100000\n")
    gateway = start_gateway(RULES, extra=extra)
    conn = tls_tunnel(gateway, "allowed.test:443", alpn=["h2"])
    client = H2Client(conn)
    streams = [client.send("allowed.test", "/bytes/30000") for _ in range(5)]
    client.wait(*streams)
    statuses = sorted(client.responses[s]["status"] for s in streams)
    assert statuses == [200, 200, 200, 429, 429]
    served = sum(len(client.responses[s]["body"]) for s in streams if client.responses[s]["status"] == 200)
    assert served == 90000
    assert {client.header(s, "x-egress-reason") for s in streams if client.responses[s]["status"] == 429} \
        == {"download_quota_exceeded"}
    conn.close()


def test_download_budget_counts_streamed_responses(start_gateway, upstreams):
    extra = _sandboxes(upstreams, a_limits="    limits:\n      download_bytes_per_hour: 100KiB\n")
    gateway = start_gateway(RULES, extra=extra)
    with connect_proxy(gateway) as conn:
        streamed = _get(conn, "http://allowed.test/chunked/150000")  # unknown length: streamed
        assert streamed.status == 200 and len(streamed.body) == 150000
        refused = _get(conn, "http://allowed.test/x")
        assert (refused.status, refused.egress_reason) == (429, "download_quota_exceeded")


def test_credential_budget_counts_every_sandbox_together(start_gateway, upstreams, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cr3t-value")
    rules = f"""
- id: plain
  hosts: [allowed.test]
  schemes: [http]
- id: other
  hosts: [other.test]
  schemes: [http]
- id: tls
  hosts: [allowed.test]
  inject:
    - header: Authorization
      value: "Bearer ${{secrets.TOKEN}}"
  limits:
    requests_per_credential_per_minute: 2
"""
    extra = (f"secrets:\n  TOKEN: {{file: {secret}}}\n"
             + _sandboxes(upstreams, b_rules="[plain, other, tls]"))
    gateway = start_gateway(rules, extra=extra)
    a = tls_tunnel(gateway, "allowed.test:443")
    assert a.request("GET", "/1", [("Host", "allowed.test")]).status == 200
    conn, response = _tunnel_from(gateway, f"{upstreams.block}.230", "allowed.test:443")
    b = start_tls(conn, gateway, "allowed.test")
    assert b.request("GET", "/2", [("Host", "allowed.test")]).status == 200
    refused = a.request("GET", "/3", [("Host", "allowed.test")])
    assert (refused.status, refused.egress_reason, refused.egress_rule) == (429, "credential_rate_limited", "tls")
    assert "s3cr3t" not in refused.text
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/1", "/2"]
    line = _lines(gateway, "credential_rate_limited")
    assert line and not line[0].get("injected")
    a.close()
    b.close()


def test_credential_budget_is_one_count_per_secret_across_rules(start_gateway, upstreams, tmp_path):
    """Two rules injecting the same secret, each with limit 2: the secret goes upstream twice a
    minute in all, not twice per rule (the credential's own quota at the provider)."""
    secret = tmp_path / "token"
    secret.write_text("s3cr3t-value")
    inject = """  inject:
    - header: Authorization
      value: "Bearer ${secrets.TOKEN}"
  limits:
    requests_per_credential_per_minute: 2
"""
    rules = f"- id: tls\n  hosts: [allowed.test]\n{inject}- id: tls2\n  hosts: [other.test]\n{inject}"
    extra = (f"secrets:\n  TOKEN: {{file: {secret}}}\n"
             + _sandboxes(upstreams, b_rules="[tls]").replace("rules: [plain, other, tls]", "rules: [tls, tls2]"))
    gateway = start_gateway(rules, extra=extra)
    a = tls_tunnel(gateway, "allowed.test:443")
    assert [a.request("GET", f"/{i}", [("Host", "allowed.test")]).status for i in range(2)] == [200, 200]
    a.close()
    b = tls_tunnel(gateway, "other.test:443")
    refused = b.request("GET", "/other", [("Host", "other.test")])
    assert (refused.status, refused.egress_reason, refused.egress_rule) == (429, "credential_rate_limited", "tls2")
    assert "credential TOKEN (every rule and sandbox together)" in refused.text and "s3cr3t" not in refused.text
    assert upstreams.tls["other.test"].requests == []
    b.close()


def _tunnel_from(gateway, source: str, authority: str):
    conn = _connect_from(gateway, source)
    conn.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    response = conn.read_response(head_only=True)
    assert response.status == 200
    return conn, response


def test_a_reload_keeps_the_counters_of_the_limits_it_keeps(start_gateway, upstreams):
    rules = RULES.replace("  methods: [GET, POST]\n", "  methods: [GET, POST]\n  limits:\n    requests_per_minute: 2\n")
    gateway = start_gateway(rules, extra=_sandboxes(upstreams), args=["--set", "egress_policy_poll=0"])

    def reload(text: str) -> None:
        from tests.conftest import policy_text

        before = len([a for a in gateway.audit() if a["event"] == "policy_reload"])
        tmp = gateway.policy.with_suffix(".tmp")
        tmp.write_text(policy_text(upstreams, text, _sandboxes(upstreams)))
        os.replace(tmp, gateway.policy)
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(lambda: len([a for a in gateway.audit() if a["event"] == "policy_reload"]) > before, 8,
                 "the reload's line", detail=lambda: gateway.log()[-2000:])

    with connect_proxy(gateway) as conn:
        assert [_get(conn, f"http://allowed.test/{i}").status for i in range(2)] == [200, 200]
    # Same limit, another rule added: the count survives.
    reload(rules + "- id: extra\n  hosts: [api.test]\n  schemes: [http]\n")
    with connect_proxy(gateway) as conn:
        assert _get(conn, "http://allowed.test/after-reload").egress_reason == "rate_limited"
    # The limit raised to 3: the same count, under the new limit.
    reload(rules.replace("requests_per_minute: 2", "requests_per_minute: 3"))
    with connect_proxy(gateway) as conn:
        assert _get(conn, "http://allowed.test/raised").status == 200
        assert _get(conn, "http://allowed.test/raised2").egress_reason == "rate_limited"
    # The limit removed, then set again: a new counter.
    reload(RULES)
    reload(rules)
    with connect_proxy(gateway) as conn:
        assert [_get(conn, f"http://allowed.test/new{i}").status for i in range(2)] == [200, 200]


def _websocket_world(start_gateway, upstreams, last: int, limits: str = "", args: list[str] | None = None):
    """(a WebSocket echo origin as ws.test at BLOCK.<last>, a gateway whose rule `ws` allows it,
    with `limits`, and is in the sandboxes' rules)."""
    from tests.e2e.helpers import extra_static_hosts
    from tests.support.watched import WebSocketOrigin

    address = f"{upstreams.block}.{last}"
    origin = WebSocketOrigin(address, 80)
    rules = RULES + "- id: ws\n  hosts: [ws.test]\n  schemes: [http]\n" + limits
    extra = extra_static_hosts({"ws.test": address}) + _sandboxes(upstreams).replace(
        "rules: [plain, other, tls]", "rules: [plain, other, tls, ws]")
    try:
        return origin, start_gateway(rules, extra=extra, args=args)
    except BaseException:
        origin.stop()
        raise


def test_websocket_messages_count_against_the_upload_budget(start_gateway, upstreams):
    import pytest
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect as ws_connect

    origin, gateway = _websocket_world(start_gateway, upstreams, 232, "  limits:\n    upload_bytes_per_hour: 100\n")
    try:
        with ws_connect("ws://ws.test/chat", proxy=gateway.proxy_url, open_timeout=3, ping_interval=None,
                        close_timeout=1) as ws:
            ws.send("a" * 60)
            assert ws.recv(timeout=3) == "echo: " + "a" * 60  # the echo counts against nothing: no download budget
            ws.send("b" * 60)  # 120 of 100: dropped, the WebSocket closed
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=3)
        assert origin.wait_closed(1)
        assert origin.received == ["a" * 60]
        lines = _lines(gateway, "upload_quota_exceeded")
        assert len(lines) == 1 and lines[0]["event"] == "request_body" and lines[0]["rule"] == "ws"
    finally:
        origin.stop()


def test_websocket_messages_to_the_sandbox_count_against_the_download_budget(start_gateway, upstreams):
    import pytest
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect as ws_connect

    origin, gateway = _websocket_world(start_gateway, upstreams, 233, "  limits:\n    download_bytes_per_hour: 100\n")
    try:
        with ws_connect("ws://ws.test/chat", proxy=gateway.proxy_url, open_timeout=3, ping_interval=None,
                        close_timeout=1) as ws:
            ws.send("a" * 60)
            assert ws.recv(timeout=3) == "echo: " + "a" * 60  # 66 of 100
            ws.send("b" * 60)  # its echo would make 132 of 100: dropped, the WebSocket closed
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=3)
        assert origin.wait_closed(1)
        lines = _lines(gateway, "download_quota_exceeded")
        assert len(lines) == 1 and lines[0]["event"] == "response" and lines[0]["rule"] == "ws"
    finally:
        origin.stop()


def test_websocket_upgrades_and_their_connects_take_tokens(start_gateway, upstreams):
    import pytest
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect as ws_connect

    origin, gateway = _websocket_world(start_gateway, upstreams, 234, args=[
        "--set", f"egress_max_requests_per_second_per_sandbox={SLOW}", "--set", "egress_request_burst_per_sandbox=3"])
    try:
        with ws_connect("ws://ws.test/chat", proxy=gateway.proxy_url, open_timeout=3, ping_interval=None,
                        close_timeout=1) as ws:  # its CONNECT and its upgrade: two tokens
            ws.send("hi")
            assert ws.recv(timeout=3) == "echo: hi"
        with pytest.raises(InvalidStatus) as refused:  # the CONNECT takes the last token, the upgrade finds none
            ws_connect("ws://ws.test/chat", proxy=gateway.proxy_url, open_timeout=3, ping_interval=None)
        assert refused.value.response.status_code == 429
        assert refused.value.response.headers.get("X-Egress-Reason") == "rate_limited"
        assert len(_lines(gateway, "rate_limited")) == 1
    finally:
        origin.stop()
