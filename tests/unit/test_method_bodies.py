"""Method overrides in request bodies, read as a superset of what frameworks read (gateway/methods/
`plan_body`, `_Stream`, `_Multipart`, `BodyScanner`): liberal Content-Types, every charset reading,
every compressed stream, PHP- and Rack-liberal multipart -- in any chunking -- while ordinary
clients' bodies (JSON APIs, requests/httpx uploads, pip, npm, git) are neither refused nor flagged.

The cases named F1..F4 are review 14a's findings, confirmed against PHP 8.2 + Symfony, Rack 2.2 and
Express 4 + body-parser + method-override.
"""

from __future__ import annotations

import gzip
import json
import zlib

import brotli
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import methods
from gateway.decompress import streaming_decoder
from gateway.methods import BodyScanner

MP = b'--AAA\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--AAA--\r\n'
PART = b'Content-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n'
FORM = "application/x-www-form-urlencoded"


def scanner(content_types=(), encoding=None) -> BodyScanner:
    headers = [("Content-Type", c) for c in content_types]
    if encoding:
        headers.append(("Content-Encoding", encoding))
    s = BodyScanner.for_headers(headers, streaming_decoder)
    assert s is not None, headers
    return s


def run(s: BodyScanner, body: bytes, cuts=()) -> tuple[list, str | None]:
    found, start = [], 0
    for cut in sorted(set(cuts)) + [len(body)]:
        found += s.feed(body[start:cut])
        start = cut
    found += s.finish()
    return found, s.problem


def methods_in(content_types, body, encoding=None, cuts=()) -> list:
    found, problem = run(scanner(content_types, encoding), body, cuts)
    assert problem is None, problem
    return [o.method for o in found]


# --- F1: Content-Type read the way any server might ------------------------------------------------


@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded,text/plain",  # PHP cuts at ',' and Rack too
    "application/x-www-form-urlencoded x",  # PHP cuts at a space
    "Application/X-WWW-Form-Urlencoded;charset=UTF-8",
    " application/x-www-form-urlencoded\t; foo",
    "text/plain, application/x-www-form-urlencoded",  # a joined duplicate header
    "",
])
def test_form_content_types(content_type):
    assert "DELETE" in methods_in([content_type], b"a=1&_method=DELETE")


def test_duplicate_content_type_headers_are_each_read():
    assert methods_in(["text/plain", FORM], b"_method=DELETE") == ["DELETE"]


@pytest.mark.parametrize("content_type", [
    "multipart/form-data; boundary=AAA",
    "multipart/form-data; xboundary=AAA",  # PHP finds 'boundary' anywhere
    "multipart/form-data,boundary=AAA",
    "multipart/form-data boundary=AAA",
    "multipart/form-data; BOUNDARY=AAA",
    "multipart/form-data; boundary=XXX; boundary=AAA",  # first for one parser, last for Rack
    'multipart/form-data; boundary="AAA"',
    "multipart/form-data; boundary = AAA",
    "multipart/form-data; boundary=AAA x",
    "multipart/form-data",  # no boundary at all: it is guessed from the body's first line
    "multipart/form-data; boundary=ZZZ",  # a boundary the body does not use: guessed too
    "multipart/mixed; boundary=AAA",
])
def test_multipart_boundaries(content_type):
    assert "DELETE" in methods_in([content_type], MP)


def test_charset_named_boundary_is_still_read_or_refused():
    """PHP takes 'boundary' inside `charset=boundary` and the next '=' (b=AAA): read as AAA; the
    charset 'boundary' itself is unknown, so the body is refused as uncheckable anyway."""
    found, problem = run(scanner(["multipart/form-data; charset=boundary; b=AAA"]), MP)
    assert problem and "charset" in problem


@pytest.mark.parametrize("content_type", [
    "application/json", "application/vnd.api+json", "text/plain; x=/json", "application/json; charset=utf-8",
    "application/x-ndjson", "text/json",
])
def test_json_content_types(content_type):
    """Laravel's isJson() is '/json' or '+json' anywhere in the header."""
    assert methods_in([content_type], b'{"_method": "DELETE"}') == ["DELETE"]


