"""docker/compose.yaml (explicit proxy) and docker/compose.transparent.yaml (transparent) validate
against the Compose Specification's JSON schema (vendored in schemas/, see schemas/README.md), and
keep the promises a schema cannot check: the sandbox's only way out is the gateway, it never sees
the CA key, metrics are published on the host's loopback only, the gateway accepts its command."""

from __future__ import annotations

import copy
import json
import posixpath
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from gateway.policy import load_policy

from .deployfiles import (
    COMPOSE_FILES, DOCKER, GATEWAY_UID, METRICS_PORT, SCHEMAS, compose, compose_raw, flag, host_port, interpolate,
    parse_run,
)

EXPLICIT, TRANSPARENT = COMPOSE_FILES


@pytest.fixture(scope="module")
def validator():
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_the_compose_file_validates_against_the_compose_specification(path, validator):
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose_raw(path))]
    assert not errors


@pytest.mark.parametrize("mutate", [
    lambda c: c["services"]["sandbox"].update(cap_dropp=["ALL"]),
    lambda c: c["networks"].update(egress={"internall": True}),
    lambda c: c["services"]["sandbox"]["depends_on"]["gateway"].update(condition="service_ready"),
])
def test_the_schema_catches_mistakes(mutate, validator):
    doc = copy.deepcopy(compose_raw(EXPLICIT))
    mutate(doc)
    assert list(validator.iter_errors(doc))


def test_interpolation_defaults_and_overrides():
    assert interpolate("${A:-x}") == "x" and interpolate("${A:-x}", {"A": ""}) == "x"
    assert interpolate("${A-x}", {"A": ""}) == "" and interpolate("a${A}b", {"A": "1"}) == "a1b"


