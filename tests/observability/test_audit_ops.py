"""The audit log of a running gateway: one line per decision under concurrent load, hash chaining,
reopening on SIGHUP after the file was moved, and size-based rotation."""

from __future__ import annotations

import collections
import http.client
import json
import signal
from concurrent.futures import ThreadPoolExecutor

from gateway.audit import verify_chain

from tests.support.waiting import wait_for

from .conftest import gateway_with_metrics, proxy_get, scrape, value

RULES = """
- id: plain
  hosts: [allowed.test]
  schemes: [http]
- id: api
  hosts: [api.test]
  schemes: [http]
  methods: [GET]
  paths: ["/ok/**"]
"""


def test_one_line_per_decision_under_concurrent_load(tmp_path, upstreams, pki):
    gateway, metrics = gateway_with_metrics(tmp_path / "load", upstreams, pki, RULES, args=["--audit-chain"])
    try:
        urls = ["http://allowed.test/item", "http://api.test/ok/1", "http://api.test/admin",
                "http://other.test/", "http://unlisted.test/x"]
        plan = [urls[i % len(urls)] + f"?n={i}" for i in range(200)]

        def worker(urls):
            # 10 requests on one kept-alive connection per thread: each is still its own decision
            conn = http.client.HTTPConnection(gateway.host, gateway.port, timeout=15)
            out = []
            try:
                for url in urls:
                    conn.request("GET", url, headers={"Host": url.split("/", 3)[2]})
                    response = conn.getresponse()
                    response.read()
                    out.append((url, response.status))
            finally:
                conn.close()
            return out

        with ThreadPoolExecutor(max_workers=20) as pool:
            results = [r for batch in pool.map(worker, [plan[i::20] for i in range(20)]) for r in batch]
        statuses = collections.Counter(status for _, status in results)
        assert statuses == {200: 80, 403: 120}, statuses

        # every answer was decided, recorded and flushed before it was sent: nothing to wait for
        lines = gateway.audit_path.read_bytes().split(b"\n")
        assert lines[-1] == b""  # whole lines only
        records = [json.loads(line) for line in lines[:-1]]
        assert len(records) == 200
        assert all(r["event"] == "request" for r in records)
        assert collections.Counter(r["decision"] for r in records) == {"allow": 80, "deny": 120}
        assert sorted(r["path"] for r in records) == sorted("/" + url.split("/", 3)[3] for url in plan)
        # the chain holds under concurrency: lines were serialised in one order
        report = verify_chain([str(gateway.audit_path)])
        assert report.ok and report.lines == 200, report.describe()
        # and the metrics agree with the audit log
        scraped = scrape(metrics)
        assert value(scraped, "egress_requests_total") == 200
        assert value(scraped, "egress_requests_total", decision="allow") == 80
    finally:
        assert gateway.stop() == 0


def test_sighup_reopens_a_moved_audit_log(tmp_path, upstreams, pki):
    gateway, _ = gateway_with_metrics(tmp_path / "hup", upstreams, pki, RULES, args=["--audit-chain"])
    try:
        path = gateway.audit_path
        moved = path.with_name("audit.jsonl.1")
        assert proxy_get(gateway, "http://allowed.test/before").status == 200
        path.rename(moved)  # what logrotate does, before it signals
        assert proxy_get(gateway, "http://allowed.test/moved").status == 200  # still the open descriptor
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(path.exists, what="the audit log to be reopened")
        assert proxy_get(gateway, "http://allowed.test/after").status == 200
        assert gateway.process.poll() is None  # SIGHUP does not stop the gateway
        assert [json.loads(line)["path"] for line in moved.read_text().splitlines()] == ["/before", "/moved"]
        assert [json.loads(line)["path"] for line in path.read_text().splitlines()] == ["/after"]
        assert verify_chain([str(moved), str(path)]).ok  # the chain continues across files
        assert "audit log" in gateway.log() and "reopened" in gateway.log()
    finally:
        assert gateway.stop() == 0