def test_no_content_type_is_read_as_form_and_json():
    assert methods_in([], b"_method=DELETE") == ["DELETE"]
    assert methods_in([], b'{"_method": "PUT"}') == ["PUT"]


def test_types_nobody_parses_into_fields_are_not_scanned():
    for content_type in ("text/plain", "application/octet-stream", "application/x-git-upload-pack-request",
                         "image/png", "application/grpc"):
        assert BodyScanner.for_headers([("Content-Type", content_type)]) is None, content_type


def test_too_many_boundaries_is_uncheckable():
    many = "multipart/form-data; " + "; ".join(f"boundary=b{i}" for i in range(methods.READINGS_CAP + 2))
    assert run(scanner([many]), MP)[1]
    assert run(scanner([many]), b"")[1] is None  # an empty body is nothing to refuse


# --- F2: multipart at least as liberal as PHP and Rack ---------------------------------------------


@pytest.mark.parametrize("body", [
    b"--AAA--\r\n--AAA\r\n" + PART + b"--AAA--\r\n",  # a close-delimiter first
    b'--AAA\r\nContent-Disposition: form-data; name="a"\r\n\r\nx\r\n--AAA--\r\n--AAA\r\n' + PART + b"--AAA--\r\n",
    b"--AAA\r\nContent-Disposition: form-data;\r\n name=\"_method\"\r\n\r\nDELETE\r\n--AAA--\r\n",  # folded
    b"--AAA\r\nContent-Disposition: form-data; na\r\nme=\"_method\"\r\n\r\nDELETE\r\n--AAA--\r\n",  # PHP joins
    b"--AAA\r\nContent-Disposition: form-data; name='_method'\r\n\r\nDELETE\r\n--AAA--\r\n",  # PHP's quotes
    b"--AAA\r\nContent-Disposition: form-data; name=\"_method\"\n\r\nDELETE\r\n--AAA--\r\n",  # \n\r\n
    b"--AAA\r\nContent-Disposition: form-data; name=\"_method\"\r\n\nDELETE\r\n--AAA--\r\n",  # \r\n\n
    b"--AAA\r\nContent-Disposition : form-data; name=\"_method\"\r\n\r\nDELETE\r\n--AAA--\r\n",
    b"--AAA\r\nX-Content-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--AAA--\r\n",  # Rack: unanchored
    b"--AAA\r\nContent-Disposition: form-data; name=_method\"x\r\n\r\nDELETE\r\n--AAA--\r\n",  # Rack's token
    b"--AAA\r\nContent-Disposition: form-data; name=\"_me\\thod\"\r\n\r\nDELETE\r\n--AAA--\r\n",  # escape undone
    b"--AAA\r\nContent-Disposition: form-data; name*=UTF-8''%5Fmethod\r\n\r\nDELETE\r\n--AAA--\r\n",
    b"--AAA  \r\n" + PART + b"--AAA--\r\n",  # transport padding
    b"preamble\r\n--AAA\r\n" + PART + b"--AAA--\r\n",
])
def test_liberal_multipart(body):
    assert "DELETE" in methods_in(["multipart/form-data; boundary=AAA"], body)


def test_a_part_named_differently_is_not_an_override():
    assert methods_in(["multipart/form-data; boundary=AAA"],
                      b'--AAA\r\nContent-Disposition: form-data; name="x"; filename="_method"\r\n\r\nDELETE\r\n'
                      b'--AAA\r\nContent-Disposition: form-data; name="a_method"\r\n\r\nDELETE\r\n--AAA--\r\n') == []


# --- F3: JSON and forms in every charset a framework decodes ----------------------------------------


J = '{"a": 1, "_method": "DELETE"}'


