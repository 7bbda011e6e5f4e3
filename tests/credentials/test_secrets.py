"""Where secret values come from: env secrets are read at load, file secrets on every request that
needs them. A secret that cannot be read fails the request (502 secret_unavailable, naming the
secret) and nothing reaches the upstream; a rewritten file or a Kubernetes `..data` symlink swap is
picked up without a restart."""

from __future__ import annotations

import os

import pytest

from tests.e2e.helpers import assert_refused, audit_for, get

from .clients import assert_no_leak, fetch, response_bytes, tls_to
from .conftest import K8S_INITIAL, ROTATE_INITIAL, SECRETS, k8s_publish, write_secret


@pytest.mark.parametrize("host, secret, why", [
    ("missing-env.test", "missing_env", "EGRESS_CRED_NEVER_SET"),
    ("missing-file.test", "missing_file", "does-not-exist"),
    ("dir-file.test", "dir_file", "a-directory"),
])
def test_unreadable_secret_fails_the_request_and_nothing_is_sent(cred, host, secret, why):
    start = len(cred.gateway.audit())  # (this module's gateway has served many connections, some maybe from this port)
    with tls_to(cred.gateway, host) as tls:
        for _ in range(2):  # and again: no request ever goes out without its credential
            response = get(tls, "/v1/anything", host, extra=[("Authorization", "Bearer sandbox")])
            assert_refused(response, 502, "secret_unavailable", rule=host.removesuffix(".test"))
            assert f"secret {secret!r} is unavailable" in response.text, response.text
            # where the secret should have come from (a path, a variable) is for the operator only
            assert why not in response.text
            assert_no_leak(response_bytes(response), SECRETS)
        client = tls.client
    assert not cred.void.touched, (cred.void.connections, cred.void.requests)
    lines = [line for line in audit_for(cred.gateway, client, count=3, since=start) if line["event"] == "request"]
    assert [(line["decision"], line["reason"], line["status"]) for line in lines] == [
        ("deny", "secret_unavailable", 502)] * 2
    assert all(secret in line["message"] for line in lines)
    assert not any(line.get("injected") for line in lines)
    assert why in cred.gateway.log()


def _bearer(server, host: str) -> list[str]:
    return [r.header_all("authorization")[0] for r in server.for_host(host)]


def test_rewritten_secret_file_is_picked_up_without_restart(cred):
    path = cred.rotating_file
    write_secret(path, ROTATE_INITIAL)
    assert fetch(cred.gateway, "rotate.test", "/v1/anything").status == 200
    rotated = "rot-0001-Rotated-Value-cccc"  # same length: only the content (and mtime) change
    assert len(rotated) == len(ROTATE_INITIAL)
    cred.remember(rotated)
    # A same-size rewrite is told apart by its mtime: on a coarse clock the rewrite may keep the old
    # one, so its mtime is set a second later, as a real rewrite's would be.
    earlier = path.stat().st_mtime_ns
    write_secret(path, rotated)
    os.utime(path, ns=(earlier + 1_000_000_000, earlier + 1_000_000_000))
    response = fetch(cred.gateway, "rotate.test", "/v1/anything")
    assert response.status == 200
    assert _bearer(cred.rotate, "rotate.test") == [f"Bearer {ROTATE_INITIAL}", f"Bearer {rotated}"]
    assert_no_leak(response_bytes(response), {"new": rotated})  # the new value is redacted at once
    # on a kept-alive tunnel too, and with a longer value
    longer = "rot-0002-Rotated-Again-And-Longer-dddd"
    cred.remember(longer)
    cred.rotate.reset()
    with tls_to(cred.gateway, "rotate.test") as tls:
        assert get(tls, "/v1/anything/1", "rotate.test").status == 200
        write_secret(path, longer)
        second = get(tls, "/v1/anything/2", "rotate.test")
        assert second.status == 200
    assert _bearer(cred.rotate, "rotate.test") == [f"Bearer {rotated}", f"Bearer {longer}"]
    assert_no_leak(response_bytes(second), {"longer": longer})
    # the file disappears for a moment (502), then comes back (served again)
    path.unlink()
    response = fetch(cred.gateway, "rotate.test", "/v1/anything")
    assert_refused(response, 502, "secret_unavailable", rule="rotate")
    write_secret(path, ROTATE_INITIAL)
    assert fetch(cred.gateway, "rotate.test", "/v1/anything").status == 200
    assert _bearer(cred.rotate, "rotate.test")[-1] == f"Bearer {ROTATE_INITIAL}"


def test_kubernetes_data_symlink_swap_is_picked_up(cred):
    directory = cred.k8s_dir
    assert (directory / "token").is_symlink() and (directory / "..data").is_symlink()
    first = fetch(cred.gateway, "k8s.test", "/v1/anything")
    assert first.status == 200
    current = _bearer(cred.rotate, "k8s.test")[-1]
    assert current.startswith("Bearer k8s-")
    new_values = ["k8s-0002-Swapped-Value-eeee", "k8s-0003-Swapped-Value-ffff"]
    for i, value in enumerate(new_values):
        cred.remember(value)
        k8s_publish(directory, value, f"2026_02_0{i + 1}_00_00_00.00000000{i}")
        response = fetch(cred.gateway, "k8s.test", "/v1/anything")
        assert response.status == 200
        assert _bearer(cred.rotate, "k8s.test")[-1] == f"Bearer {value}"
        assert (directory / "token").read_text().strip() == value
        assert_no_leak(response_bytes(response), {"k8s": value})
    assert K8S_INITIAL not in [v.removeprefix("Bearer ") for v in _bearer(cred.rotate, "k8s.test")[1:]]
