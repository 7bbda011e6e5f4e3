"""Streaming that agents depend on (issue 12): fixtures of the streaming suite, and the map from
each required behaviour to its tests.

How every test works: origins (tests/streaming/origins.py) are in-process servers on this
session's loopback block (127.X.0.70-.72; TLS from the test PKI). A test registers a route, the
origin sends the response head and then each event only after the test confirmed (`Lockstep.ack`)
that the client received the previous one. A gateway that buffers deadlocks and the test fails on
a bounded wait (STREAMING_TEST_WAIT, default 10 s) naming the missing event ("event 2 never
reached the client ... the gateway buffered the stream"). No sleep synchronises anything; the one
real delay is the 8-second long poll. Each parametrised test runs for an unbound rule (`stream`)
and a credential-bound one (`stream-bound`: `Authorization: Bearer ${secrets.key}`, a 108-char
env secret), and checks at the origin that the credential was (or was not) injected.

1. Unknown-length and streaming-type responses reach the client from the first byte
   - explicit, CONNECT + TLS, HTTP/1.1 and HTTP/2 clients, HTTP/1.1 chunked / read-until-close and
     HTTP/2-without-length origins: test_explicit.py::test_sse_through_a_tunnel
   - explicit, plain http:// absolute-form: test_explicit.py::test_sse_as_plain_http,
     ::test_plain_http_ndjson_with_a_content_length
   - application/x-ndjson: test_explicit.py::test_ndjson_stream
   - text/event-stream (with parameters), x-ndjson, application/grpc, grpc+proto, grpc-web+proto
     even WITH a Content-Length: test_explicit.py::test_streaming_types_stream_even_with_a_content_length
   - many events, concurrent h2 streams, kept-alive HTTP/1.1 reuse: test_explicit.py::
     test_a_long_stream_of_small_events, ::test_two_streams_on_one_http2_connection_interleave,
     ::test_http11_connection_is_reusable_after_a_stream
   - transparent mode (iptables REDIRECT in namespaces): test_transparent.py::test_sse_over_redirected_tls,
     ::test_sse_over_redirected_plain_http
2. Credential-bound streams never truncated, at the byte level (raw socket, chunked framing read
   and checked, 1/5/17-byte writes, writes straddling events, read-until-close origin):
   test_bytes.py::test_bound_chunked_sse_arrives_byte_for_byte, ::test_bound_read_until_close_sse_arrives_byte_for_byte,
   ::test_bound_writes_that_straddle_events, ::test_bound_sse_over_http2_arrives_byte_for_byte;
   transparent: test_transparent.py::test_bound_small_writes_arrive_byte_for_byte
3. An echoed secret (one write, split across two writes around a confirmed event, 1-byte writes)
   is redacted to `[REDACTED]***...` of the same length and the stream goes on:
   test_bytes.py::test_echoed_secret_is_redacted_and_the_stream_goes_on,
   ::test_secret_split_by_chunk_framing_read_until_close;
   transparent: test_transparent.py::test_echoed_secret_split_across_writes_is_redacted
4. HTTP/2 to every client that offers h2, in any ALPN order: test_alpn.py (httpx http2=True gets
   "HTTP/2" and streams; raw offers http/1.1-first, h2-first, h2-only; an http/1.1-only client
   keeps HTTP/1.1); curl --http2 (test_curl.py); transparent: test_transparent.py::test_http11_first_offer_gets_h2
5. Trailers on streamed responses: gRPC grpc-status/grpc-message over HTTP/2 (OK and error):
   test_trailers.py::test_grpc_status_trailers_over_http2; HTTP/1.1 chunked trailers to an h2 client
   and to a raw HTTP/1.1 client (paced, and all at once so the trailer check stands alone):
   test_trailers.py::test_http11_chunked_trailers_to_an_http2_client, ::test_http11_chunked_trailers_to_an_http11_client;
   grpcio trailing metadata: test_grpc.py
6. Request bodies of unknown length stream (piece n+1 sent only after the origin acknowledged
   piece n): HTTP/1.1 chunked through a tunnel and absolute-form, side channel:
   test_uploads.py::test_http11_chunked_upload_streams; HTTP/2 DATA without length to h2 and
   HTTP/1.1 origins: ::test_http2_upload_without_length_streams; acked in band in the streamed
   response (full duplex): ::test_http2_full_duplex_upload_acked_in_band;
   transparent: test_transparent.py::test_upload_of_unknown_length_streams
7. grpcio through the proxy (grpc.http_proxy, TLS trusting the gateway CA), server streaming and
   bidirectional, status, details and trailing metadata, OK and not OK: test_grpc.py
8. WebSocket echo through a tunnel and as a plain upgrade: test_websocket.py
9. Long poll: head held until the test releases the origin (event-driven), then the answer or a
   paced stream: test_longpoll.py::test_long_poll_answered_when_the_origin_is_ready,
   ::test_delayed_head_then_a_stream; one real 8-second silence: ::test_long_poll_with_a_real_eight_second_wait
10. curl --no-buffer -N, --http1.1 and --http2, SSE read line by line from its stdout:
   test_curl.py::test_curl_no_buffer_reads_sse_line_by_line

Gateways: one explicit-mode gateway for the whole suite (`gateway`, session-scoped: a start costs
seconds), and for test_transparent.py a namespace topology built with tests/transparent's helpers
(`sandboxed`; marked netns, skips without root / `ip netns`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from tests.e2e.helpers import extra_static_hosts, shared_gateway
from tests.support.gateway import GatewayProcess

from .origins import GrpcOrigin, Origin, Routes

# -- the secret ------------------------------------------------------------------------------------------

# A model-API-shaped key of 108 characters: longer than one SSE event's text, so every form of it
# (hex is 216 characters) is longer than a whole event.
KEY = "sk-ant-api03-BFUOtGVlsK_FZsI_lMHYpk7mWyH7W58HLD8LXZamAiNdB_DSo6x6yHlOiKLgwdzORaoGh9GxkdqsjJAF17PJHoy3dOux4AA"
assert len(KEY) == 108
KEY_ENV = "EGRESS_STREAMING_KEY"
REDACTED = (b"[REDACTED]" + b"*" * (len(KEY) - len(b"[REDACTED]")))  # what the client must see instead

# -- names and addresses ---------------------------------------------------------------------------------

# In the session's 127.X.0.0/24 block (tests/conftest.py): .70-.79 belong to this suite (.40-.45 are
# tests/credentials/bound.py's, for test_placeholder_positions, test_foreign_credentials, redteam).
OCTETS = {"h2": 70, "h1": 71, "grpc": 72}
# "h2" origins speak h2 and HTTP/1.1 (by ALPN), "h1" origins HTTP/1.1 only (TLS on 443, plain on 80),
# "grpc" is a grpcio server. Each has an unbound name and a credential-bound one.
NAMES = {
    ("h2", "unbound"): "h2.stream.test", ("h2", "bound"): "h2.bound.test",
    ("h1", "unbound"): "h1.stream.test", ("h1", "bound"): "h1.bound.test",
    ("grpc", "unbound"): "grpc.stream.test", ("grpc", "bound"): "grpc.bound.test",
}
RULE_KINDS = ("unbound", "bound")

RULES = f"""
- id: stream
  hosts: [{NAMES['h2', 'unbound']}, {NAMES['h1', 'unbound']}, {NAMES['grpc', 'unbound']}]
  schemes: [https, http]
- id: stream-bound
  hosts: [{NAMES['h2', 'bound']}, {NAMES['h1', 'bound']}, {NAMES['grpc', 'bound']}]
  schemes: [https, http]
  allow_plaintext_credentials: true
  inject:
    - header: Authorization
      value: "Bearer ${{secrets.key}}"
"""
SECRETS_SECTION = f"secrets:\n  key: {{env: {KEY_ENV}}}\n"


def name(origin: str, rule: str) -> str:
    return NAMES[origin, rule]


def check_origin_saw(exchange_or_metadata, rule: str) -> None:
    """A bound request carried the injected credential; an unbound one carried none."""
    if isinstance(exchange_or_metadata, list):
        values = [v for k, v in exchange_or_metadata if k.lower() == "authorization"]
    else:
        values = exchange_or_metadata.header_all("authorization")
    if rule == "bound":
        assert values == [f"Bearer {KEY}"], f"the origin got Authorization {values!r}, not the injected key"
    else:
        assert values == [], f"an unbound request reached the origin with Authorization {values!r}"


# -- events shaped like a model API's stream -------------------------------------------------------------


def model_event(n: int, text: str | None = None) -> bytes:
    """`data: {"type":"content_block_delta",...}` + blank line, about 140 bytes."""
    text = text if text is not None else f"chunk {n:03d} of the streamed answer, sent when ready"
    data = json.dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
                      separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def model_events(count: int = 4) -> list[bytes]:
    return [model_event(n) for n in range(1, count + 1)]


def ndjson_events(count: int = 4) -> list[bytes]:
    return [json.dumps({"model": "m", "created_at": n, "response": f"piece {n}", "done": False}).encode() + b"\n"
            for n in range(1, count + 1)]


# -- origins ---------------------------------------------------------------------------------------------


@dataclass
class Origins:
    routes: Routes
    servers: dict[str, Origin] = field(default_factory=dict)
    grpc: GrpcOrigin | None = None

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        if self.grpc is not None:
            self.grpc.stop()


def start_origins(pki, addresses: dict[str, str], routes: Routes, inside=None, grpc: bool = True,
                  stem: str = "streaming") -> Origins:
    """h2 (h2 + HTTP/1.1, TLS :443), h1 (HTTP/1.1 only: TLS :443 and plain :80) and a grpcio server."""
    origins = Origins(routes)
    try:
        for kind in ("h2", "h1"):
            names = [name(kind, rule) for rule in RULE_KINDS]
            cert, key = pki.issue(names, [addresses[kind]], stem=f"{stem}-{kind}")
            alpn = ("h2", "http/1.1") if kind == "h2" else ("http/1.1",)
            origins.servers[kind] = Origin(kind, addresses[kind], 443, routes, cert, key, alpn, inside=inside)
        origins.servers["plain"] = Origin("plain", addresses["h1"], 80, routes, inside=inside)
        if grpc and _have_grpcio():
            names = [name("grpc", rule) for rule in RULE_KINDS]
            cert, key = pki.issue(names, [addresses["grpc"]], stem=f"{stem}-grpc")
            origins.grpc = GrpcOrigin(addresses["grpc"], 443, cert, key, inside=inside)
    except BaseException:
        origins.stop()
        raise
    return origins


def _have_grpcio() -> bool:
    try:
        import grpc  # noqa: F401  (a test extra: tests/streaming/test_grpc.py skips without it)
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def routes() -> Routes:
    return Routes()


@pytest.fixture(scope="session")
def origins(pki, upstreams, routes) -> Origins:
    addresses = {kind: f"{upstreams.block}.{octet}" for kind, octet in OCTETS.items()}
    started = start_origins(pki, addresses, routes)
    yield started
    started.stop()


@pytest.fixture(autouse=True)
def _release_origins(routes):
    """After every test, origin threads still waiting on a Lockstep give up (and drop the stream)."""
    yield
    routes.close_all()


# -- the explicit-mode gateway ---------------------------------------------------------------------------


def _static_hosts(addresses: dict[str, str]) -> dict[str, str]:
    return {n: addresses[kind] for (kind, _rule), n in NAMES.items()}


@pytest.fixture(scope="session")
def gateway(tmp_path_factory, upstreams, pki, origins) -> GatewayProcess:
    """One explicit-mode gateway for the whole suite (a process start costs seconds); it reads the
    env secret at start-up, the tests' own environment stays clean."""
    addresses = {kind: f"{upstreams.block}.{octet}" for kind, octet in OCTETS.items()}
    extra = extra_static_hosts(_static_hosts(addresses)) + SECRETS_SECTION
    patch = pytest.MonkeyPatch()
    try:
        patch.setenv(KEY_ENV, KEY)
        process = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name="streaming")
    finally:
        patch.undo()
    yield process
    process.stop()


