"""Coverage-guided fuzz targets (atheris / libFuzzer) for the parsers at the front door.

Run by tests/fuzz/test_atheris.py for a few seconds each (skipped when atheris is not installed);
for a longer hunt run one directly:

    python tests/fuzz/atheris_targets.py hostnames -max_total_time=600
    python tests/fuzz/atheris_targets.py paths -max_total_time=600
    python tests/fuzz/atheris_targets.py classify -max_total_time=600

Targets and their properties:
- hostnames: canonical_host / parse_authority raise nothing but HostError, and a canonical host is
  a fixpoint (bare, bracketed, in an authority);
- paths: normalise_path raises nothing but PathError, its result has no empty, `.` or `..`
  segment and normalises to itself (when it holds no `?` or `#`, which a decoded `%3F`/`%23`
  yields and which a second pass would read as a query or fragment), and a glob compiled from any
  text matches or not without raising;
- classify: the layer guard's first-bytes classifier never raises, answers one of its kinds, only
  says HTTP for a complete request line, and never changes its mind as more bytes arrive once it
  has decided.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["gateway"]):
    from gateway.hostnames import HostError, canonical_host, parse_authority
    from gateway.paths import PathError, compile_glob, normalise_path

# addons.layer_guard imports all of mitmproxy: instrument only the function under test.
from addons import layer_guard  # noqa: E402
from addons.layer_guard import H2C, HTTP, OTHER, TLS, WAIT  # noqa: E402

classify = atheris.instrument_func(layer_guard.classify)


def hostnames(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    raw = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 80)) if fdp.ConsumeBool() else \
        fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 80))
    port = fdp.ConsumeIntInRange(1, 65535)
    try:
        host = canonical_host(raw)
    except HostError:
        host = None
    try:
        parse_authority(raw, port if fdp.ConsumeBool() else None)
    except HostError:
        pass
    if host is not None:
        text = f"[{host.value}]" if host.ip is not None and host.ip.version == 6 else host.value
        assert canonical_host(text) == host, (raw, host)
        assert parse_authority(host.authority(port)) == (host, port), (raw, host)
        assert host.value.isascii() and host.value == host.value.lower(), (raw, host)


def paths(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 120))
    if fdp.ConsumeBool():
        target = "/" + target
    try:
        once = normalise_path(target)
    except PathError:
        once = None
    if once is not None and once != "*":
        if "?" not in once and "#" not in once:
            assert normalise_path(once) == once, (target, once)
        segments = once.split("/")[1:]
        if once.endswith("/"):
            segments = segments[:-1]
        assert all(s not in ("", ".", "..") for s in segments) or once == "/", (target, once)
    glob = fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 30))
    try:
        pattern = compile_glob(glob)
    except ValueError:
        return
    if once is not None:
        pattern.match(once)


KINDS = {TLS, HTTP, H2C, OTHER, WAIT}


def classify_target(data: bytes) -> None:
    kind = classify(data)
    assert kind in KINDS, kind
    if kind == HTTP:
        assert b"\n" in data, data
    if kind in (TLS, HTTP, H2C, OTHER) and data:
        # a decision made on a prefix stands when more bytes follow
        assert classify(data + b"GET / HTTP/1.1\r\n") == kind, data


TARGETS = {"hostnames": hostnames, "paths": paths, "classify": classify_target}


if __name__ == "__main__":
    name = sys.argv.pop(1)
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()