@pytest.mark.parametrize("content_type, body", [
    ("application/json", b"\xef\xbb\xbf" + J.encode()),  # UTF-8 BOM (body-parser strips it)
    ("application/json; charset=utf-16le", J.encode("utf-16-le")),
    ("application/json; charset=utf-16be", J.encode("utf-16-be")),
    ("application/json; charset=utf-16", J.encode("utf-16")),  # with a BOM
    ("application/json; charset=utf-16", J.encode("utf-16-be")),  # no BOM: iconv-lite guesses the order
    ("application/json; charset=utf-32", J.encode("utf-32")),
    ("application/json; charset=UCS-2", J.encode("utf-16-le")),
    ("application/json", J.encode("utf-16-le")),  # undeclared: NUL in the first bytes (RFC 4627, Python json)
    ("application/json", J.encode("utf-32-be")),
    ("application/json", J.encode("utf-16")),  # undeclared, BOM
    ("application/json; charset=utf-7", J.replace("_", "+AF8-").encode()),  # iconv-lite decodes UTF-7
])
def test_json_in_every_unicode_encoding(content_type, body):
    assert methods_in([content_type], body) == ["DELETE"]


@pytest.mark.parametrize("charset, body", [
    ("IBM037", "a=1&_method=DELETE".encode("cp037")),  # Django decodes the whole body first
    ("utf-16le", "a=1&_method=DELETE".encode("utf-16-le")),
    ("utf-16", "\ufeff_method=DELETE".encode("utf-16-be")),
    # Tomcat splits at the ASCII '&' and '=' bytes and decodes each name with the charset.
    ("utf-16le", b"a=b&" + "_method".encode("utf-16-le") + b"=" + "DELETE".encode("utf-16-le")),
    ("IBM037", b"a=b&" + "_method".encode("cp037") + b"=DELETE"),
    ("utf-7", b"+AF8-method=DELETE"),
])
def test_forms_in_charsets_that_are_not_ascii(charset, body):
    found, problem = run(scanner([f"{FORM}; charset={charset}"]), body)
    assert problem is None and found, (charset, body)
    # A name only that charset reveals carries a value unreadable some other way: refused either way.
    assert all(o.method in ("DELETE", None) for o in found) and any(o.method == "DELETE" for o in found)


def _form_of(seed: int) -> bytes:
    """Many hex fields (even seeds) or one 1 MiB hex field (odd: review K's `a=<hex>` case)."""
    import random
    rand = random.Random(seed)
    if seed % 2:
        return b"a=" + rand.randbytes(1 << 19).hex().encode()
    return "&".join(f"field{j}={rand.randbytes(20).hex()}" for j in range(20000)).encode()


@pytest.mark.parametrize("encoding, compress", [
    ("gzip", gzip.compress), ("deflate", zlib.compress), ("br", brotli.compress), (None, None)])
@pytest.mark.parametrize("seed", range(6))
def test_binary_bytes_as_sent_are_not_read_as_utf16_forms(encoding, compress, seed):
    """A NUL in the first four bytes makes JSON parsers guess UTF-16/32 (RFC 4627), never a form or
    multipart parser: every gzip stream starts with one, and its bytes as sent, read as UTF-16, were
    one endless field name refused as a hidden override (15 of 40 gzip-encoded 1 MiB forms)."""
    import random
    body = _form_of(seed) if compress else b"\x00\x00" + random.Random(seed).randbytes(1 << 20)
    sent = compress(body) if compress else body
    for content_type in (FORM, f"{FORM}; charset=utf-8", "multipart/form-data; boundary=AAA"):
        assert methods_in([content_type], sent, encoding) == [], (content_type, encoding)


