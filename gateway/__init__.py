"""The egress gateway's core: policy, canonical names, address checks, pinning, audit.

Nothing in this package imports mitmproxy; the adapters live in `addons/`.
"""

__version__ = "0.1.0"
