"""The pure parts of `run --workers N`: the default count, port choice, worker command lines and
the audit path from a worker's pipe into the one stream."""

import argparse
import errno
import json
import os

import pytest

from gateway.audit import AuditLog, PipeAuditLog, open_audit_log, verify_chain
from addons.run_command import _with_port, worker_command
from gateway.workers import default_workers, usable_cpus
from tests.support.waiting import wait_for


def test_default_workers_follows_the_environment(monkeypatch):
    monkeypatch.setenv("EGRESS_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.delenv("EGRESS_WORKERS")
    assert default_workers() == usable_cpus() >= 1


@pytest.mark.parametrize("bad", ["0", "-1", "two", "100000"])
def test_bad_environment_value_is_an_error(monkeypatch, bad):
    monkeypatch.setenv("EGRESS_WORKERS", bad)
    with pytest.raises(ValueError, match="EGRESS_WORKERS"):
        default_workers()


def test_usable_cpus_respects_affinity():
    assert usable_cpus() <= len(os.sched_getaffinity(0))


def test_port_zero_is_chosen_once_for_every_worker():
    spec = _with_port("regular@127.0.0.1:0", "tcp")
    head, port = spec.rsplit(":", 1)
    assert head == "regular@127.0.0.1" and int(port) > 0
    assert _with_port("regular@127.0.0.1:8080", "tcp") == "regular@127.0.0.1:8080"
    assert _with_port("127.0.0.1:0", "tcp") != "127.0.0.1:0"
    assert _with_port("[::1]:0", "tcp").startswith("[::1]:")


def args(**overrides):
    values = dict(confdir="/tmp/conf", drain_timeout=10.0, policy="p.yaml", metrics="127.0.0.1:9090",
                  setoptions=["ssl_verify_upstream_trusted_ca=/ca.pem"], quiet=True)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_worker_command_keeps_the_gateway_and_sends_audit_to_the_pipe():
    cmd = worker_command(args(), ["regular@127.0.0.1:8080", "dns@127.0.0.1:5353"], 0, 7)
    text = " ".join(cmd)
    assert "--workers 1" in text and "--audit-log fd:7" in text and "--policy p.yaml" in text
    assert "--mode regular@127.0.0.1:8080" in text and "--mode dns@127.0.0.1:5353" in text
    assert "--metrics 127.0.0.1:9090" in text and "--set ssl_verify_upstream_trusted_ca=/ca.pem" in text
    assert "--audit-chain" not in text  # the supervisor chains the one stream


def test_dns_mode_runs_in_worker_zero_only():
    cmd = worker_command(args(), ["regular@127.0.0.1:8080", "dns@127.0.0.1:5353"], 1, None)
    assert "dns@127.0.0.1:5353" not in cmd and "--audit-log" not in cmd


def test_worker_lines_become_one_chained_stream(tmp_path):
    read_fd, write_fd = os.pipe()
    worker = open_audit_log(f"fd:{write_fd}")
    assert isinstance(worker, PipeAuditLog)
    worker.configure(chain=True, max_bytes=10)  # ignored: the supervisor chains and rotates
    entry = worker.record(event="request", decision="allow", host="a.test")
    assert "prev" not in entry
    worker.close()
    os.close(write_fd)
    with open(read_fd, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["host"] == "a.test"
    path = tmp_path / "audit.jsonl"
    merged = AuditLog(str(path), chain=True)
    for line in lines * 3:
        merged.append_line(line)
    merged.close()
    assert verify_chain([str(path)]).ok
    assert len(path.read_text().splitlines()) == 3


@pytest.mark.parametrize("line", ["not json", "[1]", '{"a":1}\n{"b":2}', '{"prev":"x"}', '{"a":"\u2028"}'])
def test_append_line_refuses_what_a_worker_cannot_have_built(tmp_path, line):
    log = AuditLog(str(tmp_path / "audit.jsonl"))
    with pytest.raises(ValueError):
        log.append_line(line)
    log.close()
    assert (tmp_path / "audit.jsonl").read_text() == ""


def test_a_broken_pipe_fails_the_record(tmp_path):
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    worker = PipeAuditLog(f"fd:{write_fd}")
    with pytest.raises(OSError):
        worker.record(event="request", decision="allow")
    worker.close()
    os.close(write_fd)


def test_supervisor_holds_lines_it_cannot_write_and_flags_every_worker(tmp_path):
    """The supervisor→worker protocol of a full audit disk, without processes: a failed write raises
    the shared byte (a worker's record() then fails closed before sending anything), the line and
    every later one are held in order, and the retry writes them, then the outage line, then clears."""
    from gateway.workers import Supervisor

    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), chain=True)
    supervisor = Supervisor(2, lambda index, fd: ["true"], audit=audit)
    read_fd, write_fd = os.pipe()
    worker = PipeAuditLog(f"fd:{write_fd}", state_fd=supervisor._state_file.fileno())
    try:
        line = lambda n: json.dumps({"event": "request", "decision": "allow", "path": f"/{n}"})  # noqa: E731
        supervisor.append(line(1))
        real = audit._stream
        audit._stream = FullStream(real)
        supervisor.append(line(2))  # the write fails: held, and the flag is up
        supervisor.append(line(3))  # arrived meanwhile: held behind it, not tried
        assert supervisor.held == [line(2), line(3)] and not supervisor.audit_writable
        assert not worker.writable and worker.supervisor_errno == 28
        with pytest.raises(OSError, match="No space left on device"):
            worker.record(event="request", decision="allow", path="/refused")
        supervisor._retry_audit()  # still full
        assert supervisor.held == [line(2), line(3)] and not supervisor.audit_writable
        audit._stream = real
        supervisor._retry_audit()
        assert supervisor.held == [] and supervisor.audit_writable and worker.supervisor_errno == 0
        worker.maintain()
        assert worker.writable
        records = [json.loads(x) for x in path.read_text().splitlines()]
        assert [r.get("path") for r in records] == ["/1", "/2", "/3", None]
        assert records[-1]["event"] == "audit_log" and records[-1]["late_lines"] == 2
        assert verify_chain([str(path)]).ok
    finally:
        worker.close()
        os.close(read_fd)
        supervisor._cleanup()