def _gateway_args(path) -> list[str]:
    return compose(path)["services"]["gateway"]["command"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_the_gateway_accepts_its_command_and_runs_hardened(path):
    services = compose(path)["services"]
    gateway = services["gateway"]
    parsed = parse_run(_gateway_args(path))
    assert parsed.audit_chain and parsed.audit_log.startswith("/var/log/egress-gateway/")
    assert parsed.confdir == "/var/lib/egress-gateway"
    assert parsed.workers == float(gateway["cpus"])  # one worker per core it may use
    assert interpolate(compose_raw(path), {"EGRESS_WORKERS": "4"})["services"]["gateway"]["cpus"] == "4"
    assert gateway["user"] == f"{GATEWAY_UID}:{GATEWAY_UID}"
    assert gateway["cap_drop"] == ["ALL"] and "cap_add" not in gateway
    assert gateway["read_only"] is True and any(t.startswith("/tmp") for t in gateway["tmpfs"])
    assert "no-new-privileges:true" in gateway["security_opt"]
    volumes = {v.split(":")[1]: v for v in gateway["volumes"]}
    assert set(volumes) >= {"/var/lib/egress-gateway", "/var/log/egress-gateway"}  # the image's volumes
    build = gateway["build"]
    assert build["context"] == ".." and (DOCKER.parent / build["dockerfile"]).exists()
    assert build["target"] == "runtime"
    assert int(gateway["stop_grace_period"].rstrip("s")) > parsed.drain_timeout


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_the_policy_is_mounted_read_only_as_a_directory_and_loads(path):
    gateway = compose(path)["services"]["gateway"]
    policy = flag(_gateway_args(path), "policy")[0]
    directory, name = posixpath.split(policy)
    mount = next(v for v in gateway["volumes"] if v.split(":")[1] == directory)
    source, _, mode = mount.split(":")
    assert mode == "ro"
    host_dir = (path.parent / source).resolve()
    assert host_dir.is_dir()  # a directory: an editor's rename-into-place is seen
    loaded = load_policy(str(host_dir / name))
    # The policy's secret files are the compose secrets' targets.
    targets = {s["target"] for s in gateway["secrets"]}
    files = {s.file for s in loaded.secrets.values() if getattr(s, "file", None)}
    assert files and files <= targets
    declared = compose(path)["secrets"]
    for secret in gateway["secrets"]:
        assert secret["source"] in declared and "file" in declared[secret["source"]]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_metrics_are_published_on_the_hosts_loopback_only_and_health_checks_use_them(path):
    services = compose(path)["services"]
    gateway = services["gateway"]
    host, port = host_port(flag(_gateway_args(path), "metrics")[0])
    assert port == METRICS_PORT and host not in ("0.0.0.0", "::", "127.0.0.1")
    owner = services[gateway["network_mode"].split(":", 1)[1]] if "network_mode" in gateway else gateway
    assert owner["networks"]["egress"]["ipv4_address"] == host  # the egress side, never the sandbox's
    published = [p for s in services.values() for p in s.get("ports", [])]
    for mapping in published:
        assert mapping.startswith("127.0.0.1:"), mapping
    assert f"127.0.0.1:{METRICS_PORT}:{METRICS_PORT}" in owner["ports"]
    assert gateway["environment"]["EGRESS_HEALTHCHECK_URL"] == f"http://{host}:{port}/readyz"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_the_sandbox_gets_the_ca_certificate_never_the_confdir(path):
    services = compose(path)["services"]
    sandbox = services["sandbox"]
    assert all(not v.startswith("gateway-ca:") for v in sandbox.get("volumes", []))
    export = services["ca-export"]
    assert "gateway-ca:/var/lib/egress-gateway:ro" in export["volumes"]
    assert export["network_mode"] == "none" and export["cap_add"] == ["DAC_READ_SEARCH"]
    script = export["command"][0]
    assert "mitmproxy-ca-cert.pem" in script and "mitmproxy-ca.pem" not in script  # never the key
    assert sandbox["depends_on"]["ca-export"]["condition"] == "service_completed_successfully"
    for variable in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT"):
        assert sandbox["environment"][variable].startswith("/etc/egress-ca/")
    assert sandbox["cap_drop"] == ["ALL"] and "no-new-privileges:true" in sandbox["security_opt"]
    assert not sandbox.get("cap_add") and not sandbox.get("privileged")
    assert "ports" not in sandbox


def test_the_explicit_sandbox_is_only_on_the_internal_network():
    config = compose(EXPLICIT)
    services = config["services"]
    sandbox = services["sandbox"]
    assert sandbox["networks"] == ["sandbox"] and "network_mode" not in sandbox
    network = config["networks"]["sandbox"]
    assert network["internal"] is True
    assert network["driver_opts"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    members = [name for name, s in services.items() if "sandbox" in (s.get("networks") or [])]
    assert sorted(members) == ["gateway", "sandbox"]
    # The proxy listens on the gateway's sandbox-network address, which the sandbox's variables name.
    gateway_ip = services["gateway"]["networks"]["sandbox"]["ipv4_address"]
    (mode,) = flag(_gateway_args(EXPLICIT), "mode")
    assert mode == f"regular@{gateway_ip}:8080"
    for variable in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert sandbox["environment"][variable] == f"http://{gateway_ip}:8080"
    assert not config["networks"]["egress"].get("internal")


def test_the_transparent_sandbox_shares_the_redirected_namespace_and_cannot_undo_it():
    config = compose(TRANSPARENT)
    services = config["services"]
    holder = services["gateway-netns"]
    for name in ("gateway", "sandbox"):
        assert services[name]["network_mode"] == "service:gateway-netns", name
    sandbox = services["sandbox"]
    assert sandbox.get("user") in (None, "root", "0", "0:0") or not str(sandbox["user"]).startswith(str(GATEWAY_UID))
    assert not any(k.lower().endswith("_proxy") for k in sandbox["environment"])
    # The rules exempt exactly the gateway's user, and redirect to exactly its listeners.
    env = holder["environment"]
    assert services["gateway"]["user"].split(":")[0] == env["GATEWAY_UID"]
    modes = {m.split("@")[0]: host_port(m) for m in flag(_gateway_args(TRANSPARENT), "mode")}
    assert modes == {"transparent": ("127.0.0.1", int(env["PROXY_PORT"])), "dns": ("127.0.0.1", int(env["DNS_PORT"]))}
    assert env["REDIRECT_TCP_PORTS"].split() == ["80", "443"]
    assert holder["cap_add"] == ["NET_ADMIN"] and holder["cap_drop"] == ["ALL"]
    assert holder["command"] == ["hold"] and holder["entrypoint"] == ["/usr/local/sbin/shared-netns"]
    assert holder["healthcheck"]["test"] == ["CMD", "/usr/local/sbin/shared-netns", "check"]
    assert services["gateway"]["depends_on"]["gateway-netns"]["condition"] == "service_healthy"
    assert holder["sysctls"]["net.ipv6.conf.all.disable_ipv6"] == 1
    assert holder["build"]["target"] == "netinit"
    assert list(holder["networks"]) == ["egress"]


def test_prometheus_scrapes_the_explicit_gateways_metrics_address():
    config = compose(EXPLICIT)
    prometheus = config["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"] and prometheus["networks"] == ["egress"]
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "egress-gateway")
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    assert flag(_gateway_args(EXPLICIT), "metrics")[0] in targets


def test_secret_files_are_git_ignored():
    ignore = (DOCKER / "secrets" / ".gitignore").read_text().split()
    assert ignore[0] == "*" and "!.gitignore" in ignore
    for path in COMPOSE_FILES:
        for secret in compose(path)["secrets"].values():
            assert secret["file"].startswith("./secrets/")


def _compose_command() -> list[str] | None:
    """Docker Compose v2 if this machine has it (`docker compose` or a docker-compose binary)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    if standalone:
        version = subprocess.run([standalone, "version"], capture_output=True, text=True).stdout
        if "v2." in version:
            return [standalone]
    return None


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_itself_accepts_the_file(path):
    """Compose's own loader (no engine needed for `config`): conflicts a schema cannot see, such as
    network_mode next to networks, or references to undefined secrets, networks and volumes."""
    command = _compose_command()
    if command is None:
        pytest.skip("Docker Compose v2 is not installed (the schema checks above still ran)")
    result = subprocess.run([*command, "-f", str(path), "--profile", "monitoring", "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
