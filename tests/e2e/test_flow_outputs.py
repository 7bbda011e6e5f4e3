"""Output the gateway does not write itself: mitmproxy's flow printer, flow files, HAR, the TLS key
log, debug logging. A bound request (Authorization header and api_key query parameter injected)
goes through `mitmdump -s addons/egress.py` at every flow_detail and with every flow writer asked
for; stdout, stderr and every file the process could have written are searched for every form of
the secret (raw, base64, hex, URL-encoded, the escaped forms the printer uses, and any 12-byte
piece of it, which a truncated URL would show). The embedded runner gets the same search."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import quote_plus

import pytest

from tests.conftest import policy_text
from tests.credentials.servers import EchoUpstream
from tests.e2e.helpers import H2Client, get, tls_tunnel
from tests.support.gateway import PROJECT_ROOT, GatewayProcess, free_port, wait_for_port
from tests.support.mitmdump import clean_env, start_mitmdump, stop
from tests.support.mitmdump import secret_forms_in as forms_in

# A space, '&', '=', '+', '/', a backslash and a double quote: every escaping a printer does shows.
SECRET = 'fo-Tok9+Zq/Ww3=Ee5&Rr7 \\x"q_live'
ENV_VAR = "EGRESS_OUTPUT_TOKEN"
LAST_OCTET = 46  # in the session block: .40-.45 are tests/credentials/bound.py users

RULES = """
- id: echo
  hosts: [echo.test]
  paths: ["/v1/**"]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.out_token}"
    - query: api_key
      value: "${secrets.out_token}"
- id: echo-public
  hosts: [echo.test]
  paths: ["/public/**"]
