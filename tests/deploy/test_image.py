"""The gateway image, built for real from the committed tree (tests/deploy/images.py) and checked
from the outside, as a platform team would run it: its user and contents, the CLI, the default
command on the embedded policy, a mounted policy, secret and CA, the HEALTHCHECK, SIGTERM, the CA
key's permissions, its size.

Every container runs in a network namespace made here with a loopback only (podman.Netns): the
origins and the clients (curl) are on that loopback, nothing is reachable off the machine. Skipped
with the reason when podman cannot build or run images here (not root, not installed)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import stat
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest

from bench.lib.pki import TestPKI
from tests.support.upstream import RecordingUpstream
from tests.support.waiting import wait_for

from . import images
from . import podman as pm
from .conftest import report
from .deployfiles import GATEWAY_UID, K8S

pytestmark = [pytest.mark.netns, pytest.mark.timeout(900)]

OTHER_UID = 20000
TOKEN = "ghp_image-test-secret-0123456789"
ALLOWED, OTHER, SLOW = "127.0.0.2", "127.0.0.3", "127.0.0.4"
NOT_NEEDED = ("pip", "pip3", "gcc", "cc", "make", "git", "curl", "wget", "iptables", "ip", "nc", "ssh", "sudo")
GATEWAY_PROCESS = b"egress-gateway"


def curl(ns: pm.Netns, url: str, *extra: str, seconds: float = 10) -> subprocess.CompletedProcess:
    """curl through the gateway on the namespace's 127.0.0.1:8080, with a clean environment."""
    return ns.run("env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "curl", "-sS", "-m", str(seconds),
                  "-x", "http://127.0.0.1:8080", *extra, url, timeout=seconds + 10)


def wait_ready(container: pm.Container, timeout: float = 60) -> None:
    def ready() -> bool:
        assert container.running(), f"the container exited:\n{container.logs()}"
        return container.healthcheck().returncode == 0
    wait_for(ready, timeout=timeout, interval=0.2, what=f"{container.name} healthy", detail=container.logs)


def signal_gateway_processes(container: pm.Container, signal_name: str) -> None:
    """Send a signal to every gateway process of the container (the supervisor and its workers)."""
    code = textwrap.dedent(f"""
        import os, signal
        for pid in filter(str.isdigit, os.listdir('/proc')):
            try:
                cmdline = open(f'/proc/{{pid}}/cmdline', 'rb').read()
            except OSError:
                continue
            if int(pid) != os.getpid() and {GATEWAY_PROCESS!r} in cmdline:
                os.kill(int(pid), signal.{signal_name})
    """)
    result = container.exec("python", "-c", code)
    assert result.returncode == 0, result.stderr


# --- the image itself -----------------------------------------------------------------------------


def test_it_runs_as_uid_10001_without_tools_it_does_not_need(gateway_image):
    config = images.image_config(gateway_image.ref)["Config"]
    assert config["User"] == f"{GATEWAY_UID}:{GATEWAY_UID}"
    ids = pm.podman("run", "--rm", "--network", "none", "--entrypoint", "id", gateway_image.ref).stdout
    assert ids.startswith(f"uid={GATEWAY_UID}(egress) gid={GATEWAY_UID}(egress)"), ids
    probe = ("import json, os, shutil, importlib.util; print(json.dumps({"
             f"'tools': {{t: shutil.which(t) for t in {NOT_NEEDED!r}}},"
             "'pip': importlib.util.find_spec('pip') is not None,"
             "'leftovers': [p for p in ('/src', '/wheels') if os.path.exists(p)]}))")
    found = json.loads(pm.podman("run", "--rm", "--network", "none", "--entrypoint", "python", gateway_image.ref,
                                 "-c", probe).stdout)
    assert {t: p for t, p in found["tools"].items() if p} == {}
    assert not found["pip"] and found["leftovers"] == []


def test_egress_gateway_help_and_version(gateway_image):
    run = ("run", "--rm", "--network", "none", "--entrypoint", "egress-gateway", gateway_image.ref)
    helped = pm.podman(*run, "--help").stdout
    for command in ("run", "check", "explain", "placeholders"):
        assert command in helped
    assert pm.podman(*run, "--version").stdout.strip().endswith("0.1.0")
    # The entrypoint is `egress-gateway run`: arguments are run's flags.
    run_help = pm.podman("run", "--rm", "--network", "none", gateway_image.ref, "--help").stdout
    assert "--policy" in run_help and "--drain-timeout" in run_help


