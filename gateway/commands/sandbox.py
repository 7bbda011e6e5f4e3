"""`egress-gateway sandbox register|deregister|list|get|grant|revoke|grants|explain`: the control API
from a shell (docs/control-api.md). A thin client: every check is the gateway's; this prints its
JSON answer (`explain`: as `egress-gateway explain` prints one, or the JSON with --json) and exits 0
on success, 1 on a refusal (the reason is in the JSON), 2 when the gateway cannot be reached."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
from urllib.parse import quote, urlencode

from ..control import DEFAULT_SOCKET
from ..explain import render_dict
from . import EXIT_FAILED, EXIT_INVALID, EXIT_OK

CONTROL_ENV = "EGRESS_CONTROL"  # default for --control
TOKEN_ENV = "EGRESS_CONTROL_TOKEN"  # a bearer token (never a flag: it would show in ps)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


class ControlClient:
    """One keep-alive connection to the control API. `call` returns (status, JSON body)."""

    def __init__(self, spec: str = f"unix:{DEFAULT_SOCKET}", token: str | None = None, timeout: float = 30.0):
        self.spec, self.token, self.timeout = spec, token, timeout
        self.conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self.spec.startswith("unix:") or self.spec == "unix":
            path = self.spec[5:] or DEFAULT_SOCKET
            return _UnixConnection(path, self.timeout)
        host, _, port = self.spec.rpartition(":")
        return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=self.timeout)

    def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None) -> tuple[int, dict]:
        if query:
            path += "?" + urlencode(query, doseq=True)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (1, 2):  # a kept-alive connection the server closed: once more on a new one
            if self.conn is None:
                self.conn = self._connect()
            try:
                self.conn.request(method, path, body=data, headers=headers)
                response = self.conn.getresponse()
                text = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt == 2:
                    raise
        try:
            return response.status, json.loads(text or b"{}")
        except ValueError:
            return response.status, {"error": "not_json", "message": text[:200].decode(errors="replace")}

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # the API, by name
    def register(self, sandbox: str, source_ips: list[str], profile: str, ttl_seconds: float | None = None,
                 labels: dict | None = None) -> tuple[int, dict]:
        body: dict = {"id": sandbox, "source_ips": source_ips, "profile": profile}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        if labels:
            body["labels"] = labels
        return self.call("POST", "/v1/sandboxes", body)

    def deregister(self, sandbox: str) -> tuple[int, dict]:
        return self.call("DELETE", f"/v1/sandboxes/{quote(sandbox, safe='')}")

    def grant(self, sandbox: str, spec: dict) -> tuple[int, dict]:
        return self.call("POST", f"/v1/sandboxes/{quote(sandbox, safe='')}/grants", spec)

    def revoke(self, sandbox: str, grant: str) -> tuple[int, dict]:
        return self.call("DELETE", f"/v1/sandboxes/{quote(sandbox, safe='')}/grants/{quote(grant, safe='')}")

    def explain(self, sandbox: str, url: str, method: str = "GET", headers: list[str] = ()) -> tuple[int, dict]:
        """How the gateway decides `url` for the registered sandbox now (its grants included)."""
        query: dict = {"url": url, "method": method}
        if headers:
            query["header"] = list(headers)
        return self.call("GET", f"/v1/sandboxes/{quote(sandbox, safe='')}/explain", query=query)


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: labels are KEY=VALUE")
        out[key] = value
    return out


def register(sub) -> None:
    sandbox = sub.add_parser(
        "sandbox", help="register sandboxes and grants on a running gateway (control API)",
        description="Talk to a running gateway's control API (docs/control-api.md). The token, if the API needs "
                    f"one, is read from ${TOKEN_ENV} (never a flag: it would show in ps).")
    sandbox.add_argument("--control", metavar="unix:PATH|HOST:PORT",
                         default=os.environ.get(CONTROL_ENV, f"unix:{DEFAULT_SOCKET}"),
                         help=f"where the control API listens (default: ${CONTROL_ENV}, else unix:{DEFAULT_SOCKET})")
    actions = sandbox.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    reg = actions.add_parser("register", help="register (or update) a sandbox")
    reg.add_argument("id")
    reg.add_argument("--source-ip", dest="source_ips", action="append", default=[], metavar="IP",
                     help="an address of the sandbox (repeatable; none: a sandbox named by its proxy token's sub)")
    reg.add_argument("--profile", required=True, help="the policy's sandboxes: entry whose rules and limits apply")
    reg.add_argument("--ttl", type=float, default=None, metavar="SECONDS", help="default 86400")
    reg.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    dereg = actions.add_parser("deregister", help="deregister a sandbox (its open connections are judged again)")
    dereg.add_argument("id")
    listing = actions.add_parser("list", help="registered sandboxes, a page at a time")
    listing.add_argument("--profile")
    listing.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    listing.add_argument("--after", metavar="ID", help="the cursor a previous page returned as next")
    listing.add_argument("--limit", type=int, default=None)
    get = actions.add_parser("get", help="one sandbox and its grants")
    get.add_argument("id")
    grant = actions.add_parser("grant", help="grant a rule, or hosts, to a registered sandbox")
    grant.add_argument("id")
    what = grant.add_mutually_exclusive_group(required=True)
    what.add_argument("--rule", help="a rule of the profile's grantable.rules")
    what.add_argument("--host", dest="hosts", action="append", metavar="PATTERN",
                      help="a host pattern within grantable.hosts (repeatable)")
    grant.add_argument("--port", dest="ports", action="append", type=int, metavar="PORT")
    grant.add_argument("--scheme", dest="schemes", action="append", choices=("http", "https"))
    grant.add_argument("--method", dest="methods", action="append", metavar="METHOD")
    grant.add_argument("--path", dest="paths", action="append", metavar="GLOB")
    grant.add_argument("--ttl", type=float, default=None, metavar="SECONDS", help="default: the profile's max_ttl")
    revoke = actions.add_parser("revoke", help="remove a grant (its open connections are judged again)")
    revoke.add_argument("id")
    revoke.add_argument("grant")
    grants = actions.add_parser("grants", help="a sandbox's grants")
    grants.add_argument("id")
    why = actions.add_parser("explain", help="how the gateway decides a request of a registered sandbox now",
                             description="The decision for one request (https://host/path, http://..., "
                                         "tcp://IP:PORT) under the sandbox's live rules, its grants included, as "
                                         "`egress-gateway explain` shows one. Names are not looked up: addresses "
                                         "come from static_hosts, else they are not checked.")
    why.add_argument("id")
    why.add_argument("url", metavar="URL")
    why.add_argument("-X", "--method", default="GET", type=str.upper,
                     help="request method (default GET; any case here, sent upper-case: the API explains a "
                          "method as live traffic sends it, and refuses a lower-case one as the gateway does)")
    why.add_argument("-H", "--header", dest="headers", action="append", default=[], metavar="'NAME: VALUE'",
                     help="a request header field (repeatable): method overrides in headers are judged too")
    why.add_argument("--json", action="store_true", help="print the JSON answer")
    sandbox.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    client = ControlClient(args.control, os.environ.get(TOKEN_ENV) or None)
    command = args.sandbox_command
    quoted = quote(getattr(args, "id", "") or "", safe="")
    try:
        if command == "register":
            status, body = client.register(args.id, args.source_ips, args.profile, args.ttl, _labels(args.label))
        elif command == "deregister":
            status, body = client.deregister(args.id)
        elif command == "list":
            query: dict = {"label": args.label} if args.label else {}
            for key in ("profile", "after", "limit"):
                if getattr(args, key) is not None:
                    query[key] = getattr(args, key)
            status, body = client.call("GET", "/v1/sandboxes", query=query)
        elif command == "get":
            status, body = client.call("GET", f"/v1/sandboxes/{quoted}")
        elif command == "grants":
            status, body = client.call("GET", f"/v1/sandboxes/{quoted}/grants")
        elif command == "explain":
            status, body = client.explain(args.id, args.url, args.method, args.headers)
        elif command == "grant":
            spec: dict = {"rule": args.rule} if args.rule else {"hosts": args.hosts}
            for key in ("ports", "schemes", "methods", "paths"):
                if getattr(args, key):
                    spec[key] = getattr(args, key)
            if args.ttl is not None:
                spec["ttl_seconds"] = args.ttl
            status, body = client.grant(args.id, spec)
        else:
            status, body = client.revoke(args.id, args.grant)
    except (OSError, http.client.HTTPException) as exc:
        print(f"egress-gateway: cannot reach the control API at {args.control}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        client.close()
    if command == "explain" and status == 200 and not args.json:
        sys.stdout.write(render_dict(body))
    else:
        print(json.dumps(body, indent=2))
    return EXIT_OK if 200 <= status < 300 else EXIT_FAILED
