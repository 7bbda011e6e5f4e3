"""addons/run_command.py `_PolicyWatch`: the supervisor of `run --workers N` validates control
requests and explains by the policy the workers run: it re-reads the file when they do (every
egress_policy_poll seconds, and on SIGHUP), and with polling off only on SIGHUP (review 26: it
polled anyway, and explained by a policy no worker had loaded)."""

from __future__ import annotations

import argparse
import os

from addons.run_command import _PolicyWatch, _policy_poll
from gateway.policy import load_policy

ONE = "version: 1\nrules:\n  - id: one\n    hosts: [one.test]\n"
TWO = "version: 1\nrules:\n  - id: two\n    hosts: [two.test]\n"


def _edit(path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a change the stat sees


def test_with_polling_off_the_file_is_read_again_only_on_sighup(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(ONE)
    watch = _PolicyWatch(str(path), load_policy(str(path)), poll=0)
    _edit(path, TWO)
    assert [r.id for r in watch().rules] == ["one"]  # the workers have not loaded it either
    watch.reload()  # SIGHUP
    assert [r.id for r in watch().rules] == ["two"]


def test_with_polling_on_a_change_is_seen_and_an_invalid_file_keeps_the_old_policy(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(ONE)
    watch = _PolicyWatch(str(path), load_policy(str(path)), poll=1)
    _edit(path, TWO)
    assert [r.id for r in watch().rules] == ["two"]
    _edit(path, "version: 1\nrules: [")
    watch._checked = 0.0
    assert [r.id for r in watch().rules] == ["two"]


def test_the_poll_interval_is_the_workers_option():
    assert _policy_poll(argparse.Namespace(setoptions=["egress_policy_poll=0"])) == 0
    assert _policy_poll(argparse.Namespace(setoptions=["other=1", "egress_policy_poll = 5"])) == 5
    assert _policy_poll(argparse.Namespace(setoptions=[])) == 2
