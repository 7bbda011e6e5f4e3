"""AuditLog: one JSON object per line, stable keys, clipping, rotation."""

from __future__ import annotations

import json
import re

import pytest

from gateway.audit import FIELDS, MAX_VALUE_LENGTH, AuditLog, now_rfc3339

RFC3339_MS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


def read_lines(path) -> list[str]:
    data = path.read_bytes().decode("utf-8")
    assert data.endswith("\n")
    return data[:-1].split("\n")


DOCUMENTED = (
    "time", "event", "client", "mode", "decision", "reason", "status", "rule", "host", "port", "address",
    "original_destination", "sni", "host_header", "method", "scheme", "path", "message",
)


def test_fields_are_stable():
    # keys may be added, never removed or reordered
    assert FIELDS[0] == "time"
    assert len(FIELDS) == len(set(FIELDS))
    assert [f for f in FIELDS if f in DOCUMENTED] == list(DOCUMENTED)
    assert MAX_VALUE_LENGTH == 2048


def test_every_field_present_null_when_missing(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    entry = log.record(event="request", decision="deny", reason="no_rule", status=403, port=443, host="a.test")
    log.record(event="connect")
    log.close()
    lines = read_lines(path)
    assert len(lines) == 2
    assert log.lines_written == 2
    first = json.loads(lines[0])
    assert list(first) == list(FIELDS)
    assert first == entry
    assert first["event"] == "request"
    assert first["status"] == 403
    assert first["port"] == 443
    for key in set(FIELDS) - {"time", "event", "decision", "reason", "status", "port", "host"}:
        assert first[key] is None
        assert f'"{key}":null' in lines[0]
    assert RFC3339_MS.match(first["time"])
    second = json.loads(lines[1])
    assert list(second) == list(FIELDS)
    assert second["event"] == "connect"
    assert all(second[k] is None for k in FIELDS if k not in ("time", "event"))


def test_explicit_time_and_extra_keys(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.record(time="2024-01-02T03:04:05.678Z", event="x", extra_key="kept", notes=["a", "b"])
    log.close()
    entry = json.loads(read_lines(path)[0])
    assert entry["time"] == "2024-01-02T03:04:05.678Z"
    assert list(entry)[: len(FIELDS)] == list(FIELDS)
    assert entry["extra_key"] == "kept"
    assert entry["notes"] == ["a", "b"]


def test_values_are_json_escaped_one_line_per_record(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    hostile = 'a"b\\c\nd\re\x00f\x1b{"decision":"allow"}'
    log.record(event="request", path=hostile, host_header="h\r\nX: y", message="caf\u00e9 \u2603")
    log.record(event="request", path="/second")
    log.close()
    lines = read_lines(path)
    assert len(lines) == 2
    entry = json.loads(lines[0])
    assert entry["path"] == hostile
    assert entry["host_header"] == "h\r\nX: y"
    assert entry["message"] == "caf\u00e9 \u2603"
    with open(path, encoding="utf-8", newline="") as f:
        raw = f.read()
    assert "\r" not in raw
    assert raw.count("\n") == 2
    assert json.loads(lines[1])["path"] == "/second"


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e", "\x0b", "\x0c"])
def test_unicode_line_separators_cannot_split_a_record(tmp_path, separator):
    # Values come from the sandbox. A consumer that splits on Unicode line boundaries (Python's
    # str.splitlines, many log shippers) must still see one record per line, so no character that
    # such a consumer treats as a line break may appear raw in the output.
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.record(event="request", path=f'/a{separator}{{"decision":"allow","forged":true}}')
    log.close()
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) == 1
    assert json.loads(text.splitlines()[0])["path"] == f'/a{separator}{{"decision":"allow","forged":true}}'


def test_long_values_clipped(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    entry = log.record(event="request", path="p" * 5000, message="m" * MAX_VALUE_LENGTH, custom="c" * 3000)
    log.close()
    assert entry["path"] == "p" * MAX_VALUE_LENGTH + "…"
    assert entry["message"] == "m" * MAX_VALUE_LENGTH  # exactly at the limit: untouched
    assert entry["custom"] == "c" * MAX_VALUE_LENGTH + "…"
    written = json.loads(read_lines(path)[0])
    assert written["path"] == "p" * MAX_VALUE_LENGTH + "…"
    assert len(written["path"]) == MAX_VALUE_LENGTH + 1


def test_non_json_values_serialised_with_str(tmp_path):
    import ipaddress

    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.record(event="pin", address=ipaddress.ip_address("2001:db8::1"))
    log.close()
    assert json.loads(read_lines(path)[0])["address"] == "2001:db8::1"


def test_appends_to_an_existing_file(tmp_path):
    path = tmp_path / "audit.log"
    path.write_text('{"old":true}\n', encoding="utf-8")
    log = AuditLog(str(path))
    log.record(event="new")
    log.close()
    lines = read_lines(path)
    assert lines[0] == '{"old":true}'
    assert json.loads(lines[1])["event"] == "new"


def test_reopen_after_rotation(tmp_path):
    path = tmp_path / "audit.log"
    rotated = tmp_path / "audit.log.1"
    log = AuditLog(str(path))
    log.record(event="one")
    log.record(event="two")
    path.rename(rotated)
    log.record(event="three")  # still goes to the renamed file, as with any open descriptor
    log.reopen()
    assert path.exists()
    log.record(event="four")
    log.record(event="five")
    log.close()
    assert [json.loads(line)["event"] for line in read_lines(rotated)] == ["one", "two", "three"]
    assert [json.loads(line)["event"] for line in read_lines(path)] == ["four", "five"]
    assert log.lines_written == 5


def test_lines_are_flushed_immediately(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.record(event="now")
    assert json.loads(read_lines(path)[0])["event"] == "now"  # visible before close
    log.close()


def test_disabled_log_and_stdout(capsys):
    disabled = AuditLog(None)
    entry = disabled.record(event="x")
    assert list(entry) == list(FIELDS)
    assert disabled.lines_written == 0
    disabled.reopen()
    disabled.close()
    out = AuditLog("-")
    out.record(event="to-stdout")
    out.reopen()
    out.record(event="again")
    out.close()  # must not close sys.stdout
    captured = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["event"] for line in captured] == ["to-stdout", "again"]


def test_record_after_close_reopens_rather_than_lose_the_line(tmp_path):
    # A configured log is never silently off: a decision recorded after close() (late in a
    # shutdown) reopens the file, and where it cannot, record() raises so the decision fails closed.
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.close()
    log.record(event="late")
    assert json.loads(path.read_text())["event"] == "late"
    log.close()
    path.unlink()
    path.mkdir()  # the path can no longer be opened as a file
    with pytest.raises(OSError):
        log.record(event="lost")


def test_now_rfc3339_format():
    assert RFC3339_MS.match(now_rfc3339())
