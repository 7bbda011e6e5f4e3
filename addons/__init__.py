"""mitmproxy addons that adapt proxy hooks to the gateway core (`gateway/`).

Load them all with `mitmdump -s addons/egress.py --set egress_policy=PATH`, or run
`egress-gateway run`, which embeds mitmproxy with the same addons.
"""
