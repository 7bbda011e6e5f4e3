"""The control API end to end (issue 17): a real gateway with `--control`, real clients through it.

Registering a sandbox makes its address that sandbox; a grant widens it, inside the envelope, for
its TTL; deregistering, a TTL running out or removing a grant closes every open connection that
depended on it, each with an audit line. The control listener itself is never reachable through
the proxy. Every wait is on an event (an audit line, a close at the client), never a sleep.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml

from bench.lib.tokens import claims, new_signer, write_jwks
from gateway.commands.sandbox import ControlClient
from gateway.control import ROUTES
from tests.e2e.helpers import Conn, connect_proxy, get, start_tls, tls_tunnel, tunnel
from tests.e2e.test_revocation import assert_websocket_closed, client_of, line_of, open_tunnel, open_websocket
from tests.support.gateway import free_port
from tests.support.revocation import BASE_RULES, WAIT, origins, reloadable  # noqa: F401

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

SANDBOXES = """
sandboxes:
  - id: default
    rules: []
  - id: agent
    rules: [kept]
    grantable:
      rules: [gone, ws]
      hosts: ["*.test"]
      max_ttl: 1h
  - id: locked
    rules: [kept]
"""


@pytest.fixture
def controlled(reloadable, tmp_path):  # noqa: F811
    """controlled(args=[]) -> (ReloadableGateway, ControlClient) with a control socket."""
    clients: list[ControlClient] = []

    def start(args: list[str] | None = None, rules: str = BASE_RULES, sandboxes: str = SANDBOXES):
        path = tmp_path / f"control{len(clients)}.sock"
        extra = args if args is not None else ["--control", f"unix:{path}"]
        gw = reloadable(rules, sandboxes, args=extra)
        client = ControlClient(f"unix:{path}") if args is None else None
        if client is not None:
            clients.append(client)
        return gw, client

    yield start
    for client in clients:
        client.close()


def refused(gw, host: str) -> tuple[int, str | None]:
    conn, answer = tunnel(gw.process, f"{host}:443", timeout=WAIT)
    conn.close()
    return answer.status, answer.egress_reason


def control_lines(gw, **match) -> list[dict]:
    return gw.lines(event="control", **match)


# --- registrations ---------------------------------------------------------------------------------


def test_a_registered_address_is_its_sandbox_until_deregistered_and_its_open_tunnel_is_closed(controlled, origins):  # noqa: F811
    gw, api = controlled()
    assert refused(gw, "kept.test") == (403, "no_rule")  # the static table: default has no rule
    status, body = api.register("task-1", ["127.0.0.1"], "agent", ttl_seconds=600, labels={"team": "a"})
    assert status == 201 and body["profile"] == "agent" and body["workers"] == 1, body
    kept = open_tunnel(gw, "kept.test")  # the profile's rule
    line = gw.lines(event="request", host="kept.test", decision="allow")[-1]
    assert line["sandbox"] == "task-1" and line["rule"] == "kept"
    registered = control_lines(gw, action="register")[-1]
    assert (registered["decision"], registered["reason"], registered["principal"], registered["source_ips"]) == (
        "allow", "registered", f"uid:{os.getuid()}", ["127.0.0.1"])
    # re-registering the same id updates it; another id cannot take its address
    assert api.register("task-1", ["127.0.0.1"], "agent", ttl_seconds=900)[0] == 200
    status, body = api.register("task-2", ["127.0.0.1"], "agent")
    assert (status, body["error"]) == (409, "address_in_use")
    status, body = api.deregister("task-1")
    assert status == 200 and body["deregistered"] == "task-1"
    revoked = line_of(gw.revoked(kind="tunnel"), kept.client)
    assert (revoked["rule"], revoked["cause"], revoked["sandbox"]) == ("kept", "no_rule", "default")
    assert "deregistration of sandbox task-1" in revoked["message"]
    assert kept.closed(WAIT)
    assert refused(gw, "kept.test") == (403, "no_rule")
    assert api.deregister("task-1")[1]["error"] == "unknown_sandbox"


def test_registrations_are_validated_bounded_and_listed(controlled, origins):  # noqa: F811
    gw, api = controlled()
    for body, reason in [
        ({"id": "x", "source_ips": ["10.0.0.0/8"], "profile": "agent"}, "bad_registration"),
        ({"id": "x", "source_ips": ["10.0.0.1"], "profile": "nope"}, "unknown_profile"),
        ({"id": "agent", "source_ips": ["10.0.0.1"], "profile": "agent"}, "id_reserved"),
        ({"id": "x y", "source_ips": ["10.0.0.1"], "profile": "agent"}, "bad_registration"),
        ({"id": "x", "source_ips": ["10.0.0.1"], "profile": "agent", "ttl_seconds": -1}, "bad_registration"),
        ({"id": "x", "source_ips": ["10.0.0.1"], "profile": "agent", "extra": 1}, "bad_registration"),
    ]:
        status, answer = api.call("POST", "/v1/sandboxes", body)
        assert answer["error"] == reason and status in (409, 422), (body, answer)
    assert api.call("POST", "/v1/sandboxes", None)[1]["error"] in ("bad_registration", "bad_json")
    status, answer = api.call("GET", "/v1/nothing")
    assert (status, answer["error"]) == (404, "not_found")
    for i in range(5):
        assert api.register(f"s{i}", [f"10.7.0.{i + 1}"], "agent" if i % 2 else "locked",
                            labels={"n": str(i)})[0] == 201
    status, page = api.call("GET", "/v1/sandboxes", query={"limit": 2})
    assert [s["id"] for s in page["sandboxes"]] == ["s0", "s1"] and page["next"] == "s1"
    status, page = api.call("GET", "/v1/sandboxes", query={"profile": "agent"})
    assert [s["id"] for s in page["sandboxes"]] == ["s1", "s3"]
    status, page = api.call("GET", "/v1/sandboxes", query={"label": "n=4"})
    assert [s["id"] for s in page["sandboxes"]] == ["s4"]
    assert api.call("GET", "/v1/sandboxes", query={"limit": 100000})[0] == 400
    refusals = control_lines(gw, decision="deny", action="register")
    assert len(refusals) == 7 and all(r["status"] in (400, 409, 422) for r in refusals)


# --- grants ------------------------------------------------------------------------------------------


def test_a_grant_allows_for_its_ttl_then_its_timer_ends_it_and_closes_what_it_allowed(controlled, origins):  # noqa: F811
    gw, api = controlled()
    api.register("task-1", ["127.0.0.1"], "agent")
    assert refused(gw, "gone.test") == (403, "no_rule")
    status, grant = api.grant("task-1", {"rule": "gone", "ttl_seconds": 1})
    assert status == 201 and grant["rule"] == "gone", grant
    conn = open_tunnel(gw, "gone.test")  # allowed by the grant, inside its second
    allowed = gw.lines(event="request", host="gone.test", decision="allow")[-1]
    assert f"by grant {grant['id']} of sandbox task-1, until" in allowed["message"]
    # the timer, not the next request, ends it: the expiry line, then the tunnel's revocation
    gw.wait(lambda: control_lines(gw, reason="grant_expired"), "the grant_expired line")
    expired = control_lines(gw, reason="grant_expired")[0]
    assert (expired["grant"], expired["sandbox"], expired["rule"], expired["principal"]) == (
        grant["id"], "task-1", "gone", "gateway")
    revoked = line_of(gw.revoked(kind="tunnel"), conn.client)
    assert revoked["cause"] == "no_rule" and "its TTL ran out" in revoked["message"]
    assert conn.closed(WAIT)
    assert refused(gw, "gone.test") == (403, "no_rule")
    assert api.call("GET", "/v1/sandboxes/task-1/grants")[1]["grants"] == []


def test_revoking_a_grant_closes_the_open_websocket_and_tunnel_it_allowed(controlled, origins):  # noqa: F811
    gw, api = controlled()
    api.register("task-1", ["127.0.0.1"], "agent")
    status, grant = api.grant("task-1", {"hosts": ["ws.test", "gone.test"], "ttl_seconds": 600})
    assert status == 201 and grant["rule"] == f"grant:{grant['id']}", grant
    ws = open_websocket(gw)
    conn = open_tunnel(gw, "gone.test")
    kept = open_tunnel(gw, "kept.test")  # the profile's own: not touched
    status, body = api.revoke("task-1", grant["id"])
    assert status == 200 and body["revoked"] == grant["id"]
    lines = gw.revoked(2)
    by_kind = {line["kind"]: line for line in lines}
    assert set(by_kind) == {"websocket", "tunnel"}
    assert line_of(lines, client_of(ws))["rule"] == f"grant:{grant['id']}"
    assert line_of(lines, conn.client)["cause"] == "no_rule"
    assert all(f"removal of grant {grant['id']}" in line["message"] for line in lines)
    assert origins.ws.wait_closed(1) and origins.gone.wait_closed(1)
    assert_websocket_closed(ws)
    assert conn.closed(WAIT)
    assert get(kept, "/still", "kept.test").status == 200
    removed = control_lines(gw, action="revoke")[-1]
    assert (removed["decision"], removed["reason"], removed["grant"]) == ("allow", "revoked_grant", grant["id"])


def test_a_grant_outside_the_envelope_is_refused_and_audited(controlled, origins):  # noqa: F811
    gw, api = controlled()
    api.register("task-1", ["127.0.0.1"], "agent")
    api.register("task-2", ["10.7.0.9"], "locked")
    for sandbox, spec, status, reason in [
        ("task-1", {"rule": "relay"}, 403, "outside_envelope"),  # a rule of the policy, not grantable
        ("task-1", {"hosts": ["*.com"]}, 403, "outside_envelope"),
        ("task-1", {"hosts": ["kept.test"], "ports": [8443]}, 403, "outside_envelope"),
        ("task-1", {"rule": "gone", "ttl_seconds": 7200}, 403, "outside_envelope"),  # past max_ttl
        ("task-2", {"rule": "gone"}, 403, "outside_envelope"),  # its profile declares no grantable
        ("task-1", {"rule": "gone", "hosts": ["a.test"]}, 422, "bad_grant"),
        ("nobody", {"rule": "gone"}, 404, "unknown_sandbox"),
    ]:
        got, body = api.grant(sandbox, spec)
        assert (got, body["error"]) == (status, reason), (spec, body)
    lines = control_lines(gw, action="grant", decision="deny")
    assert [line["reason"] for line in lines] == ["outside_envelope"] * 5 + ["bad_grant", "unknown_sandbox"]
    assert all(line["principal"] == f"uid:{os.getuid()}" for line in lines)
    assert refused(gw, "gone.test") == (403, "no_rule")


# --- sandboxes named by a proxy token ------------------------------------------------------------------

SIGNER = new_signer("EdDSA")
TOKENS = SANDBOXES + """
identity:
  tokens:
    keys: jwks.json
    audience: egress-gateway
    profile_claim: egress_profile
    required: false
"""


def token_tunnel(gw, host: str, token: str) -> tuple[Conn | None, int, str | None]:
    """CONNECT with the token as a Bearer proxy credential; on 200, TLS and one request inside.
    (the open tunnel or None, the CONNECT status, its reason code)"""
    conn = connect_proxy(gw.process, WAIT)
    conn.send(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n"
              f"Proxy-Authorization: Bearer {token}\r\n\r\n".encode())
    answer = conn.read_response(head_only=True)
    if answer.status != 200:
        conn.close()
        return None, answer.status, answer.egress_reason
    tls = start_tls(conn, gw.process, host)
    response = get(tls, "/first", host)
    assert response.status == 200, response
    return tls, 200, None


def test_a_token_sandbox_registered_without_addresses_gets_its_grants_and_loses_them_at_once(controlled, origins,
                                                                                                tmp_path):  # noqa: F811
    write_jwks(tmp_path / "jwks.json", SIGNER)
    gw, api = controlled(sandboxes=TOKENS)
    pod = SIGNER.mint(claims("pod-7", "agent"))
    assert token_tunnel(gw, "gone.test", pod)[1:] == (403, "no_rule")
    status, body = api.call("POST", "/v1/sandboxes", {"id": "pod-7", "profile": "agent", "ttl_seconds": 600})
    assert status == 201 and body["source_ips"] == [], body
    status, grant = api.grant("pod-7", {"hosts": ["gone.test"], "ttl_seconds": 600})
    assert status == 201, grant
    granted, status, _ = token_tunnel(gw, "gone.test", pod)  # a new token of the same sandbox: its grants too
    assert status == 200
    kept, _, _ = token_tunnel(gw, "kept.test", pod)  # the profile's own rule: not the grant's
    allowed = gw.lines(event="request", host="gone.test", decision="allow")[-1]
    assert (allowed["sandbox"], allowed["rule"], allowed["identity"]) == ("pod-7", f"grant:{grant['id']}", "token")
    # The grant is pod-7's alone: not another sandbox's, not pod-7 under another profile (the grant
    # was checked against agent's envelope), not a client with no token from the same address.
    assert token_tunnel(gw, "gone.test", SIGNER.mint(claims("pod-8", "agent")))[1:] == (403, "no_rule")
    assert token_tunnel(gw, "gone.test", SIGNER.mint(claims("pod-7", "locked")))[1:] == (403, "no_rule")
    assert refused(gw, "gone.test") == (403, "no_rule")
    # Removing the grant closes the tunnel it allowed, found by its token's sandbox (no address).
    assert api.revoke("pod-7", grant["id"])[0] == 200
    line = line_of(gw.revoked(kind="tunnel"), granted.client)
    assert (line["sandbox"], line["rule"], line["cause"]) == ("pod-7", f"grant:{grant['id']}", "no_rule")
    assert granted.closed(WAIT)
    assert get(kept, "/still", "kept.test").status == 200
    assert token_tunnel(gw, "gone.test", pod)[1:] == (403, "no_rule")
    # Deregistering ends the grants too; the token itself still names the sandbox by its profile.
    status, grant = api.grant("pod-7", {"rule": "gone", "ttl_seconds": 600})
    regranted, status, _ = token_tunnel(gw, "gone.test", pod)
    assert status == 200
    assert api.deregister("pod-7")[0] == 200
    line = line_of(gw.revoked(2, kind="tunnel"), regranted.client)
    assert "deregistration of sandbox pod-7" in line["message"]
    assert regranted.closed(WAIT)
    assert get(kept, "/still", "kept.test").status == 200


def test_a_registration_without_addresses_needs_tokens(controlled, origins):  # noqa: F811
    gw, api = controlled()
    for body in ({"id": "x", "profile": "agent"}, {"id": "x", "source_ips": [], "profile": "agent"}):
        status, answer = api.call("POST", "/v1/sandboxes", body)
        assert (status, answer["error"]) == (422, "bad_registration") and "tokens" in answer["message"], answer


# --- explain agrees with live traffic ----------------------------------------------------------------------


def live_line(gw, host: str, method: str = "GET", path: str = "/x") -> dict:
    """A real request from the registered address (CONNECT, then `method path` in the tunnel when the
    CONNECT is let through): the audit line of the decision that stood."""
    conn, answer = tunnel(gw.process, f"{host}:443", timeout=WAIT)
    event = "request"
    with conn:
        if answer.status == 200:
            with start_tls(conn, gw.process, host) as tls:
                tls.request(method, path, [("Host", host)])
        else:
            event, method = "connect", "CONNECT"

    def found():
        return [e for e in gw.lines(event=event, method=method) if e.get("client") == conn.client]
    gw.wait(found, f"the audit line of {method} {host}{path}")
    return found()[-1]


def explained_and_live(gw, api, host: str, method: str = "GET") -> tuple[dict, dict]:
    """The explain endpoint's decision and a real request's line, for the same sandbox and URL,
    each as (verdict, reason, rule); and their messages."""
    status, body = api.explain("task-1", f"https://{host}/x", method)
    assert status == 200, body
    line = live_line(gw, host, method)
    said = body["decision"]
    assert (said["verdict"], said["reason"], said["rule"]) == (line["decision"], line["reason"], line["rule"]), (
        body, line)
    return said, line


def test_explain_agrees_with_live_traffic_before_during_and_after_grants(controlled, origins):  # noqa: F811
    """The project's rule, for registered sandboxes: `explain` must agree with live traffic. The
    endpoint explains under the sandbox's live scope, so a grant changes its answer exactly when it
    changes what the sandbox's requests get."""
    gw, api = controlled()
    api.register("task-1", ["127.0.0.1"], "agent")
    said, _ = explained_and_live(gw, api, "gone.test")
    assert (said["verdict"], said["reason"]) == ("deny", "no_rule")
    assert explained_and_live(gw, api, "kept.test")[0]["rule"] == "kept"  # the profile's own rule
    status, grant = api.grant("task-1", {"hosts": ["gone.test"], "methods": ["GET"], "ttl_seconds": 600})
    assert status == 201, grant
    said, line = explained_and_live(gw, api, "gone.test")
    assert (said["verdict"], said["rule"]) == ("allow", f"grant:{grant['id']}")
    assert f"(by grant {grant['id']} of sandbox task-1, until" in said["message"]
    assert said["message"] == line["message"]
    said, _ = explained_and_live(gw, api, "gone.test", "POST")  # outside the grant's methods
    assert (said["reason"], said["rule"]) == ("method_not_allowed", f"grant:{grant['id']}")
    assert api.revoke("task-1", grant["id"])[0] == 200
    assert explained_and_live(gw, api, "gone.test")[0]["reason"] == "no_rule"
    status, grant = api.grant("task-1", {"rule": "gone", "ttl_seconds": 600})
    said, line = explained_and_live(gw, api, "gone.test")
    assert (said["verdict"], said["rule"]) == ("allow", "gone") and grant["id"] in line["message"]
    assert said["message"] == line["message"]
    assert not control_lines(gw, action="explain")  # a read: never a line of its own
    status, body = api.explain("nobody", "https://gone.test/x")
    assert (status, body["error"]) == (404, "unknown_sandbox")
    status, body = api.explain("task-1", "ftp://gone.test/x")
    assert (status, body["error"]) == (400, "bad_request") and "scheme must be one of" in body["message"]


