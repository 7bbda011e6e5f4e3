"""Every channel between addons that does not go through a function call, in tables: keys of
`flow.metadata`, `_egress_*` attributes set on mitmproxy's objects and classes, private modules of
mitmproxy (and h11) imported, and the order the addons run in.

Each of these couples two modules that do not import each other's names for it (a key written in
one is read in another), or couples the gateway to code mitmproxy may change in any release; the
tables are where a reviewer, or whoever upgrades mitmproxy, sees them all at once. The constants
stay in the modules that own them: `defined` names the module and the expression there ("" when
the name is spelled as a literal at each use). `tests/unit/test_channels.py` reads the addons'
source: a key, attribute or private import missing from these tables, a row nothing uses, or a
module that writes or reads a key without being in its row fails it, and so does an addon order
other than the one `addons/egress.py` `make_addons()` returns.

What the gateway changes in mitmproxy's and asyncio's own code is in addons/patches.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetadataKey:
    key: str  # in flow.metadata
    defined: str  # "module:expression" that spells it there ("": a literal at each use)
    written_by: str  # the modules that set it, ", "-separated
    read_by: str  # the modules that read it (get, [], in, pop)
    why: str


@dataclass(frozen=True)
class Attribute:
    name: str
    on: str  # what object or class carries it
    defined: str
    written_by: str  # set, or declared in a class body (a subclass of mitmproxy's, __slots__)
    read_by: str
    why: str


@dataclass(frozen=True)
class PrivateImport:
    module: str
    names: str  # what is imported from it ("" for the module itself)
    imported_by: str
    why: str


@dataclass(frozen=True)
class AddonStep:
    addon: str  # the class
    owner: str  # its module
    why: str  # why it sits here in the order ("" is not allowed: say "any place" if so)


METADATA: tuple[MetadataKey, ...] = (
    MetadataKey("egress_decision", "", "addons.request_guard, addons.respond",
                "addons.http1_server, addons.http_stream, addons.metrics, addons.revocation, addons.streaming, "
                "addons.websocket_limits",
                "the Decision a request was judged by: allowed ones are streamed, counted, relayed; a refusal "
                "the gateway answered is told apart from an error of mitmproxy's"),
    MetadataKey("egress_pin", "", "addons.request_guard",
                "addons.rate_limits, addons.revocation, addons.upgrade_guard",
                "the pinned destination the request went to, for the audit fields of later refusals and "
                "for judging the connection again after a reload"),
    MetadataKey("egress_facts", "addons.revocation:FACTS", "addons.request_guard",
                "addons.body_checks, addons.request_guard, addons.revocation",
                "the RequestFacts a request was judged by: its body checks and a reload judge the same facts"),
    MetadataKey("egress_generation", "addons.revocation:GENERATION", "addons.request_guard", "addons.revocation",
                "the engine generation that judged the request: a reload judges again only what an older one allowed"),
    MetadataKey("egress_registry_seq", "addons.revocation:REGISTRY_SEQ", "addons.request_guard", "addons.revocation",
                "the control registry's op count when the request's scope was taken: a registry change "
                "while it was decided (a DNS wait) judges it again once it is in flight"),
    MetadataKey("egress_body_check", "addons.method_body:BODY_CHECK", "addons.body_checks, addons.rate_limits",
                "addons.http_stream, addons.rate_limits",
                "the check a request body must pass as it is read (method overrides, an empty body, the upload "
                "quota wrapping either): the HTTP stream feeds it the body"),
    MetadataKey("egress_hold_body", "addons.http_stream:HOLD_BODY", "addons.body_checks",
                "addons.http_stream, addons.streaming",
                "the body is buffered whole, never streamed, so that it is checked before a byte goes upstream"),
    MetadataKey("egress_bound", "addons.credentials:BOUND", "addons.credentials",
                "addons.http_stream, addons.response_redaction, addons.streaming, addons.websocket_redaction",
                "the secrets this request carried: its response is redacted, so it is not streamed raw"),
    MetadataKey("egress_buffer_account", "addons.body_redaction:BUFFER_ACCOUNT", "addons.http_stream",
                "addons.body_redaction",
                "the stream's share of the buffer ledger, charged for what redaction holds back"),
    MetadataKey("egress_credential_audit", "addons.credentials:CredentialInjector.AUDIT", "addons.credentials",
                "addons.credentials",
                "audit fields of a credential refusal, taken once by the audit record"),
    MetadataKey("egress_bytes_counted_request", "addons.metrics:COUNTED + '_request'", "addons.metrics",
                "addons.metrics",
                "the request body's bytes are counted by a stream wrapper: the end hook must not count them again"),
    MetadataKey("egress_bytes_counted_response", "addons.metrics:COUNTED + '_response'", "addons.metrics",
                "addons.metrics", "as above, for the response body"),
    MetadataKey("egress_limits_charge", "addons.rate_limits:CHARGE", "addons.rate_limits", "addons.rate_limits",
                "the quota windows this request's bytes count against, chosen once at the head"),
    MetadataKey("egress_limits_charge_streamed", "addons.rate_limits:CHARGE + '_streamed'", "addons.rate_limits",
                "addons.rate_limits", "the response is metered as it streams: its end is not charged again"),
    MetadataKey("egress_limits_reserved", "addons.rate_limits:RESERVED", "addons.rate_limits", "addons.rate_limits",
                "response bytes counted at the head (Content-Length), not yet sent"),
)

ATTRIBUTES: tuple[Attribute, ...] = (
    # set on mitmproxy's message objects, read where mitmproxy gives the gateway only the object
    Attribute("_egress_refusal", "a Request, or an HTTP error event", "addons.refusals:REFUSAL_ATTR",
              "addons.http2_server, addons.http_stream, addons.respond",
              "addons.http1_server, addons.http2_server, addons.http_stream",
              "the refusal the gateway decided and audited, so that the error mitmproxy then sends itself "
              "carries its status and reason and is not audited twice, and a refused head is not sent the "
              "100 Continue its Expect asked for"),
    Attribute("_egress_rate_refused", "a DNSFlow", "addons.dns_layer:RATE_REFUSED_ATTR", "addons.dns_guard",
              "addons.dns_layer", "a DNS query refused for the sandbox's DNS rate: enough of them in a row end the "
              "client's connection"),
    Attribute("_egress_counts_as_reset", "a Response the gateway made", "addons.respond:COUNTS_AS_RESET",
              "addons.rate_limits, addons.respond", "addons.http2_server",
              "the HTTP/2 server counts such a stream in its reset budget"),
    Attribute("_egress_end_stream", "a Request", "addons.http_stream:END_STREAM_ATTR", "addons.http_stream",
              "addons.layers", "whether the request's head ended its stream (no body follows), for the body checks"),
    Attribute("_egress_target_form", "a Request", "addons.layers:TARGET_FORM_ATTR", "addons.layers", "addons.layers",
              "the request-target form the client sent (origin, absolute, authority, asterisk), which "
              "mitmproxy's Request does not keep"),
    Attribute("_egress_raw_authority", "a Request", "addons.layers:RAW_AUTHORITY_ATTR", "addons.layers",
              "addons.layers", "the authority exactly as the client wrote it, before mitmproxy parses it"),
    # per-connection state kept on mitmproxy's ConnectionHandler (and the loop)
    Attribute("_egress_share_key", "ConnectionHandler, fair_share's marks", "addons.fair_share:ATTR",
              "addons.fair_share", "addons.fair_share", "the sandbox a handler's loop time is charged to"),
    Attribute("_egress_spent", "ConnectionHandler (class default), fair_share's marks", "", "addons.fair_share",
              "addons.fair_share", "loop time of the handler not charged yet (also a row of patches.py)"),
    Attribute("_egress_light", "ConnectionHandler (class default), fair_share's marks", "", "addons.fair_share",
              "addons.fair_share", "the sandbox was within its share at its last turn (also a row of patches.py)"),
    Attribute("_egress_small_reads", "ConnectionHandler (class default)", "", "addons.fair_share",
              "addons.fair_share", "its reads were cut to 16 KiB at its last read: the read size's hysteresis"),
    Attribute("_egress_deferred", "the event loop's __dict__", "addons.fair_share:DEFERRED", "addons.fair_share",
              "addons.fair_share", "callbacks set aside, per sandbox in order, put back a few at each poll "
              "(fair_share._SetAside): one connection's order is kept"),
    Attribute("_egress_failed", "ConnectionHandler (class default)", "addons.crash_close:FAILED_ATTR",
              "addons.crash_close", "addons.crash_close", "its handling raised: its sockets were reset and its "
              "later events are dropped (also a row of patches.py)"),
    Attribute("_egress_write_backlog", "ConnectionHandler", "addons.write_backlog:ATTR", "addons.write_backlog",
              "addons.write_backlog", "the ledger account its client's unsent write buffers are charged to"),
    Attribute("_egress_write_backlog_task", "ConnectionHandler", "addons.write_backlog:ATTR + '_task'",
              "addons.write_backlog", "addons.write_backlog", "the task waiting for that backlog to drain"),
    Attribute("_egress_reassembly", "a wsproto connection", "", "addons.websocket_limits", "addons.websocket_limits",
              "the bounded reassembly of the message being read, and its ledger account"),
    # markers on wrapped functions and classes: install once, even when the addons are made again
    Attribute("_egress_closes", "ConnectionHandler.handle_connection (the wrapper)", "", "addons.conn_close",
              "addons.conn_close", "already wrapped"),
    Attribute("_egress_backlog", "ConnectionHandler.server_event (the wrapper)", "", "addons.write_backlog",
              "addons.write_backlog", "already wrapped"),
    Attribute("_egress_tls_memory", "TlsConfig.tls_start_client (the wrapper)", "", "addons.tls_memory",
              "addons.tls_memory", "already wrapped"),
    Attribute("_egress_leaf_key", "CertStore.get_cert (the wrapper)", "", "addons.leaf_keys", "addons.leaf_keys",
              "already wrapped"),
    Attribute("_egress_planned", "AddonManager.trigger_event and Hook.args (the wrappers)", "", "addons.hook_dispatch",
              "addons.hook_dispatch", "already wrapped"),
    Attribute("_egress_hook_plans", "an AddonManager's __dict__", "addons.hook_dispatch:PLANS_ATTR",
              "addons.hook_dispatch", "addons.hook_dispatch", "its plans: the handlers of each event, in chain order"),
    Attribute("_egress_lazy_queue", "Layer.handle_event (the wrapper)", "", "addons.layer_memory",
              "addons.layer_memory", "already wrapped"),
    Attribute("_egress_lazy_waiters", "FlowControlMixin._drain_helper (the wrapper)", "", "addons.stream_memory",
              "addons.stream_memory", "already wrapped"),
    Attribute("_egress_backpressure", "ConnectionHandler.drain_writers (the wrapper)", "", "addons.h2_backpressure",
              "addons.h2_backpressure", "already wrapped"),
    Attribute("_egress_read_ahead", "ConnectionHandler.drain_writers (the wrapper)", "", "addons.read_ahead",
              "addons.read_ahead", "already wrapped"),
    Attribute("_egress_share", "ConnectionHandler.handle_client (the wrapper)", "", "addons.fair_share",
              "addons.fair_share", "already wrapped"),
    Attribute("_egress_originals", "mitmproxy's dumper addon", "", "addons.output_guard", "addons.output_guard",
              "its hooks before the guard wrapped them: a reloaded script wraps the originals, not the wrappers"),
    Attribute("_egress_bounded", "WebsocketLayer (the bounding subclass)", "", "addons.websocket_limits",
              "addons.websocket_limits", "already replaced: a second install only updates the callbacks below"),
    Attribute("_egress_redacting", "WebsocketLayer (the redacting subclass)", "", "addons.websocket_redaction",
              "addons.websocket_redaction", "already replaced: a second install only updates the redactor"),
    # the WebSocket layer subclasses' own members: callbacks into the addons, and per-layer state
    Attribute("_egress_on_refused", "WebsocketLayer (the bounding subclass)", "", "addons.websocket_limits",
              "addons.websocket_limits", "audits and counts a WebSocket refused for size, budget or small frames"),
    Attribute("_egress_taker", "WebsocketLayer (the bounding subclass)", "", "addons.websocket_limits",
              "addons.websocket_limits", "makes the sandbox's small-frame bucket for a flow"),
    Attribute("_egress_account_for", "WebsocketLayer (the bounding subclass)", "", "addons.websocket_limits",
              "addons.websocket_limits", "opens a buffer-ledger account for a reassembly"),
    Attribute("_egress_take", "a WebsocketLayer", "", "addons.websocket_limits", "addons.websocket_limits",
              "the client's small-frame bucket, once known"),
    Attribute("_egress_small", "WebsocketLayer (the bounding subclass)", "", "addons.websocket_limits",
              "addons.websocket_limits", "method: charges a small client frame to the bucket"),
    Attribute("_egress_small_frames", "a WebsocketLayer", "", "addons.websocket_limits", "addons.websocket_limits",
              "small client frames seen, for the audit line of a flood"),
    Attribute("_egress_release", "WebsocketLayer (the bounding subclass)", "", "addons.websocket_limits",
              "addons.websocket_limits", "method: gives what the reassemblies held back to the ledger"),
    Attribute("_egress_get_redactor", "WebsocketLayer (the redacting subclass)", "", "addons.websocket_redaction",
              "addons.websocket_redaction", "the redactor of the current policy, for control frames sent to the client"),
)

_HTTP1 = "the HTTP/1 server and client layers the gateway replaces (framing, limits, empty pieces, trailers)"
PRIVATE_IMPORTS: tuple[PrivateImport, ...] = (
    PrivateImport("mitmproxy.proxy.layers.http._events",
                  "ErrorCode, RequestData, RequestEndOfMessage, RequestHeaders, RequestProtocolError, RequestTrailers, "
                  "ResponseData, ResponseEndOfMessage, ResponseHeaders, ResponseProtocolError, ResponseTrailers",
                  "addons.h2_limits, addons.http1, addons.http1_server, addons.http2_server, addons.http_stream, "
                  "addons.refusals",
                  "the events between mitmproxy's HTTP stream and its connection layers, which the gateway's "
                  "layers make and read (also re-exported by mitmproxy.proxy.layers.http)"),
    PrivateImport("mitmproxy.proxy.layers.http._base", "HttpEvent, ReceiveHttp",
                  "addons.h2_limits, addons.http1, addons.http1_server, addons.http2_server",
                  "the command by which a connection layer hands an event to its stream"),
    PrivateImport("mitmproxy.proxy.layers.http._hooks", "HttpErrorHook", "addons.http_stream",
                  "the error hook the gateway's HTTP stream triggers as mitmproxy's does"),
    PrivateImport("mitmproxy.proxy.layers.http._http1", "Http1Client, Http1Server, make_body_reader, should_make_pipe",
                  "addons.http1, addons.http1_server", _HTTP1),
    PrivateImport("mitmproxy.proxy.layers.http._http2", "CATCH_HYPER_H2_ERRORS, Http2Client, Http2Server, StreamState",
                  "addons.h2_limits, addons.http2_server",
                  "the HTTP/2 server and client layers the gateway replaces (budgets, floods, back-pressure)"),
    PrivateImport("mitmproxy.proxy.layers.http._http_h2", "BufferedH2Connection, SendH2Data", "addons.h2_limits",
                  "the h2 connection mitmproxy buffers sends in (the limited and upstream ones subclass it), "
                  "and its entry of data waiting for a window (CoalescedSends joins into the last)"),
    PrivateImport("mitmproxy.proxy.layers.http._http3", "Http3Server", "addons.layers",
                  "the HTTP/3 server layer, made as mitmproxy's own next-layer step makes it"),
    PrivateImport("h11._receivebuffer", "ReceiveBuffer", "addons.http1, addons.http1_server", _HTTP1),
    PrivateImport("h11._readers", "", "addons.http1",
                  "h11's chunked-body reader, subclassed to count chunks and bound chunk lines"),
)

ADDON_ORDER: tuple[AddonStep, ...] = (
    AddonStep("EgressCore", "addons.core",
              "first: declares the options and forces the safe settings every other addon reads"),
    AddonStep("AuditLogOwner", "addons.audit_log", "opened before any decision can be written"),
    AddonStep("OutputGuard", "addons.output_guard",
              "early: mitmproxy's flow writers are off before any flow exists"),
    AddonStep("PolicyReloader", "addons.reload", "the policy (and its engine) before any connection is judged"),
    AddonStep("ConnectionLimiter", "addons.limits", "a connection over the limits is closed before any guard sees it"),
    AddonStep("BufferBudget", "addons.budget", "the buffer ledger before anything that charges it"),
    AddonStep("WebsocketLimits", "addons.websocket_limits",
              "WebSocket messages: reassembly bounded, relayed ones not kept"),
    AddonStep("ConnectionRate", "addons.rate_limits",
              "after the concurrent-connection limit: a refused connection takes no token"),
    AddonStep("LayerGuard", "addons.layer_guard",
              "chooses each protocol layer (registered as mitmproxy's `nextlayer`), before the guards of those layers"),
    AddonStep("Http2Limits", "addons.h2_limits",
              "the HTTP/2 budgets' options; upstream h2 connections drain their queue in a loop"),
    AddonStep("FrameLimits", "addons.frame_limits",
              "small frames per sandbox (HTTP/2 DATA, HTTP/1 chunks, WebSocket frames and pings)"),
    AddonStep("FairShare", "addons.fair_share",
              "each sandbox's share of the event loop: its reads wait while it is over"),
    AddonStep("ConnectGuard", "addons.connect_guard", "pins the destination at CONNECT, before the TLS guard checks SNI"),
    AddonStep("TlsGuard", "addons.tls_guard", "checks the ClientHello against the pin"),
    AddonStep("Http2Preference", "addons.streaming", "after TlsGuard: a refused or relayed ClientHello is left alone"),
    AddonStep("ReleaseTlsBuffers", "addons.tls_memory",
              "idle TLS connections give their buffers back; wraps TlsConfig, so any place before it"),
    AddonStep("LeafKeys", "addons.leaf_keys",
              "sandboxes' certificates carry a P-256 key of their own (wraps CertStore: any place)"),
    AddonStep("RequestGuard", "addons.request_guard",
              "decides each request (egress_decision, egress_pin): everything after reads its decision"),
    AddonStep("UpgradeGuard", "addons.upgrade_guard", "an upstream's 101 to anything but the WebSocket asked for"),
    AddonStep("DecodePool", "addons.decode_pool", "a compressed request body's check: its decoder calls on the decode pool"),
    AddonStep("ResponseRedactor", "addons.response_redaction",
              "after the guard, whose CredentialInjector marks bound requests (egress_bound): redacts responses, "
              "and plans a bound response's body before BodyStreaming"),
    AddonStep("RequestLimits", "addons.rate_limits",
              "decides in RequestGuard (one audit line); then guards the body before BodyStreaming"),
    AddonStep("BodyStreaming", "addons.streaming",
              "after the guard and the redactor: streams what they allowed and did not plan"),
    AddonStep("DownloadMeter", "addons.rate_limits",
              "after BodyStreaming and the redactor chose how the response travels"),
    AddonStep("UpstreamGuard", "addons.upstream_guard", "after the request decisions: dials only what they allowed"),
    AddonStep("Revoker", "addons.revocation",
              "after the guards: registers WebSockets they allowed; judges again on every install"),
    AddonStep("ControlApi", "addons.control",
              "after the Revoker, whose listener judges open connections again on every registry change; its "
              "running() applies a worker's registry snapshot before any connection is accepted"),
    AddonStep("DnsGuard", "addons.dns_guard", "DNS mode's own hooks; any place after the core"),
    AddonStep("CollectorFreeze", "addons.gc_freeze",
              "once running: full collections skip what start-up made and what survived; thaws after closes or freed buffers"),
    AddonStep("MetricsFeed", "addons.metrics", "late: counts what the guards decided"),
    AddonStep("HealthEndpoint", "addons.health", "serves the metrics and readiness the addons before it feed"),
    AddonStep("Lifecycle", "addons.lifecycle", "last: \"ready\" once every other addon is running"),
)
