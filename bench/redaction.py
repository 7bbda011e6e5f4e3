"""Cost of redaction per MiB of response body, by kind of body (not a test; see bench/README.md).

    .venv/bin/python bench/redaction.py

Five secrets of ~110 characters. Each figure is the median of 5 runs, with its ratio to a baseline
measured in the same run: one `bytes.translate` pass over the same body (what reading the body
once costs), so the ratio says how many passes redaction is worth, whatever the machine's speed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.redact import Redactor, StreamRedactor, forms_of  # noqa: E402

MIB = 1 << 20
SECRET = "sk-ant-api03-" + "A1b2+C3d4/E5f6=G7h8" * 5
EVENT = b'data: {"type":"content_block_delta","delta":{"text":"hello"}}\n\n'


def _median_seconds(run, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    redactor = Redactor({f"s{i}": f"{SECRET}{i}" for i in range(5)})
    table = bytes(range(256))
    sse = EVENT * (MIB // len(EVENT))
    bodies = {
        "random bytes": os.urandom(MIB),
        "SSE text": sse,
        "UTF-16 text": sse.decode().encode("utf-16")[:MIB],
        "wrapped base64 (76 columns)": (b"A" * 76 + b"\n") * (MIB // 77),
        "newlines": b"\n" * MIB,
        "NULs": b"\0" * MIB,
        "the secret, echoed back to back": (SECRET.encode() + b"0 ") * (MIB // (len(SECRET) + 2)),
    }
    print(f"forms per secret: {len(forms_of(SECRET))}; five secrets\n")
    print("| body | ms per MiB | × one pass over the body |")
    print("|---|---:|---:|")
    for name, body in bodies.items():
        base = _median_seconds(lambda: body.translate(table))
        cost = _median_seconds(lambda: redactor.redact(body))
        mib = len(body) / MIB
        print(f"| {name} | {cost * 1000 / mib:.1f} | {cost / base:.0f} |")

    def streamed(chunk: int, body: bytes):
        def run():
            stream = StreamRedactor(redactor)
            for i in range(0, len(body), chunk):
                stream(body[i:i + chunk])
            stream(b"")
        return run

    per_event = _median_seconds(streamed(len(EVENT), sse)) / (len(sse) // len(EVENT))
    trickle = b"a" * (1 << 14)
    per_byte = _median_seconds(streamed(1, trickle), 3) / len(trickle)
    print(f"\nSSE streamed one event per chunk: {per_event * 1e6:.1f} µs per event")
    print(f"worst case, one byte per chunk, every byte in some form: {per_byte * 1e6:.0f} µs per byte")


if __name__ == "__main__":
    main()