def test_the_build_hosts_ca_bundle_is_not_in_the_image(gateway_image, base_image):
    bundle = images.host_ca_bundle()
    if bundle is None:
        pytest.skip("no host CA bundle was mounted into the build")
    host_digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    mounted = pm.podman("image", "mount", gateway_image.ref).stdout.strip()
    base_mounted = pm.podman("image", "mount", base_image.ref).stdout.strip()
    try:
        base_bundle = Path(base_mounted) / "etc/ssl/certs/ca-certificates.crt"
        image_bundle = Path(mounted) / "etc/ssl/certs/ca-certificates.crt"
        assert image_bundle.read_bytes() == base_bundle.read_bytes()  # the build never changed it
        if hashlib.sha256(base_bundle.read_bytes()).hexdigest() == host_digest:
            return  # the host's bundle is Debian's own: nothing to tell apart
        size = bundle.stat().st_size
        for path in Path(mounted).rglob("*"):
            if path.is_file() and not path.is_symlink() and path.stat().st_size == size:
                assert hashlib.sha256(path.read_bytes()).hexdigest() != host_digest, path
    finally:
        pm.podman("image", "unmount", gateway_image.ref, check=False)
        pm.podman("image", "unmount", base_image.ref, check=False)


def test_the_image_size_and_build_times_are_reported(gateway_image, base_image, record_property):
    size = images.image_size(gateway_image.ref)
    base = "cached" if base_image.cached else f"bootstrapped in {base_image.seconds:.0f} s"
    report(record_property, f"gateway image {gateway_image.ref}: {size / 1e6:.0f} MB; "
                            f"built in {gateway_image.seconds:.0f} s; base {base_image.ref} {base}")
    assert size < 400e6, f"the image grew to {size / 1e6:.0f} MB"


# --- the default command --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_gateway(gateway_image):
    """`podman run IMAGE` as it is: the default command on the embedded default policy."""
    ns = pm.Netns()
    container = None
    try:
        container = pm.Container(gateway_image.ref, "--network", ns.network)
        wait_ready(container)
        yield ns, container
    finally:
        if container is not None:
            container.remove()
        ns.delete()


def audit_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_the_default_command_refuses_with_the_documented_403_and_an_audit_line(default_gateway):
    ns, container = default_gateway
    assert "<embedded policies/default.yaml>" in container.logs()
    result = curl(ns, "http://blocked.example/", "-o", "/dev/null", "-w", "%{http_code} %header{x-egress-reason}")
    assert result.stdout == "403 no_rule", result.stderr

    def audited():
        text = container.exec("cat", "/var/log/egress-gateway/audit.jsonl").stdout
        return [line for line in audit_lines(text) if line.get("host") == "blocked.example"]
    line = wait_for(audited, timeout=10, what="the audit line")[0]
    assert (line["decision"], line["status"], line["reason"]) == ("deny", 403, "no_rule")


def test_the_ca_key_is_not_readable_by_other_uids(default_gateway):
    ns, container = default_gateway
    confdir = "/var/lib/egress-gateway"
    modes = json.loads(container.exec("python", "-c", (
        "import json, os; d = '/var/lib/egress-gateway'; "
        "print(json.dumps({n: os.stat(os.path.join(d, n)).st_mode for n in ['.', *os.listdir(d)]}))")).stdout)
    assert stat.S_IMODE(modes["."]) == 0o700
    for secret in ("mitmproxy-ca.pem", "egress-placeholder.key"):
        assert stat.S_IMODE(modes[secret]) & 0o077 == 0, secret
    for path in (f"{confdir}/mitmproxy-ca.pem", f"{confdir}/egress-placeholder.key"):
        read = container.exec("python", "-c", f"open({path!r}).read()", user=f"{OTHER_UID}:{OTHER_UID}")
        assert read.returncode != 0 and "PermissionError" in read.stderr, read.stderr


