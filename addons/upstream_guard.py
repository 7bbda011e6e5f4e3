"""The last guard before any upstream socket: only (address, port) pairs that a request on this
client connection was approved for may be dialled, with the pinned TLS server name.

Every upstream connection mitmproxy makes passes `server_connect`; whatever path led there (a bug
in another guard, a mitmproxy code path we did not foresee), an unapproved address is refused.
"""

from __future__ import annotations

import ipaddress
import logging

from mitmproxy.proxy import server_hooks

from .failclosed import fail_closed
from .state import GatewayState

logger = logging.getLogger("egress")
REFUSED = "egress gateway: upstream connection not approved by policy"


def _refuse_on_error(self, data: server_hooks.ServerConnectionHookData, error: Exception) -> None:
    data.server.error = REFUSED


class UpstreamGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(_refuse_on_error)
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        conn = self.state.connections.get(data.client.id)
        address = data.server.address
        key = None
        if address is not None:
            try:
                key = (ipaddress.ip_address(address[0]).compressed, int(address[1]))
            except ValueError:
                key = None
        if conn is None or key is None or key not in conn.admitted:
            logger.warning("egress gateway: refused unapproved upstream connection to %r", address)
            data.server.error = REFUSED
            return
        server_name = conn.admitted[key]
        if server_name is not None:
            data.server.sni = server_name
