"""addons/patches.py is the whole list of what the gateway changes in mitmproxy and asyncio: made
in a fresh interpreter, the addons change exactly the rows of its table (no more, no fewer), and
an untested mitmproxy is refused with a reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from addons.patches import PATCHES, UNTESTED_ENV, UntestedMitmproxy, check_mitmproxy_version

ROOT = Path(__file__).resolve().parents[2]

# Snapshot every attribute of every mitmproxy module, of asyncio's and of the protocol libraries'
# (and of the classes defined there), make
# the addons (and, for `run --workers N`, share the listening ports), and print what changed.
DIFF = r"""
import importlib, inspect, json, pkgutil, sys
import mitmproxy
modules = sorted({m.name for m in pkgutil.walk_packages(mitmproxy.__path__, "mitmproxy.")
                  if not m.name.startswith(("mitmproxy.tools", "mitmproxy.contrib", "mitmproxy.test"))}
                 | {"asyncio.events", "asyncio.base_events", "asyncio.selector_events", "asyncio.streams",
                    "wsproto.connection", "h2.connection", "h11._connection"})
def snapshot():
    seen = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # optional parts (a platform's redirector)
            continue
        for key, value in list(vars(module).items()):
            if inspect.ismodule(value) and value.__name__ == f"{name}.{key}":
                continue  # a submodule imported later appears on its package: not a change
            seen[f"{name}:{key}"] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for attr, inner in list(vars(value).items()):
                    seen[f"{name}:{key}.{attr}"] = id(inner)
    return seen
before = snapshot()
from addons.egress import make_addons
make_addons()
middle = snapshot()
from addons.runner import share_listen_ports
share_listen_ports()
after = snapshot()
def changed(a, b):
    # a replaced class shows as its own name changing; what it contains is its business
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                  and not (k.count(".") and k.rsplit(".", 1)[0] in a and a.get(k.rsplit(".", 1)[0]) != b.get(k.rsplit(".", 1)[0])))
print(json.dumps({"addons": changed(before, middle), "workers": changed(middle, after)}))
"""


@pytest.fixture(scope="module")
def changes() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", DIFF], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_addons_change_exactly_the_table(changes):
    listed = {patch.target for patch in PATCHES if patch.when == "always"}
    assert set(changes["addons"]) == listed


def test_workers_change_exactly_their_rows(changes):
    listed = {patch.target for patch in PATCHES if patch.when == "run --workers N"}
    assert set(changes["workers"]) == listed


def test_every_row_names_an_owner_that_exists_and_a_reason():
    for patch in PATCHES:
        assert patch.why
        for owner in patch.owner.split(", "):
            assert (ROOT / (owner.replace(".", "/") + ".py")).is_file(), patch


@pytest.mark.parametrize("version", ["12.3.0", "12.3.1", "12.3.99"])
def test_a_tested_mitmproxy_starts(version):
    check_mitmproxy_version(version)


@pytest.mark.parametrize("version", ["12.2.2", "12.4.0", "13.0.0", "11.1.3", "garbage"])
def test_an_untested_mitmproxy_is_refused_with_the_reason(version, monkeypatch):
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    with pytest.raises(UntestedMitmproxy, match=rf"mitmproxy {version} is not a version .* {UNTESTED_ENV}=1"):
        check_mitmproxy_version(version)


def test_an_untested_mitmproxy_may_be_tried_on_purpose(monkeypatch):
    monkeypatch.setenv(UNTESTED_ENV, "1")
    check_mitmproxy_version("13.0.0")


def test_the_run_command_refuses_an_untested_mitmproxy(tmp_path):
    code = ("import sys, addons.patches as p, addons.runner as r\n"
            "r.check_mitmproxy_version = lambda: p.check_mitmproxy_version('13.0.0')\n"
            "sys.exit(r.prepare_confdir(sys.argv[1]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "egress-gateway: mitmproxy 13.0.0 is not a version" in out.stderr
    assert not (tmp_path / "mitmproxy-ca.pem").exists()  # nothing made before the refusal