# --- the listener --------------------------------------------------------------------------------------


def test_the_control_port_is_never_reachable_through_the_proxy_and_needs_a_token(controlled, origins, tmp_path):  # noqa: F811
    port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text("platform:0123456789abcdef0123456789abcdef\n")
    tokens.chmod(0o600)
    # a rule that would allow the control address: the gateway's own listener is refused all the same
    rules = BASE_RULES + f"- id: loopback\n  hosts: [127.0.0.1]\n  schemes: [http, https]\n  ports: [{port}]\n"
    gw, _ = controlled(["--control", f"127.0.0.1:{port}", "--control-token-file", str(tokens)], rules,
                       SANDBOXES.replace("rules: [kept]\n    grantable", "rules: [kept, loopback]\n    grantable"))
    anonymous = ControlClient(f"127.0.0.1:{port}")
    assert anonymous.call("GET", "/v1/status")[0] == 401
    wrong = ControlClient(f"127.0.0.1:{port}", token="0123456789abcdef0123456789abcdeX")
    assert wrong.call("GET", "/v1/status")[0] == 401
    api = ControlClient(f"127.0.0.1:{port}", token="0123456789abcdef0123456789abcdef")
    assert api.register("task-1", ["127.0.0.1"], "agent")[0] == 201
    assert control_lines(gw, action="register")[-1]["principal"] == "platform"
    assert not any("0123456789abcdef" in line for line in gw.process.audit_path.read_text().splitlines())
    # through the proxy, to the control address: refused like the metrics port (the gateway itself)
    conn = Conn(socket.create_connection((gw.process.host, gw.process.port), timeout=WAIT))
    conn.send(f"GET http://127.0.0.1:{port}/v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    answer = conn.read_response()
    assert (answer.status, answer.egress_reason) == (403, "self_address")
    tunnel_conn, tunnelled = tunnel(gw.process, f"127.0.0.1:{port}", timeout=WAIT)
    assert (tunnelled.status, tunnelled.egress_reason) == (403, "self_address")
    tunnel_conn.close()
    assert control_lines(gw, reason="unauthorized")  # refusals of the listener are audited too
    for client in (anonymous, wrong, api):
        client.close()


def test_the_socket_is_private_to_the_gateways_user(controlled, origins, tmp_path):  # noqa: F811
    gw, api = controlled()
    path = Path(api.spec[5:])
    assert oct(path.stat().st_mode & 0o777) == "0o600" and path.stat().st_uid == os.getuid()
    status, body = api.call("GET", "/v1/status")
    assert status == 200 and body["sandboxes"] == 0 and len(body["boot_id"]) == 36


def test_oversized_and_chunked_requests_are_refused(controlled, origins):  # noqa: F811
    gw, api = controlled()
    status, body = api.call("POST", "/v1/sandboxes", {"id": "x", "labels": {"k": "v" * 70000}})
    assert (status, body["error"]) == (413, "request_too_large")


# --- the OpenAPI file describes the real routes -------------------------------------------------------


def _openapi_routes() -> set[tuple[str, str]]:
    spec = yaml.safe_load((ROOT / "docs" / "control-api.openapi.yaml").read_text())
    return {(method.upper(), path) for path, item in spec["paths"].items() for method in item
            if method in ("get", "post", "put", "delete", "patch")}


def test_the_openapi_file_names_exactly_the_servers_routes(controlled, origins):  # noqa: F811
    assert _openapi_routes() == {(method, path) for method, path, _ in ROUTES}
    gw, api = controlled()
    api.register("s", ["10.7.0.1"], "agent")
    for method, path in sorted(_openapi_routes()):
        concrete = path.replace("{id}", "s").replace("{grant}", "g-none")
        status, body = api.call(method, concrete, {} if method == "POST" else None)
        assert body.get("error") not in ("not_found", "method_not_allowed"), (method, path, body)
