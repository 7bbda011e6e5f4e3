"""CPU per byte of the request-body method-override scan (gateway/methods/ `BodyScanner`) on
adversarial bodies: many tiny fields, keys or parts that are no override, so the scan's per-field
work is all there is. The scan runs on the event loop every sandbox shares, so its cost per byte is
what one sandbox can make every other one wait.

    PYTHONPATH=. python bench/method_scan.py [--size BYTES] [--chunk BYTES] [--only NAME,...]

For each shape it reports µs per byte of the scanner as it is now ("after") and with its fast
paths switched off, as the differential tests compare it (bench/lib/methods_reference.py, "before"), each also as a ratio to a
baseline measured on the same body in the same run (one `re.findall` pass for the separators), so
the machine's noise cancels. It checks the two scanners find the same overrides, and says so when
the new one refused a body the old one read (more than SLOW_FIELDS_CAP fields in a charset without
a fast path). Not a timed test:
pytest does not collect it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway import methods as new  # noqa: E402
from gateway.decompress import streaming_decoder  # noqa: E402
from bench.lib import methods_reference as old  # noqa: E402

FORM = "application/x-www-form-urlencoded"


def _repeat(unit: bytes, size: int, head: bytes = b"", tail: bytes = b"") -> bytes:
    return head + unit * max(1, (size - len(head) - len(tail)) // len(unit)) + tail


def _keys(size: int, fmt: str, sep: bytes = b",") -> bytes:
    parts, total, i = [], 0, 0
    while total < size:
        part = fmt.format(i=i).encode()
        parts.append(part)
        total += len(part) + len(sep)
        i += 1
    return sep.join(parts)


def shapes(size: int) -> list[tuple[str, list[str], bytes]]:
    """(name, Content-Type values, body): the worst shapes found for each parser."""
    mp_part = b"--B\r\nContent-Disposition: form-data; name=a\r\n\r\nb\r\n"
    return [
        ("form a=b&", [FORM], _repeat(b"a=b&", size)),
        ("form, no Content-Type (form+JSON)", [], _repeat(b"a=b&", size)),
        ("form names only a&", [FORM], _repeat(b"a&", size)),
        ("form %61=1&", [FORM], _repeat(b"%61=1&", size)),
        ("form %6D%65%74%68%6F%64=1& (method, no override)", [FORM], _repeat(b"%6D%65%74%68%6F%64=1&", size)),
        ("form method=1& (generic, not a body key)", [FORM], _repeat(b"method=1&", size)),
        ("form _methodx=1&", [FORM], _repeat(b"_methodx=1&", size)),
        ("form %25%36%44=1& (nested escapes)", [FORM], _repeat(b"%25%36%44=1&", size)),
        ("form a=b& charset=cp500", [FORM + "; charset=cp500"], _repeat(b"a=b&", size)),
        ("form a=b& charset=utf-16 (wide)", [FORM + "; charset=utf-16"], _repeat(b"a=b&", size)),
        ("form a=b& six charsets", [FORM + "; charset=cp500; charset=utf-7; charset=cp037; charset=hz; "
                                    "charset=iso-2022-jp; charset=cp1026"], _repeat(b"a=b&", size)),
        ("form a=b& charsets utf-7, hz, iso-2022-jp", [FORM + "; charset=utf-7; charset=hz; charset=iso-2022-jp"],
         _repeat(b"a=b&", size)),
        ("form %61=1& charsets utf-7, hz, iso-2022-jp", [FORM + "; charset=utf-7; charset=hz; charset=iso-2022-jp"],
         _repeat(b"%61=1&", size)),
        ("form k1_method=1& (distinct near-misses)", [FORM], b"&".join(b"k%d_method=1" % i for i in range(size // 14))),
        ("form _method[k1]& (distinct keys, no value)", [FORM], b"&".join(b"_method[%d]" % i for i in range(size // 12))),
        ("form a=method& (in values)", [FORM], _repeat(b"a=_method&", size)),
        ("form _method[x]=GET& (override, new names)", [FORM], b"&".join(b"_method[%d]=GET" % i for i in range(size // 16))),
        ("form _method=GET& (override, repeated)", [FORM], _repeat(b"_method=GET&", size)),
        ("JSON {\"k1\":1,...}", ["application/json"], b"{" + _keys(size, '"k{i}":1') + b"}"),
        ("JSON {\"a\":1,...}", ["application/json"], b"{" + _repeat(b'"a":1,', size) + b'"a":1}'),
        ("JSON [1,1,...] (no object)", ["application/json"], b"{\"a\":[" + _repeat(b"1,", size) + b"1]}"),
        ("JSON {\"method\":1,...}", ["application/json"], b"{" + _repeat(b'"method":1,', size) + b'"a":1}'),
        ("JSON {\"a\":\"\\u0061\",...}", ["application/json"], b"{" + _repeat(b'"a":"\\u0061",', size) + b'"a":1}'),
        ("JSON {\"a\":\"\\\\\\\\...\"} (escapes)", ["application/json"], b'{"a":"' + _repeat(b"\\\\", size) + b'"}'),
        ("JSON {\"\\\\\\\\...\":1} (escaped key)", ["application/json"], b'{"' + _repeat(b"\\\\", size) + b'":1}'),
        ("JSON {\"a\":[],...} (bracketed values)", ["application/json"], b"{" + _repeat(b'"a":[],', size) + b'"a":1}'),
        ("JSON {\"a\":{},...}", ["application/json"], b"{" + _repeat(b'"a":{},', size) + b'"a":1}'),
        ("JSON {\"\\n\":1,...} (escaped keys)", ["application/json"], b"{" + _repeat(b'"\\n":1,', size) + b'"a":1}'),
        ("JSON {\"k\":{\"a\":1},...}", ["application/json"], b"{" + _repeat(b'"k":{"a":1},', size) + b'"a":1}'),
        ("JSON {\"a\":[[],[],...]} (nested brackets)", ["application/json"], b'{"a":[' + _repeat(b"[],", size) + b"[]]}"),
        ("JSON {\"a\":[[[[[[[[[[[]]]]]]]]]],...} (deep)", ["application/json"],
         b"{" + _repeat(b'"a":' + b"[" * 12 + b"]" * 12 + b",", size) + b'"a":1}'),
        ("JSON embeddings {\"vectors\":[[0.1,...],...]}", ["application/json"],
         b'{"model":"m","vectors":[' + _repeat(b"[" + b",".join([b"0.0123456"] * 16) + b"],", size) + b"[0.1]]}"),
        ("JSON {\"\\u00e9\":1,...} (non-ASCII keys)", ["application/json"], b"{" + _keys(size, '"\\u00e9{i}":1') + b"}"),
        ("JSON {\"\\u0061\":1,...} (ASCII escapes)", ["application/json"], b"{" + _repeat(b'"\\u0061":1,', size) + b'"a":1}'),
        ("JSON [[[[... (deep opens)", ["application/json"], b'{"a":' + b"[" * size + b"}"),
        ("multipart tiny parts", ["multipart/form-data; boundary=B"], _repeat(mp_part, size, tail=b"--B--\r\n")),
        ("multipart empty parts", ["multipart/form-data; boundary=B"], _repeat(b"--B\r\n\r\n\r\n", size)),
        ("multipart delimiters only", ["multipart/form-data; boundary=B"], _repeat(b"--B--", size)),
        ("multipart tiny parts, charset=utf-16", ["multipart/form-data; boundary=B; charset=utf-16"],
         _repeat(mp_part, size, tail=b"--B--\r\n")),
    ]


def scan(module, content_types: list[str], body: bytes, chunk: int) -> tuple[float, list, str | None]:
    s = module.BodyScanner.for_headers([("Content-Type", c) for c in content_types], streaming_decoder)
    start = time.process_time()
    found = []
    for at in range(0, len(body), chunk):
        found += s.feed(body[at:at + chunk])
    found += s.finish()
    return time.process_time() - start, found, s.problem


def baseline(body: bytes) -> float:
    start = time.process_time()
    for _ in range(5):
        re.findall(rb"[&=,:\"]", body)
    return (time.process_time() - start) / 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes per body (default 1 MiB)")
    parser.add_argument("--chunk", type=int, default=64 * 1024, help="bytes per feed (default 64 KiB)")
    parser.add_argument("--only", default="", help="comma-separated substrings of shape names")
    parser.add_argument("--no-before", action="store_true", help="skip the (slow) reference scanner")
    args = parser.parse_args()
    print(f"{'shape':52} {'before µs/B':>11} {'after µs/B':>10} {'speed-up':>8} {'before/base':>11} {'after/base':>10}")
    worst = 0.0
    for name, types, body in shapes(args.size):
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        base = baseline(body)
        after, found_new, problem_new = scan(new, types, body, args.chunk)
        worst = max(worst, after / len(body) * 1e6)
        if args.no_before:
            print(f"{name[:52]:52} {'-':>11} {after / len(body) * 1e6:10.3f} {'-':>8} {'-':>11} {after / base:10.1f}")
            continue
        before, found_old, problem_old = scan(old, types, body, args.chunk)
        same = [(o.source, o.name, o.method) for o in found_old] == [(o.source, o.name, o.method) for o in found_new]
        mark = "" if same and problem_old == problem_new else "  FINDINGS DIFFER"
        if problem_new and problem_new != problem_old:
            mark = f"  refused after {len(found_old)} findings: {problem_new[:60]}"
        print(f"{name[:52]:52} {before / len(body) * 1e6:11.3f} {after / len(body) * 1e6:10.3f} "
              f"{before / after:7.1f}x {before / base:11.1f} {after / base:10.1f}{mark}", flush=True)
    print(f"worst after: {worst:.3f} µs/byte")


if __name__ == "__main__":
    main()
