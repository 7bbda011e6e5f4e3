"""Every option the gateway adds to mitmproxy, in one table: name, type, default, the addon that
declares it, the `egress-gateway run` flag behind it (if any), and its help.

The addons declare their options from here (addons/options.py `declare`), `run`'s flags take their
defaults from here, and tests/unit/test_options_table.py checks that every row is declared by its
addon and nowhere else, and that docs/options.md lists every row with this default. A default
changed here is changed everywhere it is said.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import h2budget
from .audit import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, MAX_LINE_BYTES
from .auditrate import DEFAULT_PER_KEY, DEFAULT_PER_SOURCE, DEFAULT_TOTAL
from .budget import DEFAULT_PER_CONNECTION, DEFAULT_PER_SANDBOX
from .clienthello import DEFAULT_MAX_CLIENT_HELLO_BYTES
from .decompress import REQUEST_LIMIT
from .fairshare import DEFAULT_BURST, DEFAULT_BUSY, DEFAULT_MAX_SHARE, SPARE_HEADROOM

# Defaults that only the option itself uses (the addons import them from here).
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_HEAD_TIMEOUT = 30
DEFAULT_MAX_HEADER_FIELDS = 256
DEFAULT_BODY_IDLE_TIMEOUT = 120.0
DEFAULT_MAX_IDLE_UPSTREAMS = 8
DEFAULT_CLIENT_HELLO_TIMEOUT = 10
DEFAULT_SMALL_FRAME_BYTES = 4096  # mitmproxy's own WebSocket fragments are 4,000 bytes
DEFAULT_SMALL_FRAMES_PER_SECOND = 5000.0
DEFAULT_SMALL_FRAME_BURST = 20000
DEFAULT_SANDBOX_HIGH_WATER = 16 * 1024 * 1024
DEFAULT_REQUESTS_PER_SECOND = 200.0
DEFAULT_REQUEST_BURST = 400
DEFAULT_CONNECTIONS_PER_SECOND = 50.0
# DNS mode's queries per sandbox: a resolver asks A and AAAA for every name, some names several
# times; a bucket of their own, so that lookups never spend the request bucket's tokens.
DEFAULT_DNS_QUERIES_PER_SECOND = 200.0
DEFAULT_DNS_QUERY_BURST = 400
DEFAULT_CONNECTION_BURST = 100
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: object
    owner: str  # the addons module whose addon declares it
    help: str
    flag: str | None = None  # the `egress-gateway run` flag that sets it


def _table(*options: Option) -> dict[str, Option]:
    return {option.name: option for option in options}


OPTIONS: dict[str, Option] = _table(
    # --- addons.audit_log
    Option('egress_audit_log', str, '', 'addons.audit_log',
           "Where to append audit lines (JSON, one per decision): a path, '-' for stdout, empty for "
           'none.',
           flag='--audit-log'),
    Option('egress_audit_chain', bool, False, 'addons.audit_log',
           "Hash-chain the audit log: every line carries 'prev', the SHA-256 of the previous line.",
           flag='--audit-chain'),
    Option('egress_audit_max_bytes', int, DEFAULT_MAX_BYTES, 'addons.audit_log',
           'Rotate the audit log file before it would exceed this many bytes (0: never; the default is '
           'ignored for stdout, which cannot rotate).',
           flag='--audit-max-bytes'),
    Option('egress_audit_backups', int, DEFAULT_BACKUPS, 'addons.audit_log',
           'Rotated audit log files to keep (PATH.1 ... PATH.N).',
           flag='--audit-backups'),
    Option('egress_audit_max_refusals_per_second_per_sandbox', int, DEFAULT_PER_SOURCE, 'addons.audit_log',
           'Refusal lines written one by one per second per sandbox (or client address without one); the '
           "refusals over it are counted in one 'suppressed' summary line per kind (0: every refusal its "
           'line). Allowed requests always get their own line.'),
    Option('egress_audit_max_refusals_per_second_per_key', int, DEFAULT_PER_KEY, 'addons.audit_log',
           'Of those, refusal lines written one by one per second for one (event, reason, rule, host); '
           '0: no budget of its own per kind.'),
    Option('egress_audit_max_line_bytes', int, MAX_LINE_BYTES, 'addons.audit_log',
           'The longest audit line (bytes, with its chain hash): past it the longest client-controlled '
           "values are shortened and named in 'truncated'. At least 2048."),
    Option('egress_audit_max_refusals_per_second', int, DEFAULT_TOTAL, 'addons.audit_log',
           'Refusal lines written one by one per second by the whole gateway, every sandbox and client '
           'together (cycling client addresses buy no more); the refusals over it are counted in '
           "'suppressed' summary lines too. 0: no gateway-wide budget."),
    # --- addons.budget
    Option('egress_max_buffered_bytes_per_connection', int, DEFAULT_PER_CONNECTION, 'addons.budget',
           'Bytes of bodies one client connection may have buffered at once (request and response '
           'bodies, bound responses decoded for redaction); over it a body streams, or is refused with '
           '503 buffer_budget when it must stay whole. 0: no limit.'),
    Option('egress_max_buffered_bytes_per_sandbox', int, DEFAULT_PER_SANDBOX, 'addons.budget',
           'The same, for all connections of one sandbox (one client address without a sandboxes '
           'section). 0: no limit.'),
    Option('egress_body_idle_timeout', int, int(DEFAULT_BODY_IDLE_TIMEOUT), 'addons.budget',
           'Seconds a request or response body may go without a byte before its stream ends (408 '
           'request_body_timeout / 504 or cut off response_body_timeout). 0: no limit.'),
    Option('egress_max_decoded_request_bytes', int, REQUEST_LIMIT, 'addons.budget',
           'Decoded bytes of a compressed request body the method-override scan reads (all its Content- '
           'Encodings); past them the body cannot be checked: 413 request_too_large. 0: only the 100:1 '
           'ratio bounds it.'),
    # --- addons.core
    Option('egress_policy', str, '', 'addons.core',
           'Path of the egress policy YAML file. Empty: the embedded default policy.',
           flag='--policy'),
    Option('egress_dns_timeout', int, 5, 'addons.core',
           'Seconds to wait for DNS when the gateway resolves a destination.'),
    Option('egress_max_head_bytes', int, DEFAULT_MAX_HEAD_BYTES, 'addons.core',
           'Largest request head accepted, in bytes: an HTTP/1 request line and headers (431 above), an '
           'HTTP/2 header block, encoded or decoded (GOAWAY above; reason request_head_too_large).'),
    Option('egress_max_header_fields', int, DEFAULT_MAX_HEADER_FIELDS, 'addons.core',
           'Most header fields a request head (or HTTP/2 trailer section) may carry; more: 431, reason '
           'too_many_header_fields (0: no limit).'),
    Option('egress_head_timeout', int, DEFAULT_HEAD_TIMEOUT, 'addons.core',
           'Seconds a client may take to send one request head: HTTP/1 (408 after), or an HTTP/2 header '
           'block (GOAWAY after); 0: no limit.'),
    # --- addons.fair_share
    Option('egress_max_loop_share_per_sandbox', str, f'{DEFAULT_MAX_SHARE:g}', 'addons.fair_share',
           "Share of a worker's event loop one sandbox may take while another sandbox is active: at most "
           "this; at least 1/N with N active; between, what the lighter sandboxes leave of the loop less "
           "egress_loop_share_headroom, split between the heavier ones (max-min); over it, its connections' next reads wait (back-pressure, "
           "nothing refused). 0: off."),
    Option('egress_loop_share_burst', str, f'{DEFAULT_BURST:g}', 'addons.fair_share',
           'Seconds of loop time a sandbox may use at once above its share.'),
    Option('egress_loop_share_busy', str, f'{DEFAULT_BUSY:g}', 'addons.fair_share',
           'The loop counts as contended (shares apply) once the work of about the last second fills '
           'this fraction of it; below it nobody is slowed. 0: always contended.'),
    Option('egress_loop_share_headroom', str, f'{SPARE_HEADROOM:g}', 'addons.fair_share',
           "Part of the loop a sandbox over its share may not borrow while the others' work leaves the "
           "loop idle: it refills at its share, or at what the others left less this, whichever is more. "
           "1: its share is a hard cap."),
    # --- addons.frame_limits
    Option('egress_max_small_frames_per_second_per_sandbox', str, f'{DEFAULT_SMALL_FRAMES_PER_SECOND:g}', 'addons.frame_limits',
           'Frames under egress_small_frame_bytes (HTTP/2 DATA frames, HTTP/1 chunks, WebSocket frames '
           'and pings) one sandbox may send per second, sustained; the frame that finds none left ends '
           'its connection (small_frame_flood). 0: no limit.'),
    Option('egress_small_frame_burst_per_sandbox', int, DEFAULT_SMALL_FRAME_BURST, 'addons.frame_limits',
           'Small frames a sandbox may send at once above its per-second rate (token bucket size).'),
    Option('egress_small_frame_bytes', int, DEFAULT_SMALL_FRAME_BYTES, 'addons.frame_limits',
           'Payload size under which a frame, chunk or WebSocket message counts against '
           'egress_max_small_frames_per_second_per_sandbox.'),
    # --- addons.h2_limits
    Option('egress_h2_max_concurrent_streams', int, h2budget.DEFAULT_MAX_CONCURRENT_STREAMS, 'addons.h2_limits',
           'HTTP/2: streams one client connection may have open at once (advertised in SETTINGS; a '
           'stream over it is refused with RST_STREAM REFUSED_STREAM, reason too_many_streams).'),
    Option('egress_h2_max_resets', int, h2budget.DEFAULT_MAX_RESETS, 'addons.h2_limits',
           'HTTP/2: streams reset on one connection (by the client, or refused by the gateway) within '
           'egress_h2_reset_window seconds before it is closed with GOAWAY ENHANCE_YOUR_CALM (reason '
           'reset_flood; 0: no limit).'),
    Option('egress_h2_reset_window', int, int(h2budget.DEFAULT_RESET_WINDOW), 'addons.h2_limits',
           'HTTP/2: the sliding window of egress_h2_max_resets, in seconds.'),
    Option('egress_h2_max_control_frames', int, h2budget.DEFAULT_MAX_CONTROL_FRAMES, 'addons.h2_limits',
           f'HTTP/2: frames that carry no request (PING, SETTINGS, PRIORITY, unknown types, empty DATA, WINDOW_UPDATE beyond two per DATA frame sent) one client connection may send within {h2budget.CONTROL_WINDOW:g} seconds before it is closed with GOAWAY ENHANCE_YOUR_CALM (reason control_frame_flood; 0: no limit).'),
    Option('egress_h2_max_unread_bytes_per_sandbox', int, DEFAULT_SANDBOX_HIGH_WATER, 'addons.h2_limits',
           "HTTP/2: response bytes waiting for the flow-control windows of one sandbox's clients, summed "
           'over its connections; while over it, the upstreams of all its HTTP/2 connections wait (back- '
           'pressure, no refusal) until it is under half (0: per connection only, 4 MiB each).'),
    Option('egress_h2_max_buffered_bytes', int, h2budget.DEFAULT_MAX_BUFFERED_BYTES, 'addons.h2_limits',
           'HTTP/2: request-body bytes one client connection may have buffered in the gateway at once (a '
           'stream that would pass it gets 503, reason buffer_budget; 0: no limit).'),
    # --- addons.health
    Option('egress_metrics', str, '', 'addons.health',
           'Serve /metrics, /healthz and /readyz on HOST:PORT (an IP address); empty: off. The address '
           "is one of the gateway's own listeners, never reachable through the proxy.",
           flag='--metrics'),
    # --- addons.control
    Option('egress_control', str, '', 'addons.control',
           "The control API's listener (docs/control-api.md): unix:PATH (unix alone: "
           '/run/egress/control.sock), or HOST:PORT with a token file; empty: off. One of the '
           "gateway's own listeners, never reachable through the proxy.",
           flag='--control'),
    Option('egress_control_token_file', str, '', 'addons.control',
           'File of NAME:TOKEN lines: the bearer tokens the control API accepts, each naming its '
           'principal (required with HOST:PORT; optional on a unix socket).',
           flag='--control-token-file'),
    Option('egress_control_group', str, '', 'addons.control',
           'Group that may use the control socket (mode 0660); empty: the socket is 0600, the '
           "gateway's user only.",
           flag='--control-group'),
    Option('egress_control_max_sandboxes', int, 200000, 'addons.control',
           'Most sandboxes registered at once (409 sandbox_limit above).',
           flag='--control-max-sandboxes'),
    Option('egress_control_max_grants', int, 32, 'addons.control',
           'Most grants one registered sandbox holds at once (409 grant_limit above).',
           flag='--control-max-grants'),
    Option('egress_control_rate', str, '2000', 'addons.control',
           'Control API requests a second per principal (burst: twice as many); 0: no limit '
           '(429 rate_limited above).',
           flag='--control-rate'),
    # --- addons.layer_guard
    Option('egress_max_client_hello_bytes', int, DEFAULT_MAX_CLIENT_HELLO_BYTES, 'addons.layer_guard',
           'Largest TLS ClientHello accepted, in bytes (its declared handshake length; the connection is '
           'closed above, as client_hello_too_large, before any of it is buffered).'),
    Option('egress_client_hello_timeout', int, DEFAULT_CLIENT_HELLO_TIMEOUT, 'addons.layer_guard',
           'Seconds a client may take to send its whole TLS ClientHello, from its first byte (closed '
           'after, as client_hello_timeout; 0: no limit).'),
    # --- addons.leaf_keys
    Option('egress_leaf_key', str, 'ecdsa-p256', 'addons.leaf_keys',
           "The key of the certificates shown to sandboxes: 'ecdsa-p256', one P-256 key per worker, "
           "issued and signed by the CA (a handshake costs the worker ~0.6 ms less CPU than with the CA's "
           "RSA key); 'ca', mitmproxy's way, the CA's own key (for a client that cannot do ECDSA)."),
    # --- addons.lifecycle
    Option('egress_drain_timeout', float, 10.0, 'addons.lifecycle',
           'On SIGTERM (egress-gateway run), seconds to wait for in-flight requests before exiting.',
           flag='--drain-timeout'),
    # --- addons.limits
    Option('egress_max_connections_per_sandbox', int, 1000, 'addons.limits',
           'Concurrent client connections allowed per sandbox (per client address without a sandboxes '
           'section); 0 for no limit.'),
    Option('egress_max_upstream_connections_per_sandbox', int, 1000, 'addons.limits',
           'Concurrent upstream connections allowed per sandbox (per client address without a sandboxes '
           'section), all its client connections together; over it a request that needs a new one is '
           'refused 503 too_many_connections. 0 for no limit.'),
    Option('egress_max_idle_upstreams_per_connection', int, DEFAULT_MAX_IDLE_UPSTREAMS, 'addons.limits',
           'Idle upstream connections one client connection keeps open for reuse (plain-HTTP requests on '
           'the proxy port may go to many destinations, one upstream connection each); past it the least '
           'recently used idle one is closed. At least 1.'),
    # --- addons.rate_limits
    Option('egress_max_new_connections_per_second_per_sandbox', str, f'{DEFAULT_CONNECTIONS_PER_SECOND:g}', 'addons.rate_limits',
           'New client connections accepted per second per sandbox (per client address without a '
           'sandboxes section), sustained; over it a connection is closed at accept '
           '(connection_rate_limited). 0: no limit.'),
    Option('egress_new_connection_burst_per_sandbox', int, DEFAULT_CONNECTION_BURST, 'addons.rate_limits',
           'New connections a sandbox may open at once above its per-second rate (token bucket size).'),
    Option('egress_max_requests_per_second_per_sandbox', str, f'{DEFAULT_REQUESTS_PER_SECOND:g}', 'addons.rate_limits',
           'Allowed HTTP requests per second per sandbox (per client address without a sandboxes '
           'section), sustained; over it a request is answered 429 rate_limited with Retry-After. 0: no '
           'limit.'),
    Option('egress_request_burst_per_sandbox', int, DEFAULT_REQUEST_BURST, 'addons.rate_limits',
           'Requests a sandbox may send at once above its per-second rate (token bucket size).'),
    Option('egress_max_dns_queries_per_second_per_sandbox', str, f'{DEFAULT_DNS_QUERIES_PER_SECOND:g}',
           'addons.rate_limits',
           'DNS-mode queries per second per sandbox (per client address without a sandboxes section), '
           'sustained; over it a query is answered REFUSED (rate_limited) and its connection closed (a UDP '
           'address and port is then not read until silent for 60 s). 0: no limit.'),
    Option('egress_dns_query_burst_per_sandbox', int, DEFAULT_DNS_QUERY_BURST, 'addons.rate_limits',
           'DNS-mode queries a sandbox may send at once above its per-second rate (token bucket size).'),
    # --- addons.reload
    Option('egress_policy_poll', int, 2, 'addons.reload',
           'Seconds between checks of the policy file for changes (0: only on SIGHUP).'),
    # --- addons.websocket_limits
    Option('egress_max_websocket_message_bytes', int, DEFAULT_MAX_MESSAGE_BYTES, 'addons.websocket_limits',
           'Bytes of one WebSocket message the gateway reassembles; past them both sides are closed with '
           '1009 (websocket_message_too_large). 0: no limit.'),
)
