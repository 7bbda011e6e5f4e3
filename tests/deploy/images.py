"""The real images, built with podman from a clean copy of the committed tree, on a base bootstrapped
with mmdebstrap (no registry can be reached: nothing is pulled).

- The base stands in for python:3.12-slim and debian:trixie-slim: Debian trixie minbase (Python
  3.13; bookworm has only 3.11) with python3, python3-venv and ca-certificates, shaped like
  python:3.12-slim: `python` and `pip` on PATH (pip installed by pip, so that `pip uninstall pip`
  works as it does there), no EXTERNALLY-MANAGED marker. It is tagged with a hash of everything that
  goes into it and made only when that tag is missing.
- docker/Dockerfile is built as it is, with its PYTHON_IMAGE / DEBIAN_IMAGE build arguments pointing
  at the base, --pull=never, the Docker image format (the OCI format has no HEALTHCHECK) and
  docker/Dockerfile.dockerignore as the ignore file. podman keeps its layer cache in
  podman.STATE, so a second build of the same tree takes seconds.
- The host's CA bundle is mounted over the build containers' one for the build only (this machine's
  HTTPS to the package index may be intercepted); test_image checks that it is not in the image.

Builds run one at a time on a machine (a file lock), so parallel test workers share one build."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import podman as pm
from .deployfiles import ROOT

SUITE = "trixie"
MIRROR = os.environ.get("EGRESS_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "passwd")
DPKG_OPTIONS = ("path-exclude=/usr/share/doc/*", "path-exclude=/usr/share/man/*",
                "path-exclude=/usr/share/locale/*", "path-include=/usr/share/doc/*/copyright")
CUSTOMIZE_HOOKS = (
    'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
    # Debian disables ensurepip for its python; pip's own wheel installs pip with a RECORD.
    'chroot "$1" sh -c \'wheel=$(ls /usr/share/python-wheels/pip-*.whl) && '
    'python3 "$wheel/pip" install --no-index --no-cache-dir --root-user-action=ignore "$wheel"\'',
    'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
)
IMPORT_CHANGES = ("ENV=LANG=C.UTF-8", 'CMD=["python3"]')
BASE_REPOSITORY = "localhost/egress-gateway-test-base"
GATEWAY_REPOSITORY = "localhost/egress-gateway"
NETINIT_REPOSITORY = "localhost/egress-gateway-netinit"
KEEP_ENV = ("PATH", "LANG", "HOME", "TMPDIR", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY")


@dataclass
class Built:
    ref: str
    seconds: float
    cached: bool  # the tag existed already: nothing was built


def host_ca_bundle() -> Path | None:
    for candidate in (os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


@contextmanager
def build_lock():
    pm.STATE.mkdir(parents=True, exist_ok=True)
    with open(pm.STATE / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def image_exists(ref: str) -> bool:
    return pm.podman("image", "exists", ref, check=False).returncode == 0


def base_ref() -> str:
    inputs = json.dumps({"suite": SUITE, "mirror": MIRROR, "packages": PACKAGES, "dpkg": DPKG_OPTIONS,
                         "hooks": CUSTOMIZE_HOOKS, "changes": IMPORT_CHANGES}, sort_keys=True)
    return f"{BASE_REPOSITORY}:{hashlib.sha256(inputs.encode()).hexdigest()[:16]}"


def _bootstrap_command(tarball: Path) -> list[str]:
    command = ["mmdebstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
               "--aptopt=APT::Install-Recommends \"false\""]
    command += [f"--dpkgopt={option}" for option in DPKG_OPTIONS]
    command += [f"--customize-hook={hook}" for hook in CUSTOMIZE_HOOKS]
    return command + [SUITE, str(tarball), MIRROR]


def ensure_base() -> Built:
    """The bootstrapped base image, made only when no image has its inputs' hash."""
    ref = base_ref()
    started = time.monotonic()
    if image_exists(ref):
        return Built(ref, time.monotonic() - started, cached=True)
    with tempfile.TemporaryDirectory(prefix="egress-base-", dir=pm.STATE) as work:
        tarball = Path(work) / "rootfs.tar"
        # A clean environment: the host's PIP_* settings must not reach the chroot's pip.
        env = {k: v for k, v in os.environ.items() if k in KEEP_ENV}
        result = subprocess.run(_bootstrap_command(tarball), capture_output=True, text=True, env=env, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed ({result.returncode}):\n{result.stderr[-3000:]}")
        changes = [arg for change in IMPORT_CHANGES for arg in ("--change", change)]
        pm.podman("import", *changes, str(tarball), ref, timeout=300)
    return Built(ref, time.monotonic() - started, cached=False)


def committed_tree() -> str:
    """The tree of HEAD: what a fresh clone builds (uncommitted changes are not in the image)."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD^{tree}"], capture_output=True, text=True,
                          check=True).stdout.strip()


def export_tree(dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def prune_old_builds(repository: str, keep: str, days: int = 2) -> None:
    """Every commit tested makes new layers: drop this repository's images of other trees older than
    `days`, and dangling build-cache images as old (an image still in use is kept: rmi fails)."""
    listed = pm.podman("images", "--filter", f"reference={repository}:tree-*", "--filter", f"until={days * 24}h",
                       "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
    for ref in set(listed) - {keep}:
        pm.podman("rmi", ref, check=False)
    pm.podman("image", "prune", "--force", "--filter", f"until={days * 24}h", check=False)


def build(target: str, repository: str, base: str) -> Built:
    """`podman build --target TARGET` of the committed tree; tagged with the tree's hash."""
    ref = f"{repository}:tree-{committed_tree()[:16]}"
    prune_old_builds(repository, keep=ref)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="egress-context-") as context:
        export_tree(Path(context))
        command = ["build", "--format", "docker", "--pull=never", "--layers", "--target", target,
                   "-f", "docker/Dockerfile", "--ignorefile", "docker/Dockerfile.dockerignore",
                   "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"DEBIAN_IMAGE={base}", "-t", ref]
        bundle = host_ca_bundle()
        if bundle is not None:
            command += ["--volume", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"]
        pm.podman(*command, ".", cwd=context, timeout=900)
    return Built(ref, time.monotonic() - started, cached=False)


def image_size(ref: str) -> int:
    return int(pm.podman("image", "inspect", ref, "--format", "{{.Size}}").stdout.strip())


def image_config(ref: str) -> dict:
    return json.loads(pm.podman("image", "inspect", ref).stdout)[0]


def unavailable_reason() -> str | None:
    reason = pm.unavailable_reason()
    if reason is None and not (ROOT / ".git").exists():
        reason = "the image is built from the committed tree: this is not a git checkout"
    if reason is None and shutil.which("tar") is None:
        reason = "`tar` is not installed"
    return reason
