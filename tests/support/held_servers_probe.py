"""A test-only mitmproxy script (`--set scripts=...`): a request for `/held-servers` is answered by
the gateway process itself with how many upstream connection objects (mitmproxy `Server`s) are
still alive in it. Tests use it to see what a long client connection leaves behind."""

import gc

from mitmproxy import connection, http

PATH = "/held-servers"


class HeldServers:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.path == PATH:
            gc.collect()
            count = sum(1 for obj in gc.get_objects() if type(obj) is connection.Server)
            flow.response = http.Response.make(200, str(count).encode(), {"content-type": "text/plain"})


addons = [HeldServers()]
