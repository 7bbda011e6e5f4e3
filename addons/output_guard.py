"""Every way mitmproxy itself can write a flow somewhere: off, capped or redacted.

An injected credential lives in the flow (the request's headers, its query), so whatever prints,
saves, exports or replays flows would carry it out of the gateway, past the log filter (which
only sees `logging` records). Each such path in mitmproxy 12.3, and what this addon does with it:

- the flow printer (`dumper`, mitmdump's stdout): it is handed a *view* of each flow in which
  every form of every secret is redacted (URL, header names and values, trailers, status line,
  error, WebSocket close reason) and it writes through a redacting stream as well; `flow_detail`
  is capped at 2, because levels 3 and 4 print bodies through content views (hex dumps,
  gRPC message decompression) that turn a secret into forms no redactor recognises;
- `save_stream_file` (`-w`) and `hardump` write whole flows to disk: forced off;
- `rfile` (`-r`, also stdin) and `client_replay` run stored flows through the gateway's hooks as if
  the sandbox had sent them (credentials injected into them, then printed or saved), and
  `server_replay` answers from a file instead of the pinned upstream: forced off;
- `stickyauth` copies an Authorization header (an injected one too) onto later requests that the
  rule does not bind: forced off;
- `proxy_debug` logs raw protocol data (HTTP/2 header blocks HPACK-compressed, bytes reprs), and
  `termlog_verbosity=debug` prints library debug lines quoting protocol data: neither is in a form
  the log filter can recognise, so `proxy_debug` is forced off and the terminal log capped at info;
- `SSLKEYLOGFILE` / `MITMPROXY_SSLKEYLOGFILE` make mitmproxy write TLS session keys, which decrypt
  a capture of the upstream connection and the credential in it: ignored (with a warning);
- mitmproxy's interactive UIs (`mitmproxy`, `mitmweb`) show, edit, export and replay every flow:
  the egress addons refuse to run there (start-up fails; any flow that still arrives is killed).
  `export`, `cut` and `save.file`/`save.har` are commands, reachable only from those UIs.

`egress-gateway run` loads none of the flow writers (addons/runner.py), so there only the logging
options, the key log and the guard itself apply; both modes get this addon from addons/egress.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mitmproxy import ctx, exceptions, http
from mitmproxy import flow as mflow
from mitmproxy.websocket import WebSocketData, WebSocketMessage

logger = logging.getLogger("egress")

MAX_FLOW_DETAIL = 2

# option -> (value it is forced to, why)
FORCED_OFF: dict[str, tuple[object, str]] = {
    "save_stream_file": (None, "it writes whole flows, injected credentials included, to disk"),
    "hardump": ("", "it writes whole flows, injected credentials included, to a HAR file"),
    "rfile": (None, "flows read from a file would pass the gateway's hooks as if a sandbox sent them "
              "(credentials injected into them)"),
    "client_replay": ([], "replayed requests would get credentials the sandbox never asked for"),
    "server_replay": ([], "answers would come from a file instead of the pinned upstream"),
    "stickyauth": (None, "it copies Authorization headers, injected ones too, onto requests the rule does not bind"),
    "proxy_debug": (False, "it logs raw protocol data (HPACK-compressed headers) the log filter cannot redact"),
}
DUMPER_HOOKS = ("response", "error", "http_connect_error", "websocket_message", "websocket_end",
                "tcp_message", "tcp_error", "udp_message", "udp_error", "dns_response")
INTERACTIVE_MASTERS = ("ConsoleMaster", "WebMaster")


class OutputGuard:
    def __init__(self, get_redactor: Callable[[], object | None]):
        self.get_redactor = get_redactor
        self.refused: str | None = None
        self._configuring = False
        self._first = True

    def configure(self, updated: set[str]) -> None:
        if self._configuring:
            return
        self._configuring = True
        try:
            if self._first:
                self._first = False
                updated = set(ctx.options.keys())
                self._refuse_interactive()
                _disable_key_log()
                self._wrap_dumper()
            self._force(updated)
        finally:
            self._configuring = False

    def _refuse_interactive(self) -> None:
        master = type(ctx.master).__name__
        if master in INTERACTIVE_MASTERS or ctx.master.addons.get("view") is not None:
            self.refused = (f"the egress addons do not run in mitmproxy's interactive UI ({master}): it shows, "
                            "exports and replays every flow, injected credentials included; use mitmdump "
                            "-s addons/egress.py or egress-gateway run")
            raise exceptions.OptionsError(self.refused)

    def _force(self, updated: set[str]) -> None:
        changes: dict[str, object] = {}
        for name, (value, why) in FORCED_OFF.items():
            if not hasattr(ctx.options, name):
                continue
            current = getattr(ctx.options, name)
            if (list(current) if isinstance(value, list) else current) != value:
                logger.warning("egress gateway: ignoring %s=%r: %s", name, current, why)
                changes[name] = value
        if getattr(ctx.options, "flow_detail", 0) > MAX_FLOW_DETAIL:
            logger.warning("egress gateway: flow_detail=%d lowered to %d: higher levels print bodies through "
                           "content views whose output no redactor recognises", ctx.options.flow_detail,
                           MAX_FLOW_DETAIL)
            changes["flow_detail"] = MAX_FLOW_DETAIL
        if getattr(ctx.options, "termlog_verbosity", None) == "debug":
            logger.warning("egress gateway: termlog_verbosity=debug lowered to info: debug lines quote raw "
                           "protocol data in forms the log filter cannot redact")
            changes["termlog_verbosity"] = "info"
        if changes:
            ctx.options.update(**changes)

    def _wrap_dumper(self) -> None:
        dumper = ctx.master.addons.get("dumper")
        if dumper is None:
            return
        originals = getattr(dumper, "_egress_originals", None)
        if originals is None:  # the first guard to see it (a reloaded script wraps the originals again)
            originals = {name: getattr(dumper, name) for name in DUMPER_HOOKS if hasattr(dumper, name)}
            dumper._egress_originals = originals
            dumper.outfp = RedactingWriter(dumper.outfp, self.get_redactor)
        else:
            dumper.outfp.get_redactor = self.get_redactor
        for name, hook in originals.items():
            setattr(dumper, name, self._relay(hook))

    def _relay(self, hook):
        def relay(f):
            try:
                shown = redacted_view(f, self.get_redactor())
            except Exception:
                logger.warning("egress gateway: a flow could not be redacted for printing; not printed", exc_info=True)
                return
            return hook(shown)

        return relay

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.refused is not None:
            flow.kill()


def _disable_key_log() -> None:
    from mitmproxy.net import tls

    if tls.log_master_secret is None:
        return
    logger.warning("egress gateway: ignoring SSLKEYLOGFILE/MITMPROXY_SSLKEYLOGFILE (%s): TLS session keys "
                   "decrypt the upstream connections and the credentials in them",
                   getattr(tls.log_master_secret, "filename", "?"))
    tls.log_master_secret = None
    tls.create_proxy_server_context.cache_clear()
    tls.create_client_proxy_context.cache_clear()


class RedactingWriter:
    """A text stream that redacts every form of every secret from what is written to it."""

    def __init__(self, stream, get_redactor: Callable[[], object | None]):
        self.stream = stream
        self.get_redactor = get_redactor

    def write(self, text: str) -> int:
        redactor = self.get_redactor()
        if redactor is not None and text:
            text = redactor.redact_text(text)[0]
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _bytes(redactor, data: bytes | None) -> bytes | None:
    return redactor.redact(data)[0] if data else data


def _text(redactor, text: str | None) -> str | None:
    return redactor.redact_text(text)[0] if text else text


_PROXY_CREDENTIAL = b"proxy-authorization"  # addressed to the gateway: never printed, whoever holds it


class _NoSecrets:
    """The redactor when the gateway holds no secret: only the proxy credential is masked."""

    def redact(self, data: bytes):
        return data, 0

    def redact_text(self, text: str):
        return text, 0


def _carries_proxy_credential(f) -> bool:
    return f.request is not None and _PROXY_CREDENTIAL.decode() in f.request.headers


def _fields(redactor, headers: http.Headers | None) -> http.Headers | None:
    if headers is None:
        return None
    return http.Headers([(_bytes(redactor, k), b"[REDACTED]" if k.lower() == _PROXY_CREDENTIAL else _bytes(redactor, v))
                         for k, v in headers.fields])


def _message(redactor, message):
    if message is None:
        return None
    copy = message.copy()
    copy.data.headers = _fields(redactor, message.headers)
    copy.data.trailers = _fields(redactor, message.trailers)
    if isinstance(copy, http.Request):
        copy.data.path = _bytes(redactor, copy.data.path)
        copy.data.authority = _bytes(redactor, copy.data.authority)
        copy.data.host = _text(redactor, copy.data.host)
    else:
        copy.data.reason = _bytes(redactor, copy.data.reason)
    return copy


def redacted_view(f: mflow.Flow, redactor) -> mflow.Flow:
    """What the flow printer is shown of `f`: a copy with every form of every secret redacted from
    everything it prints at flow_detail <= 2 (bodies are not among them), and any Proxy-Authorization
    value masked (a proxy token the request guard has not removed yet). Other flow types (DNS,
    the TCP flows of passthrough tunnels) never hold an injected credential and are shown as they are."""
    if not isinstance(f, http.HTTPFlow):
        return f
    if redactor is None:
        if not _carries_proxy_credential(f):
            return f
        redactor = _NoSecrets()
    view = http.HTTPFlow(f.client_conn, f.server_conn)
    view.id, view.is_replay, view.marked = f.id, f.is_replay, f.marked
    view.metadata = {k: v for k, v in f.metadata.items() if k == "h2-pushed-stream"}
    view.request = _message(redactor, f.request)
    view.response = _message(redactor, f.response)
    if f.error is not None:
        view.error = mflow.Error(_text(redactor, f.error.msg) or "", f.error.timestamp)
    if f.websocket is not None:
        ws = WebSocketData(closed_by_client=f.websocket.closed_by_client, close_code=f.websocket.close_code,
                           close_reason=_text(redactor, f.websocket.close_reason))
        ws.messages = [WebSocketMessage(m.type, m.from_client, _bytes(redactor, m.content) or b"", m.timestamp)
                       for m in f.websocket.messages[-1:]]
        view.websocket = ws
    return view
