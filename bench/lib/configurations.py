"""The configurations under test and the figure groups: their names, labels, and the gateway's policy."""

from __future__ import annotations

from lib.names import ORIGIN_NAME

GROUPS = ("configs", "idle", "scaling", "transparent", "bulk", "decision", "streaming")
GROUP_ALIASES = {"explicit": "configs"}  # the name of the first two figures' group before configurations
# Explicit-mode configurations, in report order.
CONFIGS = ("direct", "mitmdump", "mitmdump_passthrough", "gateway", "gateway_workers", "gateway_passthrough", "squid")
# Configurations that may be missing (a tool not installed, a feature this tree lacks): skipped with a note.
OPTIONAL = {"mitmdump_passthrough", "gateway_workers", "gateway_passthrough", "squid"}


LABELS = {
    "direct": "direct (no proxy)",
    "mitmdump": "mitmdump",
    "mitmdump_passthrough": "mitmdump passthrough",
    "gateway": "gateway, 1 worker",
    "gateway_workers": "gateway, N workers",
    "gateway_passthrough": "gateway, inspect: false",
    "squid": "squid (CONNECT)",
    "mitmdump_bulk": "mitmdump (a), bulk",
    "gateway_bulk": "gateway (b), bulk",
    "mitmdump_stream": "mitmdump + stream (a'), bulk",
    "mitmdump_transparent": "mitmdump transparent",
    "gateway_transparent": "gateway transparent",
}


def label(key: str, workers: int | None = None) -> str:
    text = LABELS.get(key, key)
    return text.replace("N workers", f"{workers} workers") if workers else text


def gateway_policy_text(origin_ip: str, transparent: bool = False, passthrough: bool = False) -> str:
    network = "" if transparent else "  allow_ip_ranges: [127.0.0.0/8]\n"
    rule = (f"  - id: bench-origin-passthrough\n    hosts: [{ORIGIN_NAME}]\n    inspect: false\n" if passthrough
            else f"  - id: bench-origin\n    hosts: [{ORIGIN_NAME}]\n    methods: [GET, HEAD]\n")
    return f"""version: 1
network:
  deny_ip_ranges: default
{network}resolver:
  static_hosts:
    {ORIGIN_NAME}: [{origin_ip}]
rules:
{rule}"""
