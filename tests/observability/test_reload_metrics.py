"""Policy reloads as the metrics see them, and the metrics port still guarded under a new policy."""

from __future__ import annotations

import signal

from tests.conftest import policy_text
from tests.support.waiting import wait_for

from .conftest import connect_status, gateway_with_metrics, scrape, value

RULES = """
- id: metrics-port
  hosts: [127.0.0.1]
  ports: [{metrics_port}]
"""


def test_reloads_update_policy_metrics_and_keep_the_port_guarded(tmp_path, upstreams, pki):
    gateway, metrics = gateway_with_metrics(tmp_path, upstreams, pki, RULES, args=["--set", "egress_policy_poll=0"])
    port = int(metrics.rsplit(":", 1)[1])
    try:
        before = scrape(metrics)
        first_sha = [dict(labels)["sha256"] for (name, labels), v in before.items() if name == "egress_policy_info"]
        assert len(first_sha) == 1
        loaded_at = value(before, "egress_policy_last_reload_timestamp_seconds")

        # a valid new policy: a new rule id, the metrics port allowed by two rules now
        rules = RULES.replace("{metrics_port}", str(port)) + f"- id: added-rule\n  hosts: [127.0.0.1]\n  ports: [{port}]\n"
        gateway.policy.write_text(policy_text(upstreams, rules))
        gateway.process.send_signal(signal.SIGHUP)
        after = wait_for(lambda: (s := scrape(metrics)) and value(s, "egress_policy_reloads_total", result="ok") == 1 and s)
        assert value(after, "egress_policy_info", sha256=first_sha[0]) == 0
        assert sum(v for (name, _), v in after.items() if name == "egress_policy_info") == 1
        assert value(after, "egress_policy_last_reload_timestamp_seconds") >= loaded_at
        status, headers = connect_status(gateway, f"127.0.0.1:{port}")
        assert (status, headers.get("x-egress-reason")) == (403, "self_address")  # still the gateway's own

        # an invalid one is counted as an error and changes nothing
        gateway.policy.write_text("version: 1\nrules: [oops\n")
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(lambda: value(scrape(metrics), "egress_policy_reloads_total", result="error") == 1)
        assert gateway.process.poll() is None
        status, headers = connect_status(gateway, f"127.0.0.1:{port}")
        assert (status, headers.get("x-egress-reason")) == (403, "self_address")
        audit = [a for a in gateway.audit() if a["event"] == "policy_reload"]
        assert [a["result"] for a in audit] == ["ok", "error"]
        assert "audit log" in gateway.log() and "reopened" in gateway.log()  # SIGHUP reached both subscribers
    finally:
        assert gateway.stop() == 0
