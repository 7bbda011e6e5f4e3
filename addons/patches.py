"""Every change the gateway makes to mitmproxy's (and asyncio's) own code, in one table, and the
check that refuses to start on a mitmproxy these changes were not tested against.

The gateway needs hooks mitmproxy does not offer (a connection's socket closed on every path, an
upstream HTTP client that keeps framing the gateway checked, reads that wait for a sandbox's
share of the loop...), so a few of its classes and functions are wrapped or replaced. Each
wrapper is installed by the module named in `owner`, where the reason is written out; this table
is where a reviewer (or the person upgrading mitmproxy) sees all of them at once.
`tests/unit/test_patches.py` diffs mitmproxy and asyncio before and after the addons are made:
a change missing from this table, or a row that changes nothing, fails it.

Not in the table because they change no code: the layer guard is registered under mitmproxy's
addon name "nextlayer" (addons/runner.py), and addons/output_guard.py switches mitmproxy's flow
writers off through their options. The other hidden channels (flow.metadata keys, `_egress_*`
attributes on mitmproxy's objects, private mitmproxy imports, the addon order) are tabled in
addons/channels.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mitmproxy.version import VERSION as MITMPROXY_VERSION

# The mitmproxy releases (major, minor) the patches below were tested against: each wraps private
# code that a minor release may change without notice.
TESTED_MITMPROXY = ((12, 3),)
UNTESTED_ENV = "EGRESS_ALLOW_UNTESTED_MITMPROXY"  # "1": start anyway (to test an upgrade)


@dataclass(frozen=True)
class Patch:
    target: str  # module:attribute
    owner: str  # the addons module that installs it (and explains it)
    why: str
    when: str = "always"  # or the command that installs it


PATCHES: tuple[Patch, ...] = (
    Patch("mitmproxy.proxy.server:ConnectionHandler.handle_connection", "addons.conn_close",
          "close the socket on every path, cancellation too (a refused burst leaked a descriptor each)"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.server_event", "addons.crash_close, addons.write_backlog",
          "mitmproxy's, with an event that raises failing its connection closed (every socket reset, no later "
          "event, audited) instead of logged and passed over; wrapped to charge what waits in a connection's "
          "write buffers to its sandbox's buffer budget"),
    Patch("mitmproxy.proxy.server:ConnectionHandler._egress_failed", "addons.crash_close",
          "added: the handler's handling raised, its later events are dropped"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.drain_writers", "addons.read_ahead, addons.h2_backpressure",
          "readers wait at a closed gate; upstream readers wait while their HTTP/2 client does not read"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.handle_client", "addons.conn_timers, addons.fair_share",
          "mitmproxy's, with the watchdog armed in place and the client's reader awaited on one Future, not "
          "asyncio.wait (~1.1 KB per open connection); wrapped to mark the handler's context with its sandbox, "
          "so the loop time it uses is charged to it"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.hook_task", "addons.fair_share",
          "hook tasks inherit the sandbox's mark"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.wakeup", "addons.conn_timers",
          "a layer's wakeup is a loop timer, not a sleeping task, and takes the sandbox's turn before its event"),
    Patch("mitmproxy.proxy.server:TimeoutWatchdog", "addons.conn_timers",
          "the inactivity watchdog is one loop timer per connection, not a sleeping task with an Event "
          "(with the wakeups: ~3.5 KB per open stream)"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.egress_turn", "addons.fair_share",
          "added: awaited between a read and its event, a sandbox over its share waits there"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.egress_read_size", "addons.fair_share",
          "added: how much one read may take for that sandbox"),
    Patch("mitmproxy.proxy.server:ConnectionHandler._egress_spent", "addons.fair_share",
          "added: loop time of the handler not charged yet"),
    Patch("mitmproxy.proxy.server:ConnectionHandler._egress_light", "addons.fair_share",
          "added: the sandbox was within its share at its last turn"),
    Patch("mitmproxy.proxy.server:ConnectionHandler._egress_small_reads", "addons.fair_share",
          "added: its reads were cut to 16 KiB at its last read"),
    Patch("asyncio.events:Handle._run", "addons.fair_share",
          "time every callback the loop runs, to charge it to a sandbox"),
    Patch("asyncio.selector_events:BaseSelectorEventLoop._process_events", "addons.fair_share",
          "count the loop's turns for the share's clock"),
    Patch("asyncio.selector_events:BaseSelectorEventLoop._accept_connection", "addons.accept_gate",
          "count each accepted connection against its sandbox's sockets at once, or refuse it there (EMFILE)"),
    Patch("asyncio.selector_events:BaseSelectorEventLoop._accept_connection2", "addons.fair_share",
          "an accepted connection's setup is charged to its sandbox"),
    Patch("mitmproxy.proxy.layer:Layer.__init__", "addons.layer_memory",
          "a layer starts with the one shared empty queue of paused events, not a deque of its own "
          "(760 bytes each, ~18 layers per tunnel)"),
    Patch("mitmproxy.proxy.layer:Layer.handle_event", "addons.layer_memory",
          "mitmproxy's, with a layer's queue of paused events made when it first queues one"),
    Patch("asyncio.streams:FlowControlMixin.__init__", "addons.stream_memory",
          "a stream protocol starts with one shared empty list of drain waiters, not a deque of its own "
          "(760 bytes each, two per tunnel)"),
    Patch("asyncio.streams:FlowControlMixin._drain_helper", "addons.stream_memory",
          "Python's, with the protocol's deque of drain waiters made when a writer first waits"),
    Patch("asyncio.selector_events:_SelectorSocketTransport.__init__", "addons.stream_memory",
          "a socket transport starts with one shared empty deque of unsent bytes, not a deque of its own "
          "(760 bytes each, two per tunnel)"),
    Patch("asyncio.selector_events:_SelectorSocketTransport.write", "addons.stream_memory",
          "Python's, with the transport's deque of unsent bytes made when the socket first leaves some"),
    Patch("asyncio.selector_events:_SelectorSocketTransport.writelines", "addons.stream_memory",
          "the transport's own deque of unsent bytes made first"),
    Patch("mitmproxy.proxy.server:ConnectionHandler.__init__", "addons.stream_memory",
          "the handler's locks let their deque of waiters go when released with none waiting "
          "(760 bytes per stream, kept for the connection's life)"),
    Patch("mitmproxy.utils.asyncio_utils:set_task_debug_info", "addons.task_info",
          "a task keeps its name, not the creation time and client address only mitmproxy's SIGUSR1 dump reads "
          "(an instance dict of ~300 bytes on each of a stream's tasks)"),
    Patch("mitmproxy.addons.tlsconfig:TlsConfig.tls_start_client", "addons.tls_memory",
          "the sandbox's TLS connection releases idle buffers from its first record and shares one OpenSSL "
          "copy of its leaf certificate and key (32 KiB and 11 KiB per idle tunnel)"),
    Patch("mitmproxy.addons.tlsconfig:TlsConfig.tls_start_server", "addons.tls_memory",
          "the upstream TLS connection releases idle buffers from its first record"),
    Patch("mitmproxy.certs:CertStore.get_cert", "addons.leaf_keys",
          "a new entry gets the store's own P-256 leaf key instead of the CA's"),
    Patch("mitmproxy.certs:dummy_cert", "addons.leaf_keys",
          "inside get_cert: the certificate is for the leaf key, signed with the CA key"),
    Patch("mitmproxy.addonmanager:AddonManager.trigger_event", "addons.hook_dispatch",
          "each event calls the addons that implement its hook from a plan made once, instead of walking "
          "every addon for every event (~31% of the CPU per keep-alive request)"),
    Patch("mitmproxy.hooks:Hook.args", "addons.hook_dispatch",
          "a hook class's field names looked up once, not with dataclasses.fields at every call"),
    Patch("mitmproxy.proxy.layers.tls:TLSLayer.receive_handshake_data", "addons.tls_memory",
          "a TLS connection whose handshake is done gets new, empty memory BIOs: the old ones kept the "
          "handshake's flights' capacity for the connection's life (~6 KiB per tunnel)"),
    Patch("mitmproxy.proxy.layers.tls:TLSLayer.send_data", "addons.tls_memory",
          "new memory BIOs after a large piece sent: a BIO keeps the capacity of the largest piece (256 KiB)"),
    Patch("mitmproxy.proxy.layers.tls:TLSLayer.receive_data", "addons.tls_memory",
          "new memory BIOs after a large piece read: a BIO keeps the capacity of the largest read (64 KiB)"),
    Patch("mitmproxy.proxy.layers.http:Http1Client", "addons.http1",
          "the upstream HTTP/1 client keeps the framing the gateway checked (empty pieces, trailers, limits)"),
    Patch("mitmproxy.proxy.layers.http:Http2Client", "addons.h2_limits",
          "the upstream HTTP/2 client bounds frames and header blocks and drains its queue in a loop"),
    Patch("mitmproxy.proxy.layers.websocket:WebsocketLayer", "addons.websocket_limits, addons.websocket_redaction",
          "WebSocket messages bounded and charged; control frames sent to the client redacted"),
    Patch("mitmproxy.proxy.mode_servers:DnsInstance.make_top_layer", "addons.dns_layer",
          "DNS mode's layer forgets answered queries and bounds what waits while a query's hook runs"),
    Patch("mitmproxy.proxy.mode_servers:asyncio", "addons.runner",
          "listen with SO_REUSEPORT so N workers share each port", when="run --workers N"),
)


class UntestedMitmproxy(RuntimeError):
    pass


def check_mitmproxy_version(version: str = MITMPROXY_VERSION) -> None:
    """Refuse to start on a mitmproxy whose private code the patches were not tested against: a
    wrapper that silently stops applying is a limit that silently stops holding."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) in TESTED_MITMPROXY or os.environ.get(UNTESTED_ENV) == "1":
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_MITMPROXY)
    raise UntestedMitmproxy(
        f"mitmproxy {version} is not a version the egress gateway was tested with ({tested}): it patches "
        f"{len(PATCHES)} private parts of mitmproxy (addons/patches.py), which may no longer hold. Install a "
        f"tested version, or set {UNTESTED_ENV}=1 to start anyway while testing an upgrade."
    )