class FullStream:
    def __init__(self, inner):
        self.inner = inner

    def write(self, data):
        raise OSError(28, "No space left on device")

    def fileno(self):
        return self.inner.fileno()

    def close(self):
        self.inner.close()


def test_supervisor_held_lines_are_bounded_in_bytes_and_the_drops_counted(tmp_path):
    """Held lines were bounded by count only (100,000 lines of up to 8 KiB: 800 MB); now by bytes
    too (MAX_HELD_BYTES), and a line past the bound is dropped, counted, and named in the outage line."""
    from gateway.workers import MAX_HELD_BYTES, Supervisor

    assert MAX_HELD_BYTES <= 64 * 1024 * 1024
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), chain=True)
    supervisor = Supervisor(1, lambda index, fd: ["true"], audit=audit)
    supervisor.max_held_bytes = 100_000  # the default is 64 MiB: too much to fill in a unit test
    try:
        line = lambda n: json.dumps({"event": "request", "decision": "allow", "path": f"/{n}", "pad": "x" * 8000})  # noqa: E731
        real = audit._stream
        audit._stream = FullStream(real)
        for n in range(50):
            supervisor.append(line(n))
        assert supervisor.held_bytes == sum(len(x) for x in supervisor.held) <= 100_000
        assert len(supervisor.held) == 12 and supervisor.held_dropped == 38
        audit._stream = real
        supervisor._retry_audit()
        assert supervisor.held == [] and supervisor.held_bytes == 0 and supervisor.held_dropped == 0
        records = [json.loads(x) for x in path.read_text().splitlines()]
        assert records[-1]["event"] == "audit_log" and records[-1]["late_lines"] == 12
        assert records[-1]["dropped_lines"] == 38 and "38 held line(s) were lost" in records[-1]["message"]
        assert verify_chain([str(path)]).ok
    finally:
        supervisor._cleanup()


def test_a_restarted_worker_is_not_served_until_its_new_process_listens(tmp_path):
    """Review 24: `served` said whether a worker had ever listened, so a restarted one still
    loading its snapshot counted as serving, and the next control change killed it as stuck (at
    scale, over and over). It is the current process that counts: a restart is not served until it
    says it listens."""
    import sys

    from gateway.workers import READY_FD_ENV, Supervisor

    ready_pipe = tmp_path / "say-ready"
    os.mkfifo(ready_pipe)
    # The child blocks on the FIFO until the test writes to it, and then stays until it is killed.
    script = ("import os, signal, sys\n"
              "with open(sys.argv[1], 'rb') as pipe: pipe.read(1)\n"
              f"os.write(int(os.environ['{READY_FD_ENV}']), b'1')\n"
              "signal.pause()\n")
    supervisor = Supervisor(1, lambda index, fd: [sys.executable, "-c", script, str(ready_pipe)])
    worker = supervisor.workers[0]

    def let_it_say_ready() -> None:
        """Once the child has opened the FIFO (opening its write end succeeds only then), one byte."""
        fd = wait_for(lambda: _open_writer(ready_pipe), 10.0, "the child waiting on its FIFO")
        os.write(fd, b"1")
        os.close(fd)

    try:
        supervisor._start(worker)
        assert not supervisor.served(0)  # starting
        let_it_say_ready()
        wait_for(lambda: (supervisor._check_ready(), supervisor.served(0))[1], 10.0, "the first process listening")
        worker.process.kill()
        worker.process.wait(10)
        supervisor._start(worker)  # a restart, still starting
        supervisor._check_ready()
        assert not supervisor.served(0)
        let_it_say_ready()
        wait_for(lambda: (supervisor._check_ready(), supervisor.served(0))[1], 10.0, "the restarted process listening")
    finally:
        if worker.process is not None:
            worker.process.kill()
            worker.process.wait(10)
        supervisor._cleanup()


def _open_writer(fifo) -> int | None:
    """The FIFO's write end, or None while no process has its read end open (ENXIO)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise
