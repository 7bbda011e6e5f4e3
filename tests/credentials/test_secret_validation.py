"""Secret values that would break the header block or the URL they are written into. An
`{env: ...}` value is held to the same rules as a `{file: ...}` one (gateway/secrets.py): one
trailing LF or CRLF is dropped (a Kubernetes Secret made with --from-file, `echo` into a file);
any other CR, LF, NUL or control character, a value that is not UTF-8, a space at either end or more
than MAX_SECRET_BYTES make the secret unavailable: the request that needs it gets 502
secret_unavailable and nothing is sent; start-up and `check` name the secret and the variable,
never the value. Otherwise the value arrives at the upstream byte-exact where the template puts it.

The upstream is a raw recorder on plain HTTP (rules with allow_plaintext_credentials), so the test
reads the header block exactly as the gateway wrote it."""

from __future__ import annotations

import os
import subprocess
import sys
from urllib.parse import quote_plus

import pytest
from hypothesis import HealthCheck, example, given, settings

from gateway.secrets import MAX_SECRET_BYTES
from tests.e2e.helpers import ScriptedUpstream, assert_refused, connect_proxy, extra_static_hosts, shared_gateway
from tests.support.gateway import PROJECT_ROOT
from tests.unit.test_secret_values import VALUES, expected

LAST_OCTET = 47  # in the session block: .40-.45 are tests/credentials/bound.py users, .46 test_flow_outputs
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"

# secret name -> the bytes its environment variable holds
ACCEPTED = {
    "ok_lf": b"sv-token-lf\n",
    "ok_crlf": b"sv-token-crlf\r\n",
    "ok_utf8": "sv-tök-ü€".encode(),
    "ok_inner_space": b"sv token with spaces",
}
REFUSED = {
    "bad_lf": b"sv-bad-lf\nX-Injected: lf",
    "bad_cr": b"sv-bad-cr\rX-Injected: cr",
    "bad_crlf": b"sv-bad-crlf\r\nX-Injected: crlf\r\n",
    "bad_two_lf": b"sv-bad-two-lf\n\n",
    "bad_lone_cr": b"sv-bad-lone-cr\r",
    "bad_tab": b"sv-bad\ttab",
    "bad_esc": b"sv-bad\x1besc",
    "bad_del": b"sv-bad\x7fdel",
    "bad_c1": "sv-bad\u0085nel".encode(),
    "bad_latin1": b"sv-bad-caf\xe9",
    "bad_lead": b" sv-bad-lead",
    "bad_trail": b"sv-bad-trail ",
    "bad_long": b"L" * (MAX_SECRET_BYTES + 1),
    "bad_empty": b"\n",
}
WHY = {
    "bad_lf": "contains a line feed (LF) at character 10", "bad_cr": "contains a carriage return (CR) at character 10",
    "bad_crlf": "contains a carriage return (CR) at character 12", "bad_two_lf": "contains a line feed (LF)",
    "bad_lone_cr": "contains a carriage return (CR)", "bad_tab": "contains a tab", "bad_esc": "U+001B",
    "bad_del": "contains a DEL byte", "bad_c1": "U+0085", "bad_latin1": "is not UTF-8 text",
    "bad_lead": "begins with a space", "bad_trail": "ends with a space", "bad_long": f"a secret is at most {MAX_SECRET_BYTES}",
    "bad_empty": "is empty",
}
CASES = ACCEPTED | REFUSED


def var(name: str) -> str:
    return f"EGRESS_SV_{name.upper()}"


def host(name: str) -> str:
    return name.replace("_", "-") + ".test"


def _rule(name: str, secret: str) -> str:
    return f"""
- id: {name.replace('_', '-')}
  hosts: [{host(name)}]
  schemes: [http]
  allow_plaintext_credentials: true
  inject:
    - header: Authorization
      value: "Bearer ${{secrets.{secret}}}"
    - query: api_key
      value: "${{secrets.{secret}}}"
"""


@pytest.fixture(scope="module")
def sv(tmp_path_factory, upstreams, pki):
    recorder = ScriptedUpstream(f"{upstreams.block}.{LAST_OCTET}", ANSWER, port=80)
    secret_dir = tmp_path_factory.mktemp("sv-secrets")
    prop_file = secret_dir / "prop"
    prop_file.write_bytes(b"initial-prop-value\n")
    names = [*CASES, "unset"]
    rules = "".join(_rule(name, name) for name in names) + _rule("prop", "prop")
    extra = extra_static_hosts({host(n): recorder.host for n in [*names, "prop"]})
    extra += "secrets:\n" + "".join(f"  {n}: {{env: {var(n)}}}\n" for n in names)
    extra += f"  prop: {{file: {prop_file}}}\n"
    patch = pytest.MonkeyPatch()
    try:
        for name, raw in CASES.items():
            patch.setitem(os.environb, os.fsencode(var(name)), raw)
        patch.delitem(os.environb, os.fsencode(var("unset")), raising=False)
        gateway = shared_gateway(tmp_path_factory, upstreams, pki, rules, extra, name="sv")
    finally:
        patch.undo()
    gateway.recorder = recorder
    gateway.prop_file = prop_file
    yield gateway
    gateway.stop()
    recorder.stop()


def _request(gateway, name: str, path: str = "/v1/x?q=1"):
    with connect_proxy(gateway) as conn:
        return conn.request("GET", f"http://{host(name)}{path}", [("Host", host(name))])


def _head_for(gateway, before: int) -> bytes:
    heads = gateway.recorder.heads[before:]
    assert len(heads) == 1, heads
    return heads[0]


def _assert_exact(head: bytes, value: bytes) -> None:
    """The header block is exactly what the template says: request line, Host, the credential."""
    lines = head.split(b"\r\n")
    assert lines[0] == b"GET /v1/x?q=1&api_key=" + quote_plus(value.decode()).encode() + b" HTTP/1.1", lines[0]
    assert lines[1:] == [b"Host: " + lines[1][6:], b"Authorization: Bearer " + value,
                         b"Accept-Encoding: identity"], lines


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_values_arrive_byte_exact(sv, name):
    before = len(sv.recorder.heads)
    response = _request(sv, name)
    assert response.status == 200, (response.status, response.text)
    value = expected(ACCEPTED[name]).encode()
    _assert_exact(_head_for(sv, before), value)


@pytest.mark.parametrize("name", sorted(REFUSED) + ["unset"])
def test_refused_values_send_nothing(sv, name):
    before = len(sv.recorder.heads)
    connections = sv.recorder.connections
    response = _request(sv, name)
    assert_refused(response, 502, "secret_unavailable", rule=name.replace("_", "-"))
    assert f"secret {name!r} is unavailable" in response.text
    assert var(name) not in response.text  # where it is looked for is for the operator only
    assert sv.recorder.heads[before:] == [] and sv.recorder.connections == connections


def test_start_up_log_names_secret_and_variable_never_the_value(sv):
    log = sv.log()
    for name in REFUSED:
        line = next((line for line in log.splitlines() if f"secret {name!r} is unavailable" in line), None)
        assert line is not None, f"{name} not reported at start-up"
        assert var(name) in line and WHY[name] in line, line
    assert f"secret 'unset' is unavailable: environment variable {var('unset')} is not set" in log
    data = sv.log_path.read_bytes()
    assert b"X-Injected" not in data and b"sv-bad" not in data and b"L" * 64 not in data  # no value, no piece
    for name in ACCEPTED:
        assert f"secret {name!r}" not in log


def test_check_reports_unusable_values_it_can_see(sv):
    env = {k: v for k, v in os.environb.items()} | {os.fsencode(var(n)): raw for n, raw in CASES.items()}
    env[b"PYTHONPATH"] = os.fsencode(str(PROJECT_ROOT))
    proc = subprocess.run([sys.executable, "-m", "gateway", "check", str(sv.policy)], capture_output=True, env=env,
                          cwd=PROJECT_ROOT)
    out = (proc.stdout + proc.stderr).decode("utf-8", "surrogateescape")
    assert proc.returncode == 0, out  # warnings: the policy itself is fine
    reported = {line.split("secrets.", 1)[1].split(".", 1)[0] for line in out.splitlines() if "[unusable-secret]" in line}
    assert reported == set(REFUSED), out
    for line in out.splitlines():
        if "[unusable-secret]" in line:
            assert f"{sv.policy}:" in line and "warning: secret" in line, line
    assert "X-Injected" not in out and "sv-bad" not in out
    strict = subprocess.run([sys.executable, "-m", "gateway", "check", "--strict", str(sv.policy)],
                            capture_output=True, env=env, cwd=PROJECT_ROOT)
    assert strict.returncode == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=VALUES)
@example(raw=b"prop-lf\n")
@example(raw=b"prop\r\nX-Injected: 1")
@example(raw=b"prop\x00nul")
@example(raw=b" prop")
@example(raw="pröp".encode())
def test_file_values_by_property_end_to_end(sv, raw):
    """Either the header block and URL hold exactly the value, or 502 and no byte upstream."""
    fresh = sv.prop_file.with_name("prop.new")
    fresh.write_bytes(raw)
    os.replace(fresh, sv.prop_file)  # a new inode: the gateway re-reads it on this request
    before, connections = len(sv.recorder.heads), sv.recorder.connections
    response = _request(sv, "prop")
    want = expected(raw)
    if want is None:
        assert_refused(response, 502, "secret_unavailable", rule="prop")
        assert sv.recorder.heads[before:] == [] and sv.recorder.connections == connections
    else:
        assert response.status == 200, (raw, response.status, response.text)
        _assert_exact(_head_for(sv, before), want.encode())