# -- transparent mode: a closed namespace network (tests/transparent's topology) -----------------------

# Inside the test namespaces only (no route off the machine): the benchmarking range, exempted from
# the deny list by the policy.
T_ADDRESSES = {"h2": "198.18.0.40", "h1": "198.18.0.41", "grpc": "198.18.0.42"}
T_PROXY_PORT, T_DNS_PORT, T_REGULAR_PORT = 18091, 15363, 18191


@dataclass
class Sandboxed:
    topology: object
    sandbox: object
    gateway: GatewayProcess
    origins: Origins

    def connect(self, kind: str, port: int):
        """A TCP connection from inside the sandbox to the origin's address (redirected to the gateway)."""
        return self.topology.connect(self.sandbox, T_ADDRESSES[kind], port, timeout=10)

    def tls(self, kind: str, host: str, alpn: list[str]):
        from .clients import tls_context

        return tls_context(self.gateway.ca_cert, alpn).wrap_socket(self.connect(kind, 443), server_hostname=host)


def transparent_policy() -> str:
    hosts = "\n".join(f'    {n}: ["{T_ADDRESSES[kind]}"]' for (kind, _r), n in NAMES.items())
    rules = "\n".join("  " + line for line in RULES.strip().splitlines())
    return (f"version: 1\nnetwork:\n  allow_ip_ranges: [198.18.0.0/24]\nresolver:\n  static_hosts:\n{hosts}\n"
            f"{SECRETS_SECTION}rules:\n{rules}\n")


@pytest.fixture(scope="session")
def sandboxed(pki, routes) -> Sandboxed:
    """A sandbox namespace whose TCP 80/443 is redirected (docker/sandbox-net.sh) to a transparent
    gateway in the gateway namespace, and the origins in the internet namespace."""
    from tests.support.namespaced import built_topology, start_gateways, transparent_gateway

    with built_topology("egress-streaming-", pki) as (topology, root):
        gateway = None
        started: Origins | None = None
        try:
            for address in T_ADDRESSES.values():
                topology.add_address(address)
            started = start_origins(pki, T_ADDRESSES, routes, inside=lambda: topology.inside(topology.inet),
                                    grpc=False, stem="streaming-netns")
            sandbox = topology.add_sandbox("stream", 1, T_PROXY_PORT, T_DNS_PORT, "80 443")
            gateway = transparent_gateway(topology, root / "gw", transparent_policy(), T_REGULAR_PORT, T_PROXY_PORT,
                                          T_DNS_PORT)
            patch = pytest.MonkeyPatch()
            try:
                patch.setenv(KEY_ENV, KEY)
                start_gateways(topology, [gateway], [sandbox])
            finally:
                patch.undo()
            yield Sandboxed(topology, sandbox, gateway, started)
        finally:
            if gateway is not None:
                gateway.stop()
            if started is not None:
                started.stop()