def test_a_nul_at_the_start_still_makes_json_read_as_utf16_and_a_declared_wide_form_is_still_read():
    assert methods_in([], J.encode("utf-16-le")) == ["DELETE"]  # no Content-Type: Rack's form, JSON parsers'
    assert methods_in([FORM], "_method=DELETE".encode("utf-16-le")) == []  # a NUL, no BOM: no form parser guesses
    found, _ = run(scanner([f"{FORM}; charset=utf-16"]), "\ufeff_method=DELETE".encode("utf-16-le"))
    assert "DELETE" in [o.method for o in found]


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
@pytest.mark.parametrize("content_type", [FORM, "multipart/form-data; boundary=AAA"])
def test_a_form_that_starts_with_a_byte_order_mark_is_read_in_that_encoding(codec, content_type):
    """ASP.NET's FormReader (and so FormFeature in ASP.NET Core 2.x, then HttpMethodOverrideMiddleware
    with FormFieldName "_method") reads a form with detectEncodingFromByteOrderMarks: a BOM wins
    over the default UTF-8, with no charset declared (a review's finding)."""
    text = "\ufeff_method=DELETE" if content_type == FORM else "\ufeff" + MP.decode()
    found, problem = run(scanner([content_type]), text.encode(codec))
    assert problem is None
    assert "DELETE" in [o.method for o in found], (codec, content_type)


def test_ascii_compatible_charsets_read_as_sent():
    for charset in ("utf-8", "ISO-8859-1", "windows-1252", "Shift_JIS", "gbk", '"utf-8"', "us-ascii"):
        s = scanner([f"{FORM}; charset={charset}"])
        assert len(s._raw.plan.charsets) == 0, charset
        assert run(s, "titre=été&_method=PUT".encode("latin-1" if "8859" in charset else "utf-8"))[0]


def test_unknown_charsets_are_uncheckable_on_forms_only():
    found, problem = run(scanner([f"{FORM}; charset=x-klingon"]), b"a=1")
    assert problem and "x-klingon" in problem
    assert run(scanner(["multipart/form-data; boundary=A; charset=IBM1047"]), MP)[1]
    assert run(scanner(["application/json; charset=x-klingon"]), b'{"a": 1}') == ([], None)
    assert run(scanner([f"{FORM}; charset=base64"]), b"a=1")[1]  # a bytes codec is no charset


def test_a_leading_bom_does_not_hide_the_first_form_field():
    assert methods_in([FORM], b"\xef\xbb\xbf_method=DELETE") == ["DELETE"]


# --- F4: every compressed stream, as sent and decoded -----------------------------------------------


def test_every_gzip_member_is_read():
    body = gzip.compress(b"a=b&") + gzip.compress(b"_method=DELETE")
    assert methods_in([FORM], body, "gzip") == ["DELETE"]
    body = gzip.compress(b'{"a":1,') + gzip.compress(b'"_method":"DELETE"}')
    assert methods_in(["application/json"], body, "gzip") == ["DELETE"]


def test_concatenated_deflate_and_zstd_streams_are_read():
    assert methods_in([FORM], zlib.compress(b"a=b&") + zlib.compress(b"_method=DELETE"), "deflate") == ["DELETE"]
    try:
        from backports import zstd
    except ImportError:
        from compression import zstd
    assert methods_in([FORM], zstd.compress(b"a=b&") + zstd.compress(b"_method=DELETE"), "zstd") == ["DELETE"]


def test_stacked_codings_are_all_undone():
    body = brotli.compress(gzip.compress(b"_method=DELETE"))
    assert methods_in([FORM], body, "gzip, br") == ["DELETE"]


def test_bodies_that_do_not_decode_are_uncheckable():
    for body, why in ((gzip.compress(b"_method=PUT") + b"junk", "data after"),
                      (gzip.compress(b"a=b&_method=PUT")[:-4], "decode"),
                      (b"_method=DELETE", "decode")):
        found, problem = run(scanner([FORM], "gzip"), body)
        assert problem and why in problem, (body, problem)
    # PHP ignores Content-Encoding: a body labelled gzip that is not is read as sent too.
    s = scanner([FORM], "gzip")
    assert [o.method for o in s.feed(b"_method=DELETE&")] == ["DELETE"]


def test_an_unknown_coding_is_read_as_sent():
    s = scanner([FORM], "x-custom")
    assert not s.decoders and methods_in([FORM], b"_method=DELETE", "x-custom") == ["DELETE"]


def test_too_many_codings_are_uncheckable():
    assert run(scanner([FORM], "gzip, gzip, gzip, gzip"), b"x")[1]


