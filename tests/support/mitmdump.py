"""`mitmdump -s addons/egress.py` as a test process, and the search for a secret in what it wrote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from mitmproxy.utils import strutils

from tests.credentials.clients import leaks
from tests.support.gateway import PROJECT_ROOT, free_port


def mitmdump_path() -> str:
    candidate = Path(sys.executable).with_name("mitmdump")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mitmdump")
    if not found:
        pytest.skip("mitmdump not installed next to this Python")
    return found


@dataclass
class Proxy:
    """What the test clients need of a proxy (tests.e2e.helpers take a GatewayProcess)."""
    host: str
    port: int
    confdir: Path
    log_path: Path

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without TLS key logging, plus `extra`, unbuffered."""
    env = {k: v for k, v in os.environ.items() if k not in ("SSLKEYLOGFILE", "MITMPROXY_SSLKEYLOGFILE")}
    return env | {"PYTHONUNBUFFERED": "1"} | extra


def start_mitmdump(workdir: Path, policy: Path, upstream_ca: Path, args: list[str],
                   env: dict[str, str]) -> tuple[subprocess.Popen, Proxy]:
    """mitmdump with the egress addons on a free loopback port; stdout and stderr go to
    workdir/mitmdump.out, the CA to workdir/conf. The addons are this checkout's: addons/egress.py
    imports the `addons` package, which would otherwise be whichever checkout is installed."""
    port = free_port()
    confdir = workdir / "conf"
    log_path = workdir / "mitmdump.out"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [mitmdump_path(), "-s", str(PROJECT_ROOT / "addons" / "egress.py"), "--listen-host", "127.0.0.1",
             "-p", str(port), "--set", f"confdir={confdir}", "--set", f"egress_policy={policy}",
             "--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}", *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            env=env | {"PYTHONPATH": os.pathsep.join(filter(None, (str(PROJECT_ROOT), env.get("PYTHONPATH"))))})
    return proc, Proxy("127.0.0.1", port, confdir, log_path)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def secret_forms_in(data: bytes, secret: str, piece: int = 12) -> list[str]:
    """Every way `secret` shows in `data`: the redactor's forms and independent decodings (leaks),
    the escapings a printer applies, and any `piece`-byte piece of the raw or URL-encoded value
    (what a cut line would show)."""
    found = leaks(data, secret)
    escaped = {repr(secret.encode())[2:-1], strutils.bytes_to_escaped_str(secret.encode()),
               json.dumps(secret)[1:-1], strutils.escape_control_characters(secret)}
    found += [f"escaped {e!r}" for e in escaped if e.encode() in data]
    for whole in (secret, quote_plus(secret), quote(secret, safe="")):
        pieces = {whole[i:i + piece] for i in range(len(whole) - piece + 1)}
        found += [f"piece {p!r}" for p in sorted(pieces) if p.encode() in data][:3]
    return found
