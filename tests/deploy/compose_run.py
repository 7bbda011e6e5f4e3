"""Run a Compose file's services with podman itself: networks, volumes and containers made from the
file, one `podman` command each, in depends_on order with its conditions.

Why not podman-compose: Debian's (1.0.3, bookworm) ignores what docker/compose.yaml relies on: the
networks' subnets and the services' ipv4_address (the gateway binds its proxy to its address on
the sandbox network, which then does not exist), and depends_on's conditions (ca-export would run
before the gateway has made its CA). So the file is read here (deployfiles.compose, with Compose's
variable interpolation) and every key it uses is translated; a key this module does not know
fails the run instead of being ignored, so a new key in a Compose file needs a decision here.

Not translated, on purpose (`DROPPED`): `build` (the image is built by tests/deploy/images.py),
`restart` (no daemon restarts anything during a test), healthcheck `start_interval` (podman 4.3
has no such option) and the bridge driver_opts, which are Docker's: podman has no bridge name
option and no `inhibit_ipv4`; networks are created with --disable-dns instead, which leaves an
internal network's bridge without a host address (test_compose_run.py checks it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.support.waiting import wait_for

from . import podman as pm

SERVICE_KEYS = {"image", "build", "cap_drop", "cap_add", "security_opt", "read_only", "tmpfs", "user", "command",
                "entrypoint", "environment", "healthcheck", "volumes", "secrets", "networks", "network_mode",
                "ports", "cpus", "mem_limit", "pids_limit", "ulimits", "stop_grace_period", "restart", "init",
                "depends_on", "profiles"}
NETWORK_KEYS = {"internal", "driver", "driver_opts", "ipam"}
DROPPED = {"build", "restart", "start_interval", "driver_opts"}


def _seconds(duration: str | int) -> int:
    if isinstance(duration, int):
        return duration
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, f"unsupported duration {duration!r}"
    return int(match[1])


class ComposeRun:
    """The services of one Compose document, as a podman project named `project`; relative paths
    are resolved against `directory` (where the file would be)."""

    def __init__(self, doc: dict, project: str, directory: Path, profiles: tuple[str, ...] = ()):
        self.doc, self.project, self.directory, self.profiles = doc, project, directory, profiles
        self.containers: list[str] = []
        self.networks: list[str] = []
        self.volumes: list[str] = []

    def name(self, service: str) -> str:
        return f"{self.project}-{service}"

    def active(self) -> list[str]:
        services = self.doc["services"]
        return [s for s, spec in services.items()
                if not spec.get("profiles") or set(spec["profiles"]) & set(self.profiles)]

    def order(self) -> list[str]:
        done: list[str] = []

        def visit(service: str, path: tuple = ()) -> None:
            assert service not in path, f"depends_on cycle: {path}"
            if service in done:
                return
            for dependency in self.doc["services"][service].get("depends_on", {}):
                visit(dependency, (*path, service))
            done.append(service)
        for service in self.active():
            visit(service)
        return done

    # --- up and down ------------------------------------------------------------------------------

    def up(self, timeout: float = 120) -> None:
        self._networks()
        self._volumes()
        for service in self.order():
            self._wait_for_dependencies(service, timeout)
            pm.podman("run", "-d", "--name", self.name(service), *self.run_args(service), timeout=60)
            self.containers.append(self.name(service))

    def down(self) -> None:
        for container in reversed(self.containers):
            pm.podman("rm", "--force", "--time", "0", "--volumes", container, check=False)
        for volume in self.volumes:
            pm.podman("volume", "rm", "--force", volume, check=False)
        for network in self.networks:
            pm.podman("network", "rm", "--force", network, check=False)

    def _networks(self) -> None:
        for key, spec in (self.doc.get("networks") or {}).items():
            spec = spec or {}
            unknown = set(spec) - NETWORK_KEYS
            assert not unknown, f"network {key}: keys not translated: {unknown}"
            assert spec.get("driver", "bridge") == "bridge"
            # Every address is fixed, so no DNS; and with podman's DNS server (aardvark-dns) an
            # internal network's bridge gets a host address the sandbox could reach the host on: the
            # hole Docker's inhibit_ipv4 closes. --disable-dns is podman's way to the same end.
            args = ["network", "create", "--disable-dns"]
            if spec.get("internal"):
                args.append("--internal")
            for config in (spec.get("ipam") or {}).get("config", []):
                args += ["--subnet", config["subnet"]]
            name = f"{self.project}_{key}"
            pm.podman(*args, name)
            self.networks.append(name)

    def _volumes(self) -> None:
        for key in self.doc.get("volumes") or {}:
            name = f"{self.project}_{key}"
            pm.podman("volume", "create", name)
            self.volumes.append(name)

    def _wait_for_dependencies(self, service: str, timeout: float) -> None:
        for dependency, spec in self.doc["services"][service].get("depends_on", {}).items():
            condition = (spec or {}).get("condition", "service_started")
            container = self.name(dependency)
            if condition == "service_healthy":
                wait_for(lambda: pm.podman("healthcheck", "run", container, check=False).returncode == 0,
                         timeout=timeout, interval=0.5, what=f"{dependency} healthy", detail=lambda: self.logs(dependency))
            elif condition == "service_completed_successfully":
                code = pm.podman("wait", container, timeout=timeout).stdout.split()[-1]
                assert code == "0", f"{dependency} exited with {code}:\n{self.logs(dependency)}"
            else:
                assert condition == "service_started", condition

    def logs(self, service: str) -> str:
        result = pm.podman("logs", self.name(service), check=False)
        return result.stdout + result.stderr

    def exec(self, service: str, *argv: str, timeout: float = 60):
        return pm.podman("exec", self.name(service), *argv, check=False, timeout=timeout)

    # --- one service ------------------------------------------------------------------------------

    def _path(self, source: str) -> str:
        return str((self.directory / source).resolve()) if source.startswith((".", "/")) else f"{self.project}_{source}"

    def run_args(self, service: str) -> list[str]:
        spec = self.doc["services"][service]
        unknown = set(spec) - SERVICE_KEYS
        assert not unknown, f"service {service}: keys not translated: {unknown}"
        args: list[str] = []
        if spec.get("network_mode"):
            args += ["--network", spec["network_mode"]]
        networks = spec.get("networks") or {}
        for network, options in (networks.items() if isinstance(networks, dict) else ((n, None) for n in networks)):
            address = (options or {}).get("ipv4_address")
            args += ["--network", f"{self.project}_{network}" + (f":ip={address}" if address else "")]
        for port in spec.get("ports", []):
            args += ["--publish", str(port)]
        for cap in spec.get("cap_drop", []):
            args += ["--cap-drop", cap]
        for cap in spec.get("cap_add", []):
            args += ["--cap-add", cap]
        for option in spec.get("security_opt", []):
            args += ["--security-opt", option.removesuffix(":true")]
        if spec.get("read_only"):
            args.append("--read-only")
        for mount in spec.get("tmpfs", []):
            args += ["--tmpfs", mount]
        if "user" in spec:
            args += ["--user", spec["user"]]
        if spec.get("init"):
            args.append("--init")
        for key, value in (spec.get("environment") or {}).items():
            args += ["--env", f"{key}={value}"]
        for volume in spec.get("volumes", []):
            source, target, *mode = volume.split(":")
            args += ["--volume", ":".join([self._path(source), target, *mode])]
        for secret in spec.get("secrets", []):
            declared = self.doc["secrets"][secret["source"]]
            args += ["--volume", f"{self._path(declared['file'])}:{secret['target']}:ro"]
        health = spec.get("healthcheck") or {}
        if health.get("disable"):
            args.append("--no-healthcheck")
        else:
            if "test" in health:
                args += ["--health-cmd", json.dumps(health["test"])]
            for key, flag in (("interval", "--health-interval"), ("timeout", "--health-timeout"),
                              ("start_period", "--health-start-period")):
                if key in health:
                    args += [flag, health[key]]
            if "retries" in health:
                args += ["--health-retries", str(health["retries"])]
        if "cpus" in spec:
            args += ["--cpus", str(spec["cpus"])]
        if "mem_limit" in spec:
            args += ["--memory", str(spec["mem_limit"])]
        if "pids_limit" in spec:
            args += ["--pids-limit", str(spec["pids_limit"])]
        ulimits = dict(spec.get("ulimits") or {})
        if ulimits:
            ulimits.setdefault("nproc", pm.nproc_limit())  # see pm.nproc_limit
        for name, limit in ulimits.items():
            soft, hard = (limit["soft"], limit["hard"]) if isinstance(limit, dict) else (limit, limit)
            args += ["--ulimit", f"{name}={soft}:{hard}"]
        if "stop_grace_period" in spec:
            args += ["--stop-timeout", str(_seconds(spec["stop_grace_period"]))]
        if "entrypoint" in spec:
            args += ["--entrypoint", json.dumps(spec["entrypoint"])]
        args.append(spec["image"])
        command = spec.get("command")
        if command:
            args += command if isinstance(command, list) else ["sh", "-c", command]
        return args
