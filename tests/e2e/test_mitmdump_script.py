"""The addons also load into a plain `mitmdump -s addons/egress.py` (for existing mitmproxy users)."""

import socket
import subprocess

from tests.conftest import policy_text
from tests.support.gateway import PROJECT_ROOT, free_port, wait_for_port
from tests.support.mitmdump import mitmdump_path

RULES = """
- id: allowed
  hosts: [allowed.test]
"""


def test_mitmdump_script_enforces_policy(tmp_path, pki, upstreams):
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES))
    port = free_port()
    confdir = tmp_path / "conf"
    audit = tmp_path / "audit.jsonl"
    log = open(tmp_path / "mitmdump.log", "wb")
    proc = subprocess.Popen(
        [mitmdump_path(), "-q", "-s", str(PROJECT_ROOT / "addons" / "egress.py"),
         "--listen-host", "127.0.0.1", "-p", str(port),
         "--set", f"confdir={confdir}", "--set", f"egress_policy={policy}",
         "--set", f"egress_audit_log={audit}", "--set", f"ssl_verify_upstream_trusted_ca={pki.ca_cert}",
         # A user trying to weaken it: forced back to lazy.
         "--set", "connection_strategy=eager"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    try:
        wait_for_port("127.0.0.1", port, process=proc)
        upstreams.reset()
        base = ["curl", "-sS", "--max-time", "10", "-x", f"http://127.0.0.1:{port}",
                "--cacert", str(confdir / "mitmproxy-ca-cert.pem"), "-o", "/dev/null", "-w", "%{http_code}"]
        ok = subprocess.run(base + ["https://allowed.test/x"], capture_output=True, text=True)
        assert ok.stdout == "200", (tmp_path / "mitmdump.log").read_text()
        denied = subprocess.run(base + ["https://other.test/x"], capture_output=True, text=True)
        assert denied.stdout != "200"
        assert upstreams.untouched("other.test")
        assert upstreams.tls["allowed.test"].requests[0].path == "/x"
        reasons = [line for line in audit.read_text().splitlines() if '"no_rule"' in line]
        assert reasons, "the denied CONNECT must be in the audit log"

        # connection_strategy=eager was forced back to lazy: an allowed CONNECT with no request
        # after it opens no upstream connection.
        upstreams.reset()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 200")  # eager would have connected before it
        assert upstreams.untouched("allowed.test")  # (fenced at the upstreams' accept queues)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_mitmdump_refuses_broken_policy(tmp_path):
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\nrules:\n  - id: x\n    hosts: ['*']\n")
    proc = subprocess.run(
        [mitmdump_path(), "-s", str(PROJECT_ROOT / "addons" / "egress.py"), "--listen-host", "127.0.0.1",
         "-p", str(free_port()), "--set", f"confdir={tmp_path / 'conf'}", "--set", f"egress_policy={policy}"],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode != 0
    assert f"{policy}:4:" in proc.stdout + proc.stderr