def test_the_healthcheck_passes_and_fails_when_it_must(default_gateway):
    ns, container = default_gateway
    health = images.image_config(container.image)["Healthcheck"]  # --format docker keeps it
    assert health["Test"][0] == "CMD" and "EGRESS_HEALTHCHECK_URL" in " ".join(health["Test"])
    assert container.healthcheck().returncode == 0
    signal_gateway_processes(container, "SIGSTOP")  # alive but not answering: a stuck event loop
    try:
        failed = container.healthcheck()
        assert failed.returncode != 0 and "unhealthy" in failed.stdout, failed
    finally:
        signal_gateway_processes(container, "SIGCONT")
    wait_for(lambda: container.healthcheck().returncode == 0, timeout=30, what="healthy again")


# --- a mounted policy, secret and CA --------------------------------------------------------------


POLICY = f"""\
version: 1
network:
  allow_ip_ranges: [127.0.0.0/8]
resolver:
  static_hosts:
    allowed.test: [{ALLOWED}]
    other.test: [{OTHER}]
    slow.test: [{SLOW}]
secrets:
  token: {{file: /run/secrets/egress/token}}
rules:
  - id: allowed
    hosts: [allowed.test]
    methods: [GET]
    inject:
      - header: Authorization
        value: "Bearer ${{secrets.token}}"
  - id: slow
    hosts: [slow.test]
    schemes: [http]
    ports: [80]
    methods: [GET]
"""


