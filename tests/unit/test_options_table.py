"""gateway/options.py is the one table of the gateway's options: every addon declares exactly the
rows that name it (and no option outside the table), `run`'s flags set the rows that name them, and
docs/options.md lists every row with its default."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.options import OPTIONS

ROOT = Path(__file__).resolve().parents[2]


# Made in a fresh interpreter: making the addons installs their patches (addons/patches.py), which
# must not leak into this test process.
DECLARED = r"""
import json
from addons.egress import make_addons

class RecordingLoader:
    def __init__(self):
        self.added = []

    def add_option(self, name, typespec, default, help, choices=None):
        self.added.append([name, typespec.__name__, default, help])

    def add_command(self, *args, **kwargs):
        pass

found = []
for addon in make_addons():
    if hasattr(addon, "load"):
        loader = RecordingLoader()
        addon.load(loader)
        found += [[type(addon).__module__, *entry] for entry in loader.added]
print(json.dumps(found))
"""


def declared_by_addon() -> dict[str, tuple[str, tuple]]:
    out = subprocess.run([sys.executable, "-c", DECLARED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found: dict[str, tuple[str, tuple]] = {}
    for module, name, typename, default, help_text in json.loads(out.stdout.strip().splitlines()[-1]):
        assert name not in found, f"{name} declared twice"
        found[name] = (module, (name, typename, default, help_text))
    return found


def test_every_row_is_declared_by_its_owner_with_the_tables_values():
    found = declared_by_addon()
    assert set(found) == set(OPTIONS)
    for name, (module, (_, typespec, default, help_text)) in found.items():
        option = OPTIONS[name]
        assert (module, typespec, default, help_text) == (option.owner, option.type.__name__, option.default, option.help)


def test_no_addon_declares_an_option_outside_the_table():
    callers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "addons").glob("*.py")
                     if "add_option(" in p.read_text(encoding="utf-8"))
    assert callers == ["addons/options.py"]


def test_defaults_have_the_declared_type():
    for option in OPTIONS.values():
        assert isinstance(option.default, option.type), option.name


def _docs_defaults() -> dict[str, str]:
    text = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    return {m[1]: m[2].strip() for m in re.finditer(r"^\| `(egress_[a-z0-9_]+)` \| ([^|]*) \|", text, re.M)}


def _said(default: object) -> str:
    if default == "":
        return "empty"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_docs_list_every_option_with_its_default(name):
    documented = _docs_defaults()
    assert name in documented, f"docs/options.md has no row for {name}"
    assert documented[name].split(" ")[0] == _said(OPTIONS[name].default), name


def test_docs_list_no_option_that_does_not_exist():
    assert set(_docs_defaults()) <= set(OPTIONS)


def test_each_flag_sets_its_row():
    import argparse

    from addons.run_command import operational_options, register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    flagged = {o.name: o.flag for o in OPTIONS.values() if o.flag}
    known = {flag for action in parser._subparsers._group_actions[0].choices["run"]._actions
             for flag in action.option_strings}
    assert set(flagged.values()) <= known
    args = parser.parse_args(["run", "--metrics", "127.0.0.1:9", "--audit-chain", "--audit-max-bytes", "7",
                              "--audit-backups", "3", "--drain-timeout", "1.5"])
    assert operational_options(args) == {"egress_metrics": "127.0.0.1:9", "egress_audit_chain": True,
                                         "egress_audit_max_bytes": 7, "egress_audit_backups": 3,
                                         "egress_drain_timeout": 1.5}
    defaults = parser.parse_args(["run"])
    assert defaults.audit_backups == OPTIONS["egress_audit_backups"].default
    assert defaults.drain_timeout == OPTIONS["egress_drain_timeout"].default


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_drain_timeout_must_be_a_finite_number_of_seconds(value):
    """Review 31: NaN passed `< 0` checks (egress_loop_share_burst=nan froze a worker); the drain
    timeout is refused the same way on the command line and as an option."""
    import argparse

    from mitmproxy import exceptions

    from addons.lifecycle import Lifecycle
    from addons.run_command import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--drain-timeout", value])
    from mitmproxy.test import taddons

    from addons.state import GatewayState
    lifecycle = Lifecycle(GatewayState())
    with taddons.context(lifecycle) as tctx:
        with pytest.raises(exceptions.OptionsError):
            tctx.configure(lifecycle, egress_drain_timeout=float(value))
        tctx.configure(lifecycle, egress_drain_timeout=2.5)  # a finite one is taken
