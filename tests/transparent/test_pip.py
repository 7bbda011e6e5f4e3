"""`pip download` from inside a sandbox with no proxy settings: a tiny PEP 503 index (pypi.test,
HTTPS, in the internet namespace) reached through the gateway's DNS and transparent listener."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .clients import PYTHON
from tests.support.topology import PYPI

pytestmark = pytest.mark.netns


@pytest.fixture
def download_dir():
    with tempfile.TemporaryDirectory(prefix="egress-pip-") as path:
        yield Path(path)


def test_pip_download_through_the_transparent_gateway(topology, main, download_dir):
    index = topology.server(f"{PYPI}:443")
    out = download_dir
    mark = main.audit_mark()
    result = main.sandbox.exec(
        [PYTHON, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
         "--retries", "0", "--timeout", "10", "--index-url", "https://pypi.test/simple/", "--cert", main.ca,
         "-d", out, index.project],
        timeout=90, PIP_CONFIG_FILE="/dev/null", PIP_NO_INPUT="1")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert (out / index.wheel_name).read_bytes() == index.wheel
    paths = [path for path, _sni in index.requests]
    assert paths == [f"/simple/{index.project}/", f"/packages/{index.wheel_name}"], index.requests
    assert {sni for _path, sni in index.requests} == {"pypi.test"}
    assert topology.touched() == [f"{PYPI}:443"]
    requests = main.audit_since(mark, event="request")
    assert {(e["host"], e["mode"], e["decision"]) for e in requests} == {("pypi.test", "transparent", "allow")}