def test_size_rotation(tmp_path, upstreams, pki):
    gateway, _ = gateway_with_metrics(tmp_path / "rot", upstreams, pki, RULES,
                                      args=["--audit-max-bytes", "3000", "--audit-backups", "2", "--audit-chain"])
    try:
        for i in range(30):
            assert proxy_get(gateway, f"http://other.test/{i}").status == 403
        directory = gateway.audit_path.parent
        names = sorted(p.name for p in directory.iterdir() if p.name.startswith("audit.jsonl"))
        assert names == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
        ordered = [directory / "audit.jsonl.2", directory / "audit.jsonl.1", directory / "audit.jsonl"]
        kept = []
        for path in ordered:
            assert 0 < path.stat().st_size <= 3000
            kept += [json.loads(line)["path"] for line in path.read_text().splitlines()]
        # the newest lines are kept, in order, none twice; the oldest were rotated away
        assert kept == [f"/{i}" for i in range(30 - len(kept), 30)]
        report = verify_chain([str(p) for p in ordered], partial=True)
        assert report.ok, report.describe()
    finally:
        assert gateway.stop() == 0


def test_no_secret_values_in_the_audit_log(tmp_path, upstreams, pki):
    """Injected credentials never reach the audit line, even where the request guard records the
    request after injection (a query parameter): every form of a secret is replaced."""
    import subprocess

    secret = "s3cr3t-VALUE-4-audit-test"
    key_file = tmp_path / "api.key"
    key_file.write_text(secret + "\n")
    rules = """
- id: tls
  hosts: [allowed.test]
  inject:
    - query: key
      value: "${secrets.API_KEY}"
    - header: X-Api-Key
      value: "${secrets.API_KEY}"
"""
    extra = f"secrets:\n  API_KEY:\n    file: {key_file}\n"
    gateway, metrics = gateway_with_metrics(tmp_path / "secrets", upstreams, pki, rules, extra)
    try:
        result = subprocess.run(
            ["curl", "-sS", "--max-time", "10", "-x", gateway.proxy_url, "--cacert", str(gateway.ca_cert),
             "-o", "/dev/null", "-w", "%{http_code}", "https://allowed.test/q?x=1"],
            capture_output=True, text=True, timeout=20,
        )
        assert result.stdout == "200", result.stdout + result.stderr + gateway.log()
        received = upstreams.tls["allowed.test"].requests[-1]
        assert secret in received.path  # it was injected upstream...
        text = gateway.audit_path.read_text()
        assert secret not in text  # ...and never written down
        request = [json.loads(line) for line in text.splitlines() if '"event":"request"' in line][-1]
        assert request["injected"] == ["API_KEY"]
        assert request["path"].startswith("/q?x=1")
        scraped = scrape(metrics)
        assert value(scraped, "egress_credential_injections_total", secret="API_KEY", rule="tls") == 1
    finally:
        assert gateway.stop() == 0


def test_rotation_is_on_by_default_for_a_file_and_stdout_still_works(tmp_path, upstreams, pki):
    """The audit log's disk budget: 100 MiB x 5 backups unless told otherwise; stdout cannot rotate
    and must still start with the defaults."""
    gateway, _ = gateway_with_metrics(tmp_path / "file", upstreams, pki, RULES)
    try:
        # (logged when the audit log is configured, which may come after the line start() waits for)
        wait_for(lambda: "rotated at 104857600 bytes, 5 kept" in gateway.log(), what="the rotation line")
    finally:
        assert gateway.stop() == 0
    gateway, _ = gateway_with_metrics(tmp_path / "stdout", upstreams, pki, RULES, args=["--audit-log", "-"])
    try:
        assert proxy_get(gateway, "http://allowed.test/to-stdout").status == 200
        wait_for(lambda: '"path":"/to-stdout"' in gateway.log(), what="the line on stdout")
        assert "rotated at" not in gateway.log()
    finally:
        assert gateway.stop() == 0
