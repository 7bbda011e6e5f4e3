"""The deployment files parse and refer to things that exist (no Docker engine runs here, so this
is what can be checked: syntax, paths, the CLI flags they use)."""

from pathlib import Path

import yaml

from gateway.cli import _parser

ROOT = Path(__file__).resolve().parents[2]


def _run_args(args: list[str]) -> None:
    parsed = _parser().parse_args(args)
    assert parsed.command == "run"


def test_compose_file_parses_and_its_gateway_command_is_valid():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    assert gateway["build"]["context"] == ".."  # relative to docker/: the project root
    assert (ROOT / gateway["build"]["dockerfile"]).exists()
    _run_args(gateway["command"])
    assert compose["networks"]["sandbox"]["internal"] is True
    assert "sandbox" in compose["services"]["sandbox"]["networks"]
    assert "egress" not in compose["services"]["sandbox"]["networks"]


def test_kubernetes_manifests_parse_and_the_container_args_are_valid():
    documents = [d for d in yaml.safe_load_all((ROOT / "docker" / "kubernetes" / "gateway.yaml").read_text()) if d]
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service", "NetworkPolicy"} <= kinds
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    _run_args(container["args"])
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_dockerfile_copies_what_exists():
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
