"""Revocation in transparent mode (issue 14 part 4): a reload closes the redirected connections the
new policy no longer allows: a raw TCP relay (`protocol: tcp`, transparent only), a TLS connection
pinned by its SNI, a plain-HTTP connection pinned by its first Host; and keeps the others.

The `revoke` sandbox and gateway are these tests' own (tests/transparent/conftest.py): each test
rewrites the policy, sends SIGHUP, and puts the original back afterwards. The raw TCP origin counts
the connections whose gateway side closed (TcpRecorder.closed), so the upstream end is checked too.
"""

from __future__ import annotations

import signal
import ssl

import pytest

from tests.netns.lab import read_response

from .clients import http_request, wait_closed
from .conftest import REVOKE_POLICY
from tests.support.topology import ALLOWED, OTHER, TCP_HOST
from tests.support.waiting import wait_for

pytestmark = pytest.mark.netns

SSH_BANNER = b"SSH-2.0-OpenSSH_9.6\r\n"
WAIT = 10.0


class Reloader:
    def __init__(self, site):
        self.site = site
        self.policy = site.gateway.policy
        self.changed = False

    def ok_lines(self) -> int:
        return len([e for e in self.site.gateway.audit() if e["event"] == "policy_reload" and e["result"] == "ok"])

    def reload(self, text: str) -> None:
        before = self.ok_lines()
        self.policy.write_text(text)
        self.changed = text != REVOKE_POLICY
        self.site.gateway.process.send_signal(signal.SIGHUP)
        self.wait(lambda: self.ok_lines() > before, "the policy_reload line")

    def wait(self, predicate, what: str):
        return wait_for(predicate, WAIT, what, interval=0.02,
                        detail=lambda: f"audit tail {self.site.gateway.audit()[-5:]}")

    def revoked(self, mark: int, **match) -> list[dict]:
        match = {"event": "connection", "reason": "revoked", **match}
        return self.wait(lambda: [e for e in self.site.gateway.audit()[mark:]
                                  if all(e.get(k) == v for k, v in match.items())], f"a revocation line {match}")


@pytest.fixture
def reloader(revoke):
    reloader = Reloader(revoke)
    yield reloader
    if reloader.changed:
        reloader.reload(REVOKE_POLICY)


def without(rule_id: str) -> str:
    head, _, rules = REVOKE_POLICY.partition("rules:\n")
    blocks = rules.split("  - id: ")
    return head + "rules:\n" + "".join(f"  - id: {b}" for b in blocks[1:] if b.split("\n", 1)[0] != rule_id)


def test_a_raw_tcp_relay_is_closed_at_both_ends(topology, revoke, reloader):
    sock = topology.connect(revoke.sandbox, TCP_HOST, 22)
    sock.sendall(SSH_BANNER)
    assert sock.recv(1024) == SSH_BANNER
    client = "%s:%d" % sock.getsockname()[:2]
    mark = revoke.audit_mark()
    reloader.reload(without("ssh-by-ip"))
    [line] = reloader.revoked(mark)
    assert (line["client"], line["kind"], line["protocol"], line["rule"], line["cause"], line["mode"]) == (
        client, "tcp", "tcp", "ssh-by-ip", "no_rule", "transparent")
    assert (line["host"], line["port"], line["original_destination"]) == (TCP_HOST, 22, f"{TCP_HOST}:22")
    assert topology.server(f"{TCP_HOST}:22").wait_closed(1), "the origin's side of the relay stayed open"
    elapsed, data = wait_closed(sock, timeout=WAIT)
    assert data == b""
    sock.close()


def test_a_tls_connection_pinned_by_its_sni_is_closed(topology, revoke, reloader):
    raw = topology.connect(revoke.sandbox, ALLOWED, 443)
    context = ssl.create_default_context(cafile=str(revoke.ca))
    context.set_alpn_protocols(["http/1.1"])
    tls = context.wrap_socket(raw, server_hostname="allowed.test")
    tls.settimeout(WAIT)
    client = "%s:%d" % tls.getsockname()[:2]
    tls.sendall(http_request("allowed.test", "/first"))
    assert read_response(tls).status == 200
    mark = revoke.audit_mark()
    reloader.reload(without("web"))
    [line] = reloader.revoked(mark)
    assert (line["client"], line["kind"], line["rule"], line["cause"], line["host"], line["port"],
            line["original_destination"]) == (client, "tunnel", "web", "no_rule", "allowed.test", 443,
                                              f"{ALLOWED}:443")
    elapsed, data = wait_closed(tls, timeout=WAIT)
    assert data == b""
    # a new connection is refused at its ClientHello: the rule is gone for new traffic too
    assert [r.path for r in topology.server(f"{ALLOWED}:443").requests] == ["/first"]


def test_a_plain_http_connection_pinned_by_its_host_is_closed_and_others_are_not(topology, revoke, reloader):
    gone = topology.connect(revoke.sandbox, OTHER, 80)
    gone.sendall(http_request("other.test", "/first"))
    assert read_response(gone).status == 200
    kept = topology.connect(revoke.sandbox, ALLOWED, 80)
    kept.sendall(http_request("allowed.test", "/first"))
    assert read_response(kept).status == 200
    mark = revoke.audit_mark()
    reloader.reload(without("other-web"))
    [line] = reloader.revoked(mark)
    assert (line["client"], line["kind"], line["rule"], line["host"], line["port"]) == (
        "%s:%d" % gone.getsockname()[:2], "http", "other-web", "other.test", 80)
    wait_closed(gone, timeout=WAIT)
    kept.settimeout(WAIT)
    kept.sendall(http_request("allowed.test", "/second"))
    assert read_response(kept).status == 200
    assert len([e for e in revoke.gateway.audit()[mark:] if e.get("reason") == "revoked"]) == 1
    gone.close()
    kept.close()


def test_a_reload_that_still_allows_the_relay_leaves_it_open(topology, revoke, reloader):
    sock = topology.connect(revoke.sandbox, TCP_HOST, 22)
    sock.settimeout(WAIT)
    sock.sendall(SSH_BANNER)
    assert sock.recv(1024) == SSH_BANNER
    mark = revoke.audit_mark()
    reloader.reload(without("other-web"))  # an unrelated rule goes
    sock.sendall(b"still\n")
    assert sock.recv(1024) == b"still\n"
    assert [e for e in revoke.gateway.audit()[mark:] if e.get("reason") == "revoked"] == []
    assert topology.server(f"{TCP_HOST}:22").closed == 0
    sock.close()
