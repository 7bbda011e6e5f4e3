"""The shortest end-to-end path: an allowed HTTPS fetch through a tunnel, and a denied one."""

import subprocess

RULES = """
- id: allowed
  hosts: [allowed.test]
"""


def curl(gateway, url, *args):
    cmd = ["curl", "-sS", "--max-time", "10", "-x", gateway.proxy_url, "--cacert", str(gateway.ca_cert),
           "-o", "-", "-w", "\n%{http_code}", url, *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    body, _, code = out.stdout.rpartition("\n")
    return int(code or 0), body


def test_allowed_and_denied(start_gateway, upstreams):
    gateway = start_gateway(RULES)
    status, body = curl(gateway, "https://allowed.test/hello")
    assert status == 200, gateway.log()
    assert "upstream allowed.test: GET /hello" in body
    assert upstreams.tls["allowed.test"].requests[0].sni == "allowed.test"
    status, _ = curl(gateway, "https://other.test/hello")
    assert status == 0  # CONNECT refused: curl reports no HTTP status
    assert upstreams.untouched("other.test")
    decisions = [(a["event"], a["decision"], a["reason"]) for a in gateway.audit()]
    assert ("connect", "allow", "allowed") in decisions
    assert ("request", "allow", "allowed") in decisions
    assert ("connect", "deny", "no_rule") in decisions
