"""Readers for the deployment files in docker/: Kubernetes manifests and what kustomization.yaml
generates, Compose files with their variables interpolated, Dockerfile stages, and the gateway's
own command-line parser to check the arguments they pass. No cluster, no Docker, no network."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
COMPOSE_FILES = (DOCKER / "compose.yaml", DOCKER / "compose.transparent.yaml")

GATEWAY_UID = 10001
METRICS_PORT = 9090
SANDBOX_LABEL = ("egress-gateway/sandbox", "true")


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# --- Kubernetes -----------------------------------------------------------------------------------


@cache
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@cache
def resources() -> tuple[tuple[str, dict], ...]:
    """(file name, document) for every document of every file kustomization.yaml lists."""
    return tuple((name, doc) for name in kustomization()["resources"] for doc in load_documents(K8S / name))


def _generated_data(files: list[str]) -> dict[str, str]:
    data = {}
    for entry in files:
        key, _, source = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        path = K8S / source
        # ca/ and secrets/ are the operator's (git-ignored); a stand-in keeps the object's shape.
        data[key] = path.read_text() if path.exists() else f"stand-in for {source}\n"
    return data


@cache
def generated() -> tuple[dict, ...]:
    """The ConfigMaps and Secrets kustomization.yaml generates, as kustomize would (names without
    the content hash: references are checked by name)."""
    out = []
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in kustomization().get(key, []):
            doc = {"apiVersion": "v1", "kind": kind,
                   "metadata": {"name": gen["name"], "namespace": gen["namespace"]}}
            if kind == "Secret":
                doc["type"] = gen.get("type", "Opaque")
                doc["stringData"] = _generated_data(gen.get("files", []))
            else:
                doc["data"] = _generated_data(gen.get("files", []))
            out.append(doc)
    return tuple(out)


def all_objects() -> list[dict]:
    return [doc for _, doc in resources()] + list(generated())


def objects(kind: str) -> list[dict]:
    return [doc for doc in all_objects() if doc["kind"] == kind]


def one(kind: str, name: str | None = None) -> dict:
    found = [doc for doc in objects(kind) if name is None or doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def workloads() -> list[dict]:
    return objects("Deployment") + objects("DaemonSet")


def containers(workload: dict, init: bool = True) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return (spec.get("initContainers", []) if init else []) + spec["containers"]


def gateway_container(workload: dict) -> dict:
    return next(c for c in containers(workload, init=False) if c["name"] == "gateway")


def cpu_cores(quantity: str) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would resolve it (downward API: stand-ins for
    the node's address; resourceFieldRef: the container's own resources)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = {"status.hostIP": "192.0.2.10", "status.podIP": "192.0.2.20"}.get(
                source["fieldRef"]["fieldPath"], "stand-in")
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref.get("containerName", container["name"]) == container["name"]
            kind, _, resource = ref["resource"].partition(".")
            value = container["resources"][kind][resource]
            env[var["name"]] = str(math.ceil(cpu_cores(value) / cpu_cores(ref.get("divisor", "1"))))
        else:
            env[var["name"]] = "stand-in"
    return env


def expand_k8s(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in command/args, as the kubelet expands it (unknown references stay as they are)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in args]


# --- Compose --------------------------------------------------------------------------------------


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, recursively, with VAR unset by default."""
    env = env or {}
    if isinstance(value, dict):
        return {interpolate(k, env): interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name, op, default = match["name"], match["op"], match["default"] or ""
        if name in env and (env[name] or op != ":-"):
            return env[name]
        return default if op else ""

    return re.sub(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}", substitute, value)


@cache
def compose_raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def compose(path: Path) -> dict:
    return interpolate(compose_raw(path))


# --- Dockerfile -----------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def all(self, instruction: str) -> list[str]:
        return [args for inst, args in self.instructions if inst == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped, as the
    Dockerfile parser does (a comment line inside a continued instruction is removed)."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            inst, _, args = current.strip().partition(" ")
            out.append((inst.upper(), args.strip()))
        current = ""
    return out


def dockerfile_stages(path: Path = DOCKER / "Dockerfile") -> list[Stage]:
    stages: list[Stage] = []
    for inst, args in dockerfile_instructions(path.read_text()):
        if inst == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append((inst, args))
    return stages


def exec_form(args: str) -> list[str]:
    """An instruction's arguments as a list: JSON (exec) form, or shell words."""
    args = args.strip()
    if args.startswith("["):
        return yaml.safe_load(args)
    return shlex.split(args)


# --- The gateway's command line -------------------------------------------------------------------


def parse_run(args: list[str]):
    """Parse `egress-gateway run ARGS` with the gateway's own parser (SystemExit on a bad flag)."""
    from gateway.cli import _parser

    parsed = _parser().parse_args(["run", *args])
    assert parsed.command == "run"
    return parsed


def flag(args: list[str], name: str) -> list[str]:
    """Every value of --NAME=VALUE / --NAME VALUE in args."""
    values = []
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            values.append(arg.split("=", 1)[1])
        elif arg == f"--{name}" and i + 1 < len(args):
            values.append(args[i + 1])
    return values


def host_port(spec: str) -> tuple[str, int]:
    """'regular@0.0.0.0:8080' or '0.0.0.0:9090' -> ('0.0.0.0', 8080)."""
    address = spec.split("@", 1)[-1]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
