"""docker/compose.yaml (the explicit variant) run for real with podman (tests/deploy/compose_run.py:
podman's own networks, volumes and containers made from the file; Debian's podman-compose cannot
run it, see there): the gateway, ca-export and the sandbox from the real images, in depends_on
order with its conditions.

What the test changes in the file, and why:
- the `egress` network is made `internal: true` too: the network-safety rule of the tests (nothing
  reaches off the machine). The "internet" is an origin container on it, a TLS server that echoes
  what it received.
- the policy directory is a test policy (the example's names are public hosts, and it denies the
  private range the origin is on); the gateway also gets the test CA to verify the origin with.
- the gateway's `nofile` ulimit is capped at this process's hard limit (podman without
  CAP_SYS_RESOURCE cannot raise it; Docker's daemon can).
- addresses, the metrics port and the images are the file's own variables.

Then, from inside the sandbox: the origin through the gateway (200, the token injected by the
gateway, the CA bundle from ca-export), another host refused (403), and nothing directly: not the
origin, not the metrics port on either of the gateway's addresses, no default route."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import random
import resource
import subprocess
import textwrap

import pytest

from tests.support.gateway import free_port
from bench.lib.pki import TestPKI

from . import podman as pm
from .compose_run import ComposeRun
from .conftest import report
from .deployfiles import COMPOSE_FILES, compose_raw, interpolate

pytestmark = [pytest.mark.netns, pytest.mark.timeout(900)]

EXPLICIT = COMPOSE_FILES[0]
TOKEN = "ghp_compose-run-secret-42"
ORIGIN_SCRIPT = """\
import hashlib, http.server, json, ssl
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        authorization = self.headers.get("Authorization", "")
        body = json.dumps({"path": self.path, "authorization": authorization,
                           "authorization_sha256": hashlib.sha256(authorization.encode()).hexdigest()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("0.0.0.0", 443), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("/origin/cert.pem", "/origin/key.pem")
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""
SANDBOX_PROBE = """\
import json, os, socket, sys, urllib.request
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            return {"status": response.status, "body": response.read().decode()}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
def connect(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__ + ": " + os.strerror(exc.errno) if exc.errno else type(exc).__name__
routes = [line.split()[1] for line in open("/proc/net/route").read().splitlines()[1:]]
print(json.dumps({
    "allowed": fetch("https://origin.test/hello"),
    "other": fetch("https://other.test/"),
    "direct": {f"{h}:{p}": connect(h, p) for h, p in json.loads(sys.argv[1])},
    "default_route": "00000000" in routes,
}))
"""


def _variables() -> dict[str, str]:
    block = random.Random(os.getpid()).randrange(16, 250)
    return {
        "SANDBOX_NET_SUBNET": f"10.213.{block}.0/24", "SANDBOX_NET_GATEWAY_IP": f"10.213.{block}.10",
        "EGRESS_NET_SUBNET": f"10.214.{block}.0/24", "EGRESS_NET_GATEWAY_IP": f"10.214.{block}.10",
        "EGRESS_METRICS_PORT": str(free_port()), "EGRESS_WORKERS": "1",
    }


@pytest.fixture(scope="module")
def deployment(gateway_image, base_image, tmp_path_factory):
    work = tmp_path_factory.mktemp("compose")
    variables = _variables()
    variables.update(EGRESS_GATEWAY_IMAGE=gateway_image.ref, SANDBOX_IMAGE=base_image.ref)
    origin_ip = variables["EGRESS_NET_GATEWAY_IP"].rsplit(".", 1)[0] + ".20"
    doc = interpolate(compose_raw(EXPLICIT), variables)

    # The egress network has no route off the machine either; the origin stands in for the internet.
    doc["networks"]["egress"]["internal"] = True
    pki = TestPKI(work / "pki")
    cert, key = pki.issue(["origin.test"], [origin_ip], stem="origin")
    origin_dir = work / "origin"
    origin_dir.mkdir()
    (origin_dir / "serve.py").write_text(ORIGIN_SCRIPT)
    (origin_dir / "cert.pem").write_bytes(cert.read_bytes())
    (origin_dir / "key.pem").write_bytes(key.read_bytes())
    doc["services"]["origin"] = {
        "image": base_image.ref, "command": ["python3", "/origin/serve.py"], "cap_drop": ["ALL"],
        "cap_add": ["NET_BIND_SERVICE"], "volumes": [f"{origin_dir}:/origin:ro"],
        "networks": {"egress": {"ipv4_address": origin_ip}},
    }

    # A test policy in place of the example's, and the test CA to verify the origin with.
    policy_dir = work / "policy"
    policy_dir.mkdir()
    (policy_dir / "policy.yaml").write_text(textwrap.dedent(f"""\
        version: 1
        network:
          allow_ip_ranges: [{origin_ip}/32]
        resolver:
          static_hosts:
            origin.test: [{origin_ip}]
            other.test: [{origin_ip}]
        secrets:
          github_token: {{file: /run/secrets/egress/github_token}}
        rules:
          - id: origin
            hosts: [origin.test]
            methods: [GET]
            inject:
              - header: Authorization
                value: "Bearer ${{secrets.github_token}}"
        """))
    gateway = doc["services"]["gateway"]
    gateway["volumes"] = [f"{policy_dir}:/etc/egress-gateway/policy:ro" if v.startswith("./kubernetes/policy:") else v
                          for v in gateway["volumes"]] + [f"{pki.ca_cert}:/etc/egress-gateway/upstream-ca.pem:ro"]
    gateway["command"] = [*gateway["command"], "--set", "ssl_verify_upstream_trusted_ca=/etc/egress-gateway/upstream-ca.pem"]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = gateway["ulimits"]["nofile"]
    gateway["ulimits"]["nofile"] = {"soft": min(nofile["soft"], hard), "hard": min(nofile["hard"], hard)}

    # The secret file the README says to create (docker/secrets/ is git-ignored).
    (work / "secrets").mkdir()
    (work / "secrets" / "github_token").write_text(TOKEN)
    (work / "secrets" / "github_token").chmod(0o644)

    run = ComposeRun(doc, f"egc{os.getpid()}", work)
    try:
        run.up()
        yield run, variables, origin_ip
    finally:
        run.down()


def test_the_services_start_in_order_and_prometheus_stays_in_its_profile(deployment, record_property):
    run, variables, _ = deployment
    assert run.order() == ["gateway", "ca-export", "sandbox", "origin"]
    assert "prometheus" not in run.active()
    exported = run.exec("sandbox", "ls", "/etc/egress-ca").stdout.split()
    assert exported == ["ca-bundle.pem", "mitmproxy-ca-cert.pem"]  # never the key
    report(record_property, f"compose.yaml run with podman: networks {variables['SANDBOX_NET_SUBNET']} (internal) "
                            f"and {variables['EGRESS_NET_SUBNET']}")


@pytest.fixture(scope="module")
def probe(deployment):
    """What the sandbox gets, asked once from inside it (python: the sandbox image has no curl)."""
    run, variables, origin_ip = deployment
    gateway_sandbox_side, gateway_egress_side = variables["SANDBOX_NET_GATEWAY_IP"], variables["EGRESS_NET_GATEWAY_IP"]
    targets = [(origin_ip, 443), (gateway_egress_side, 9090), (gateway_sandbox_side, 9090),
               ("192.0.2.1", 443)]  # TEST-NET-1: never routed anywhere, should a route exist
    result = run.exec("sandbox", "python3", "-c", SANDBOX_PROBE, json.dumps(targets))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), origin_ip, variables


def test_the_sandbox_reaches_the_allowed_origin_through_the_gateway_with_the_injected_token(probe):
    found, _, _ = probe
    assert found["allowed"].get("status") == 200, found["allowed"]
    echoed = json.loads(found["allowed"]["body"])
    assert echoed["path"] == "/hello"
    # The origin got the token; echoed back, the gateway redacted it: the sandbox never sees it.
    assert echoed["authorization_sha256"] == hashlib.sha256(f"Bearer {TOKEN}".encode()).hexdigest()
    assert TOKEN not in found["allowed"]["body"]


def test_the_sandbox_is_refused_anything_else(probe):
    found, _, _ = probe
    assert "403" in found["other"].get("error", ""), found["other"]


def test_the_sandbox_reaches_nothing_directly(probe):
    found, origin_ip, variables = probe
    assert not found["default_route"]
    direct = found["direct"]
    assert direct[f"{origin_ip}:443"].startswith("OSError: Network is unreachable"), direct
    assert direct[f"{variables['EGRESS_NET_GATEWAY_IP']}:9090"].startswith("OSError: Network is unreachable"), direct
    assert direct[f"{variables['SANDBOX_NET_GATEWAY_IP']}:9090"].startswith("ConnectionRefusedError"), direct
    assert direct["192.0.2.1:443"].startswith("OSError: Network is unreachable"), direct


def test_metrics_answer_on_the_egress_side_where_prometheus_scrapes(deployment):
    """Not through the port published on the host's loopback: the test makes the egress network
    internal, and podman forwards no published port into an internal network."""
    run, variables, _ = deployment
    url = f"http://{variables['EGRESS_NET_GATEWAY_IP']}:9090/readyz"
    result = run.exec("origin", "python3", "-c", f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).status)")
    assert result.stdout.strip() == "200", result.stderr


def test_the_host_has_no_address_on_the_sandbox_network(deployment):
    """What inhibit_ipv4 does with Docker: with an address on its end of the bridge, the host's
    services on it or on 0.0.0.0 would be reachable from the sandbox. podman has no such option; an
    internal network created with --disable-dns gets no host address (with podman's DNS it gets one,
    for aardvark-dns)."""
    run, variables, _ = deployment
    subnet = ipaddress.ip_network(variables["SANDBOX_NET_SUBNET"])
    addresses = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    on_subnet = [line for line in addresses.splitlines()
                 if ipaddress.ip_interface(line.split()[3]).ip in subnet]
    assert on_subnet == []
