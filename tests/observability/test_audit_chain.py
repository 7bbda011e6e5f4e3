"""The audit log's operational features, in process: hash chaining, size rotation, reopen, and
`egress-gateway audit verify` catching each kind of tampering."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway.audit import FIELDS, GENESIS, AuditLog, line_hash, verify_chain

from .conftest import PROJECT_ROOT


def write_chain(path, count: int, **options) -> AuditLog:
    log = AuditLog(str(path), chain=True, **options)
    for i in range(count):
        log.record(event="request", decision="allow" if i % 2 else "deny", reason="no_rule", path=f"/{i}")
    return log


def lines(path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def verify_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "audit", "verify", *map(str, args)],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=30)


def test_each_line_carries_the_hash_of_the_previous_one(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write_chain(path, 5)
    log.close()
    raw = lines(path)
    assert len(raw) == 5
    records = [json.loads(line) for line in raw]
    assert records[0]["prev"] == GENESIS
    for before, line in zip(raw, records[1:]):
        assert line["prev"] == line_hash(before)
    # stable keys: the documented fields first, in order, then event keys, "prev" always last
    assert list(records[0])[: len(FIELDS)] == list(FIELDS)
    assert list(records[0])[-1] == "prev"
    assert log.head == line_hash(raw[-1])
    report = verify_chain([str(path)])
    assert report.ok and report.lines == 5 and report.head == log.head


def test_appending_continues_the_chain_of_the_existing_file(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_chain(path, 3).close()
    write_chain(path, 2).close()  # a restarted gateway
    assert verify_chain([str(path)]).lines == 5


def test_a_cut_short_last_line_is_closed_and_stays_visible(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_chain(path, 3).close()
    with open(path, "ab") as f:
        f.write(b'{"time":"2026-01-01T00:00:00.000Z","event":"req')  # a crash mid-write
    write_chain(path, 2).close()
    raw = lines(path)
    assert len(raw) == 6 and raw[3].endswith(b'"event":"req')
    report = verify_chain([str(path)])
    assert not report.ok and report.line == 4 and "not a JSON object" in report.problem


def test_caller_cannot_forge_the_chain_key(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), chain=True)
    log.record(event="request", prev="f" * 64)
    log.close()
    assert json.loads(lines(path)[0])["prev"] == GENESIS
    assert lines(path)[0].count(b'"prev"') == 1


def test_chain_can_be_turned_on_after_opening(tmp_path):
    # the gateway opens the log (AuditLogOwner) and may then turn the chain on (a later configure)
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path))
    log.configure(chain=True, max_bytes=0, backups=3)
    log.record(event="a")
    log.close()
    assert json.loads(lines(path)[0])["prev"] == GENESIS


@pytest.mark.parametrize("tamper", ["edit", "edit_keeping_json_shape", "drop", "reorder", "insert", "drop_first"])
def test_verify_reports_the_first_bad_line(tmp_path, tamper):
    path = tmp_path / "audit.jsonl"
    write_chain(path, 8).close()
    raw = lines(path)
    expected_line = {"edit": 5, "edit_keeping_json_shape": 5, "drop": 4, "reorder": 4, "insert": 5,
                     "drop_first": 1}[tamper]
    if tamper == "edit":
        raw[3] = raw[3].replace(b'"decision":"allow"', b'"decision":"deny"')  # a forged verdict
    elif tamper == "edit_keeping_json_shape":
        raw[3] = raw[3].replace(b'"path":"/3"', b'"path":"/x"')
    elif tamper == "drop":
        del raw[3]
    elif tamper == "reorder":
        raw[3], raw[4] = raw[4], raw[3]
    elif tamper == "insert":
        forged = json.loads(raw[3])
        forged["path"] = "/forged"
        raw.insert(4, json.dumps(forged, separators=(",", ":")).encode())  # prev copied from a real line
    elif tamper == "drop_first":
        del raw[0]
    path.write_bytes(b"\n".join(raw) + b"\n")
    report = verify_chain([str(path)])
    assert not report.ok
    assert report.line == expected_line, report.describe()
    if tamper in ("edit", "reorder"):  # the command line says the same (one process start each: ~0.5 s)
        result = verify_cli(path)
        assert result.returncode == 1, result
        assert result.stdout.startswith(f"{path}:{expected_line}: "), result.stdout


def test_verify_truncation(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_chain(path, 4).close()
    data = path.read_bytes()
    full_head = line_hash(lines(path)[-1])
    # a last line cut short (no newline) is reported
    path.write_bytes(data[:-10])
    report = verify_chain([str(path)])
    assert not report.ok and report.line == 4 and "incomplete" in report.problem
    # whole lines removed from the end leave a valid shorter chain: detectable only against a head
    # recorded earlier
    path.write_bytes(b"\n".join(data.split(b"\n")[:3]) + b"\n")
    assert verify_chain([str(path)]).ok
    report = verify_chain([str(path)], expect_head=full_head)
    assert not report.ok and "expected" in report.problem
    assert verify_cli("--expect-head", full_head, path).returncode == 1


def test_verify_cli_ok_and_unreadable(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write_chain(path, 3)
    log.close()
    result = verify_cli(path)
    assert result.returncode == 0, result
    assert f"ok: 3 lines, chain head {log.head}" in result.stdout
    assert verify_cli("--expect-head", log.head, path).returncode == 0
    assert verify_cli(tmp_path / "missing.jsonl").returncode == 2


def test_unchained_lines_are_reported(tmp_path):
    path = tmp_path / "audit.jsonl"
    AuditLog(str(path)).record(event="plain")
    report = verify_chain([str(path)])
    assert not report.ok and report.line == 1 and "not chained" in report.problem


def test_size_rotation_keeps_k_backups_and_one_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write_chain(path, 40, max_bytes=2000, backups=2)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    for name in files:
        size = (tmp_path / name).stat().st_size
        assert 0 < size <= 2000, (name, size)
    assert log.rotations > 2  # older files were dropped
    ordered = [str(tmp_path / n) for n in ("audit.jsonl.2", "audit.jsonl.1", "audit.jsonl")]
    # the oldest kept file continues a chain whose start was rotated away
    report = verify_chain(ordered)
    assert not report.ok and report.line == 1 and "does not start here" in report.problem
    report = verify_chain(ordered, partial=True)
    assert report.ok, report.describe()
    assert report.head == log.head
    # out of order: the link between files breaks
    report = verify_chain([ordered[1], ordered[0], ordered[2]], partial=True)
    assert not report.ok
    assert verify_cli("--partial", *ordered).returncode == 0


def test_rotation_with_one_backup_and_no_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), max_bytes=600, backups=1)
    for i in range(20):
        log.record(event="request", path=f"/{i}")
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.jsonl.1"]
    last = [json.loads(line)["path"] for line in lines(path)]
    previous = [json.loads(line)["path"] for line in lines(tmp_path / "audit.jsonl.1")]
    assert last[-1] == "/19" and previous[-1] == f"/{int(last[0][1:]) - 1}"


def test_reopen_after_move_continues_the_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write_chain(path, 3)
    path.rename(tmp_path / "audit.jsonl.1")
    log.record(event="late")  # still the moved file
    log.reopen()
    log.record(event="new")
    log.close()
    assert len(lines(tmp_path / "audit.jsonl.1")) == 4
    assert len(lines(path)) == 1
    assert verify_chain([str(tmp_path / "audit.jsonl.1"), str(path)]).ok


def test_invalid_rotation_settings(tmp_path):
    with pytest.raises(ValueError):
        AuditLog(str(tmp_path / "a"), max_bytes=-1)
    with pytest.raises(ValueError):
        AuditLog(str(tmp_path / "b"), backups=0)