# --- in any chunking: the same answer; not pending means the end cannot refuse ---------------------


ENCODINGS = {
    "utf-8": lambda t: t.encode(),
    "utf-8-bom": lambda t: b"\xef\xbb\xbf" + t.encode(),
    "utf-16-le": lambda t: t.encode("utf-16-le"),
    "utf-16-be": lambda t: t.encode("utf-16-be"),
    "utf-16": lambda t: t.encode("utf-16"),
    "utf-32": lambda t: t.encode("utf-32"),
}
CHARSET = {"utf-8": "", "utf-8-bom": "", "utf-16-le": "; charset=utf-16le", "utf-16-be": "; charset=utf-16be",
           "utf-16": "; charset=utf-16", "utf-32": "; charset=utf-32"}
CODINGS = {
    None: lambda b: b,
    "gzip": lambda b: gzip.compress(b[: len(b) // 2]) + gzip.compress(b[len(b) // 2:]),
    "deflate": zlib.compress,
    "br": brotli.compress,
}


def _body(kind: str, fields) -> tuple[str, str]:
    if kind == "form":
        return FORM, "&".join(f"{n}={v}" for n, v in fields)
    if kind == "multipart":
        return "multipart/form-data; boundary=bNd", "".join(
            f'--bNd\r\nContent-Disposition: form-data; name="{n}"\r\n\r\n{v}\r\n' for n, v in fields) + "--bNd--\r\n"
    return "application/json", json.dumps(dict(fields) | {"nested": {"_method": "DELETE"}})


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["title", "x_method", "_method", "_METHOD", "_method[]"]),
                          st.sampled_from(["DELETE", "GET", "patch", "hello"])), max_size=5),
       st.sampled_from(["form", "multipart", "json"]), st.sampled_from(sorted(ENCODINGS)),
       st.sampled_from(list(CODINGS)), st.lists(st.integers(0, 600), max_size=8))
def test_every_encoding_gives_the_same_answer_in_any_chunking(fields, kind, encoding, coding, cuts):
    if kind == "json":
        fields = list(dict(fields).items())
    content_type, text = _body(kind, fields)
    body = CODINGS[coding](ENCODINGS[encoding](text))
    expected = {v.upper() for n, v in fields if n.lower().removesuffix("[]") == "_method"}
    whole, problem = run(scanner([content_type + CHARSET[encoding]], coding), body)
    assert problem is None
    chunked, _ = run(scanner([content_type + CHARSET[encoding]], coding), body, [c for c in cuts if c <= len(body)])
    assert set(chunked) == set(whole)
    assert {o.method for o in whole if o.method} >= expected
    if kind != "json":  # a value under an override name no reading makes sense of is refused
        assert {o.method for o in whole} <= expected | {None}
    else:
        assert {o.method for o in whole} == expected


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5),
       st.sampled_from([FORM, "multipart/form-data; boundary=bNd", "application/json", f"{FORM}; charset=utf-16",
                        "multipart/form-data", f"{FORM}; charset=cp037", None]),
       st.sampled_from([None, "gzip"]))
def test_arbitrary_bytes_never_crash_and_chunking_does_not_matter(body, cuts, content_type, coding):
    types = [content_type] if content_type else []
    whole = run(scanner(types, coding), body)
    chunked = run(scanner(types, coding), body, [c for c in cuts if c <= len(body)])
    assert (set(chunked[0]), chunked[1] is None) == (set(whole[0]), whole[1] is None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a=1", "_method=DELETE", "_method=", "_meth", "od=PUT", "&", "=", "x", "%5F"]),
                max_size=8), st.integers(0, 400), st.sampled_from(["utf-8", "utf-16-le", "utf-32"]),
       st.sampled_from(["form", "multipart"]))