class SlowOrigin:
    """Plain HTTP that holds each request until `released` is set: a request in flight on demand."""

    def __init__(self, host: str, port: int):
        self.arrived, self.released = threading.Event(), threading.Event()
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                origin.arrived.set()
                origin.released.wait(60)
                body = b"slow but complete\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def make_ca(image: str, directory: Path, bin_dir: Path) -> None:
    """docker/kubernetes/make-ca.sh run with the image (EGRESS_IMAGE), `docker` being podman here."""
    bin_dir.mkdir()
    shim = bin_dir / "docker"
    shim.write_text("#!/bin/sh\nexec podman \"$@\"\n")
    shim.chmod(0o755)
    env = dict(pm.environment(), EGRESS_IMAGE=image, PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = subprocess.run(["bash", str(K8S / "make-ca.sh"), str(directory)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    for path in (directory, *directory.iterdir()):
        os.chown(path, GATEWAY_UID, GATEWAY_UID)


@pytest.fixture(scope="module")
def configured(gateway_image, tmp_path_factory):
    """The image with the deployments' mounts: a policy directory, a file secret, a CA made by
    make-ca.sh, the upstream CA to verify origins with; hardened as docker/compose.yaml runs it."""
    work = tmp_path_factory.mktemp("image")
    pki = TestPKI(work / "pki")
    (work / "policy").mkdir()
    (work / "policy" / "policy.yaml").write_text(POLICY)
    (work / "token").write_text(TOKEN)
    (work / "token").chmod(0o644)
    make_ca(gateway_image.ref, work / "ca", work / "bin")
    (work / "audit").mkdir()
    os.chown(work / "audit", GATEWAY_UID, GATEWAY_UID)
    ns = pm.Netns()
    servers, container = [], None
    try:
        with ns.inside():
            for name, address in (("allowed.test", ALLOWED), ("other.test", OTHER)):
                cert, key = pki.issue([name], [address], stem=name)
                servers.append(RecordingUpstream(name, address, 443, cert, key))
            servers.append(SlowOrigin(SLOW, 80))
        container = pm.Container(
            gateway_image.ref, "--network", ns.network,
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp:size=64m",
            "-v", f"{work / 'policy'}:/etc/egress-gateway/policy:ro",
            "-v", f"{work / 'token'}:/run/secrets/egress/token:ro",
            "-v", f"{work / 'ca'}:/var/lib/egress-gateway",
            "-v", f"{work / 'audit'}:/var/log/egress-gateway",
            "-v", f"{pki.ca_cert}:/etc/egress-gateway/upstream-ca.pem:ro",
            command=("--policy=/etc/egress-gateway/policy/policy.yaml", "--mode=regular@0.0.0.0:8080",
                     "--confdir=/var/lib/egress-gateway", "--audit-log=/var/log/egress-gateway/audit.jsonl",
                     "--metrics=0.0.0.0:9090", "--drain-timeout=20",
                     "--set", "ssl_verify_upstream_trusted_ca=/etc/egress-gateway/upstream-ca.pem"))
        wait_ready(container)
        yield {"ns": ns, "container": container, "work": work, "allowed": servers[0], "other": servers[1],
               "slow": servers[2]}
    finally:
        if container is not None:
            container.remove()
        for server in servers:
            server.stop()
        ns.delete()


def test_the_mounted_ca_and_secret_serve_an_allowed_request(configured):
    ca = configured["work"] / "ca" / "mitmproxy-ca-cert.pem"
    result = curl(configured["ns"], "https://allowed.test/hello", "--cacert", str(ca), "-w", " %{http_code}")
    assert result.stdout == "upstream allowed.test: GET /hello\n 200", result.stderr
    received = configured["allowed"].requests[-1]
    assert dict(received.headers)["Authorization"] == f"Bearer {TOKEN}"
    assert received.sni == "allowed.test"


def test_the_mounted_policy_refuses_another_host_with_403(configured):
    ca = configured["work"] / "ca" / "mitmproxy-ca-cert.pem"
    result = curl(configured["ns"], "https://other.test/", "--cacert", str(ca), "-w", "%{http_connect}")
    assert result.stdout == "403" and result.returncode != 0
    with configured["ns"].inside():  # the probe must connect from the origin's namespace
        configured["other"].settle()
    assert not configured["other"].touched


def test_a_restated_host_inside_the_tunnel_is_421(configured):
    ca = configured["work"] / "ca" / "mitmproxy-ca-cert.pem"
    before = len(configured["allowed"].requests)
    result = curl(configured["ns"], "https://allowed.test/", "--cacert", str(ca), "--http1.1", "-H", "Host: other.test",
                  "-o", "/dev/null", "-w", "%{http_code} %header{x-egress-reason}")
    assert result.stdout == "421 host_mismatch", result.stderr
    assert len(configured["allowed"].requests) == before


def test_every_decision_is_in_the_mounted_audit_log(configured):
    log = configured["work"] / "audit" / "audit.jsonl"

    def reasons():
        lines = audit_lines(log.read_text()) if log.exists() else []
        found = {(line["host"], line["status"], line["reason"], tuple(line.get("injected", ())))
                 for line in lines if line["event"] == "request" or line["decision"] == "deny"}
        return found >= {("allowed.test", None, "allowed", ("token",)), ("other.test", 403, "no_rule", ()),
                         ("allowed.test", 421, "host_mismatch", ())}
    wait_for(reasons, timeout=10, what="the three decisions in the audit log",
             detail=lambda: log.read_text() if log.exists() else "no audit log")


def test_sigterm_drains_the_request_in_flight_and_exits_0(configured):
    ns, container, slow = configured["ns"], configured["container"], configured["slow"]
    client = ns.popen("env", "-i", "PATH=/usr/bin:/bin", "curl", "-sS", "-m", "30", "-x", "http://127.0.0.1:8080",
                      "-w", " %{http_code}", "http://slow.test/slow")
    try:
        wait_for(slow.arrived.is_set, timeout=15, what="the request at the origin")
        container.kill("SIGTERM")
        wait_for(lambda: "draining" in container.logs(), timeout=15, what="the gateway draining",
                 detail=container.logs)
        slow.released.set()
        out, err = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
    assert out == "slow but complete\n 200", err
    assert container.wait(timeout=60) == 0, container.logs()
    assert "drained" in container.logs()


def test_the_netinit_image_is_built_too(netinit_image, record_property):
    """Its scripts run in namespaces in test_netinit.py; here its contents and size (on the Python
    base that stands in for debian:trixie-slim too, so larger than the real one by Python)."""
    size = images.image_size(netinit_image.ref)
    report(record_property, f"netinit image {netinit_image.ref}: {size / 1e6:.0f} MB; built in "
                            f"{netinit_image.seconds:.0f} s")
    found = pm.podman("run", "--rm", "--network", "none", "--entrypoint", "sh", netinit_image.ref, "-c",
                      "for t in iptables ip setpriv node-redirect shared-netns; do command -v $t; done").stdout.split()
    assert [Path(p).name for p in found] == ["iptables", "ip", "setpriv", "node-redirect", "shared-netns"]
    config = images.image_config(netinit_image.ref)["Config"]
    assert config["Entrypoint"] == ["/usr/local/sbin/node-redirect"] and config["Cmd"] == ["up"]
