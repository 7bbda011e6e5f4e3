"""The least of mitmproxy 12.3 that proxies intercepted HTTPS: its floor of CPU per request (issue 18).

Any proxy built on mitmproxy, the gateway included, runs at least this for each request: the
connection handler, the layers (HTTP/1 parsing and serialising, the message objects, TLS) and the
event loop. This process runs only the addons that serving needs (`Core`, `Proxyserver`,
`NextLayer`, `TlsConfig`, `DnsResolver`) and none of mitmdump's others (its flow dumper, the
script loader, the ~25 addons of features it offers). The hook dispatch walks 5 addons, not 37.
bench/cpu_per_request.py runs it as the `floor` configuration next to bare mitmdump and the
gateway: the floor / mitmdump ratio is the lowest ratio any gateway on mitmproxy could reach.

    python bench/mitmproxy_floor.py --listen 127.0.0.1:8080 --confdir DIR [--upstream-ca PEM]
"""

from __future__ import annotations

import argparse
import asyncio

from mitmproxy import master, options
from mitmproxy.addons import core, dns_resolver, next_layer, proxyserver, tlsconfig


async def serve(listen: str, confdir: str, upstream_ca: str | None) -> None:
    opts = options.Options()
    m = master.Master(opts)
    m.addons.add(core.Core(), proxyserver.Proxyserver(), dns_resolver.DnsResolver(), next_layer.NextLayer(),
                 tlsconfig.TlsConfig())
    updates = {"mode": [f"regular@{listen}"], "confdir": confdir, "connection_strategy": "lazy"}
    if upstream_ca:
        updates["ssl_verify_upstream_trusted_ca"] = upstream_ca
    opts.update(**updates)
    await m.run()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--confdir", required=True, help="where its CA is made")
    p.add_argument("--upstream-ca", help="the CA upstream certificates are verified against")
    args = p.parse_args()
    asyncio.run(serve(args.listen, args.confdir, args.upstream_ca))


if __name__ == "__main__":
    main()