def test_not_pending_means_the_end_of_the_body_cannot_refuse_in_any_encoding(pieces, split, encoding, kind):
    text = "".join(pieces)
    content_type = FORM
    if kind == "multipart":
        content_type = "multipart/form-data; boundary=b"
        text = '--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\n' + text
    body = ENCODINGS[encoding](text)
    split = min(split, len(body))
    probe = scanner([content_type + CHARSET[encoding]])
    probe.feed(body[:split])
    if not probe.pending:
        ended = scanner([content_type + CHARSET[encoding]])
        ended.feed(body[:split])
        assert ended.finish() == [] and ended.problem is None, body[:split]


# --- ordinary clients go through untouched --------------------------------------------------------


def _prepared(**kwargs):
    import requests

    prepared = requests.Request("POST", "https://api.example.com/upload", **kwargs).prepare()
    return list(prepared.headers.items()), prepared.body if isinstance(prepared.body, bytes) else \
        (prepared.body or "").encode()


def _clean(headers, body: bytes, cuts=()):
    s = BodyScanner.for_headers(headers, streaming_decoder)
    if s is None:
        return
    found, problem = run(s, body, cuts)
    assert (found, problem) == ([], None), (headers, found, problem)


def test_requests_and_httpx_uploads_are_not_flagged():
    import httpx

    wheel = bytes(range(256)) * 200 + b"--boundary\r\n_method=DELETE"  # binary file content
    cases = [
        _prepared(files={"file": ("x.whl", wheel, "application/octet-stream")}, data={"method": "DELETE"}),
        _prepared(data={"title": "méthode", "note": "_method=DELETE in prose", "method": "delete"}),
        _prepared(json={"model": "m", "messages": [{"role": "user", "content": '{"_method": "DELETE"}'}],
                        "method": "DELETE"}),
    ]
    request = httpx.Request("POST", "https://api.example.com/", files={"upload": ("a.bin", wheel)},
                            data={"comment": "x"})
    cases.append((list(request.headers.items()), request.read()))
    for headers, body in cases:
        _clean(headers, body, range(0, len(body), 997))


def test_pip_npm_and_git_bodies_are_not_flagged():
    twine = (b'--a1b2\r\nContent-Disposition: form-data; name=":action"\r\n\r\nfile_upload\r\n'
             b'--a1b2\r\nContent-Disposition: form-data; name="metadata_version"\r\n\r\n2.1\r\n'
             b'--a1b2\r\nContent-Disposition: form-data; name="content"; filename="p-1.0.tar.gz"\r\n'
             b"Content-Type: application/octet-stream\r\n\r\n" + gzip.compress(b"x" * 5000) + b"\r\n--a1b2--\r\n")
    _clean([("Content-Type", "multipart/form-data; boundary=a1b2")], twine)
    npm = json.dumps({"_id": "pkg", "name": "pkg", "versions": {"1.0.0": {"scripts": {"_method": "x"}}},
                      "_attachments": {"pkg-1.0.0.tgz": {"content_type": "application/octet-stream",
                                                         "data": "H4sI" + "A" * 4000}}}).encode()
    _clean([("Content-Type", "application/json"), ("npm-command", "publish")], npm)
    pack = b"0032want 0123456789abcdef0123456789abcdef01234567\n00000009done\n"
    _clean([("Content-Type", "application/x-git-upload-pack-request"), ("Content-Encoding", "gzip")],
           gzip.compress(pack))
    _clean([("Content-Type", "application/json"), ("Content-Encoding", "gzip")],
           gzip.compress(json.dumps({"query": "{ viewer { login } }"}).encode()))
    _clean([("Content-Type", "application/x-www-form-urlencoded"), ("Content-Encoding", "br")],
           brotli.compress(b"grant_type=client_credentials&scope=read"))


def test_memory_stays_bounded_on_a_long_body():
    s = scanner(["multipart/form-data; boundary=B"])
    s.feed(b'--B\r\nContent-Disposition: form-data; name="_method"\r\n\r\n')
    for _ in range(200):
        s.feed(b"A" * 10_000)
    buffers = [len(p._buf) + len(p._value) for r in s._raw.readings for p in r.parsers if hasattr(p, "_buf")]
    assert max(buffers) <= methods.VALUE_CAP + 16
    [o] = s.finish()
    assert o.method is None