"""


def _extra(upstreams) -> str:
    return (f'    echo.test: ["{upstreams.block}.{LAST_OCTET}"]\n'
            f"secrets:\n  out_token: {{env: {ENV_VAR}}}\n")


@pytest.fixture(scope="module")
def echo(pki, upstreams):
    address = f"{upstreams.block}.{LAST_OCTET}"
    cert, key = pki.issue(["echo.test"], [address], stem="flow-outputs-echo")
    server = EchoUpstream("echo", address, 443, cert, key)
    yield server
    server.stop()


def secret_forms_in(data: bytes) -> list[str]:
    return forms_in(data, SECRET)


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**{ENV_VAR: SECRET}, **extra)


def _run_mitmdump(tmp_path, upstreams, pki, args: list[str], env: dict[str, str] | None = None):
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES, _extra(upstreams)))
    return start_mitmdump(tmp_path, policy, pki.ca_cert, args, env or _env())


def _traffic(proxy, echo) -> None:
    """A bound request over HTTP/1.1 and over HTTP/2, one whose response echoes the token in
    headers, and an unbound one to the same host (what stickyauth would add a credential to)."""
    echo.reset()
    with tls_tunnel(proxy, "echo.test:443") as tls:
        assert get(tls, "/v1/anything?q=1", "echo.test").status == 200, proxy.log()[-3000:]
        assert get(tls, "/v1/headers", "echo.test").status == 200
        assert get(tls, "/public/page", "echo.test").status == 200
    with tls_tunnel(proxy, "echo.test:443", alpn=["h2"]) as tls:
        client = H2Client(tls)
        stream = client.send("echo.test", "/v1/anything/h2?z=2")
        client.wait(stream)
        assert client.responses[stream]["status"] == 200
    bound = [r for r in echo.requests if r.path.startswith("/v1/")]
    assert len(bound) == 3
    for seen in bound:  # the credential did go out: the search below is not vacuous
        assert seen.header_all("authorization") == [f"Bearer {SECRET}"]
        assert f"api_key={quote_plus(SECRET)}" in seen.path


def _everything_written(tmp_path: Path) -> dict[str, bytes]:
    """Every file under tmp_path but the policy and the CA material: what the process wrote."""
    found = {}
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "policy.yaml" and "conf" not in path.relative_to(tmp_path).parts[:1]:
            found[str(path.relative_to(tmp_path))] = path.read_bytes()
    return found


def _assert_nothing_leaked(tmp_path: Path) -> dict[str, bytes]:
    written = _everything_written(tmp_path)
    problems = {name: secret_forms_in(data)[:5] for name, data in written.items()}
    problems = {name: forms for name, forms in problems.items() if forms}
    assert not problems, f"the secret in output the gateway does not control: {problems}"
    return written


@pytest.mark.parametrize("detail", [0, 1, 2, 3, 4])
def test_flow_printer_never_shows_the_secret(tmp_path, upstreams, pki, echo, detail):
    proc, proxy = _run_mitmdump(tmp_path, upstreams, pki, ["--set", f"flow_detail={detail}"])
    try:
        wait_for_port("127.0.0.1", proxy.port, process=proc)
        _traffic(proxy, echo)
    finally:
        stop(proc)
    out = _assert_nothing_leaked(tmp_path)["mitmdump.out"].decode("utf-8", "replace")
    if detail >= 1:  # the flows were printed, with the injected parts redacted
        assert "/v1/anything?q=1" in out, out[-3000:]
        assert "api_key=[REDACT" in out, out[-3000:]  # (level 1 cuts URLs at the terminal width)
    if detail >= 2:
        assert "Authorization: Bearer [REDACTED]" in out, out[-3000:]
    if detail >= 3:
        assert f"flow_detail={detail} lowered to 2" in out


def test_verbose_and_protocol_debugging_leak_nothing(tmp_path, upstreams, pki, echo):
    """-v (termlog debug, flow_detail 2) and proxy_debug, which logs every byte each layer sends."""
    proc, proxy = _run_mitmdump(tmp_path, upstreams, pki, ["-v", "--set", "proxy_debug=true"])
    try:
        wait_for_port("127.0.0.1", proxy.port, process=proc)
        _traffic(proxy, echo)
    finally:
        stop(proc)
    out = _assert_nothing_leaked(tmp_path)["mitmdump.out"].decode("utf-8", "replace")
    assert "ignoring proxy_debug=True" in out
    assert "termlog_verbosity=debug lowered to info" in out


def test_flow_files_har_key_log_and_sticky_auth_are_off(tmp_path, upstreams, pki, echo):
    keylog = tmp_path / "keys.log"
    proc, proxy = _run_mitmdump(
        tmp_path, upstreams, pki,
        ["-w", str(tmp_path / "flows.mitm"), "--set", f"hardump={tmp_path / 'flows.har'}",
         "--set", "stickyauth=.", "--set", "flow_detail=2"],
        env=_env(SSLKEYLOGFILE=str(keylog)))
    try:
        wait_for_port("127.0.0.1", proxy.port, process=proc)
        _traffic(proxy, echo)
    finally:
        stop(proc)
    written = _assert_nothing_leaked(tmp_path)
    out = written["mitmdump.out"].decode("utf-8", "replace")
    for option in ("save_stream_file", "hardump", "stickyauth"):
        assert f"ignoring {option}=" in out, out[-3000:]
    assert "ignoring SSLKEYLOGFILE" in out
    assert not written.get("flows.mitm") and not written.get("flows.har")
    assert not keylog.exists() or not keylog.read_bytes().strip(), "TLS session keys were written"
    # stickyauth would have copied the injected Authorization onto the unbound /public request
    [public] = [r for r in echo.requests if r.path.startswith("/public/")]
    assert public.header_all("authorization") == []


def test_interactive_ui_is_refused(tmp_path, upstreams):
    mitmweb = Path(sys.executable).with_name("mitmweb")
    if not mitmweb.exists():
        pytest.skip("mitmweb not installed next to this Python")
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES, _extra(upstreams)))
    proc = subprocess.run(
        [str(mitmweb), "-s", str(PROJECT_ROOT / "addons" / "egress.py"), "--listen-host", "127.0.0.1",
         "-p", str(free_port()), "--set", f"web_port={free_port()}", "--set", "web_host=127.0.0.1",
         "--set", "web_open_browser=false", "--set", f"confdir={tmp_path / 'conf'}",
         "--set", f"egress_policy={policy}"],
        capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0
    assert "do not run in mitmproxy's interactive UI" in proc.stdout + proc.stderr


def test_embedded_runner_key_log_and_debug_options(tmp_path, upstreams, pki, echo, monkeypatch):
    """`egress-gateway run` loads no flow writer; the key log and the logging options still apply."""
    keylog = tmp_path / "keys.log"
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, RULES, _extra(upstreams)))
    monkeypatch.setenv(ENV_VAR, SECRET)
    monkeypatch.setenv("SSLKEYLOGFILE", str(keylog))
    gateway = GatewayProcess(policy, tmp_path / "gw", upstream_ca=pki.ca_cert,
                             extra_args=["--set", "termlog_verbosity=debug", "--set", "proxy_debug=true"])
    gateway.start()
    monkeypatch.delenv("SSLKEYLOGFILE")  # for the gateway only: Python's own ssl (the test's clients) honours it too
    try:
        _traffic(gateway, echo)
    finally:
        gateway.stop()
    log = gateway.log_path.read_bytes()
    assert not secret_forms_in(log), secret_forms_in(log)
    assert not secret_forms_in(gateway.audit_path.read_bytes())
    text = log.decode("utf-8", "replace")
    assert "ignoring SSLKEYLOGFILE" in text and "ignoring proxy_debug=True" in text
    assert not keylog.exists() or not keylog.read_bytes().strip(), "TLS session keys were written"
