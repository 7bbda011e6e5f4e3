"""The nginx origin (origin.bench): its certificate and files, its configuration, its sanity check,
and the private /etc/hosts under which the baseline proxy and direct clients find it."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from lib.log import BenchError
from lib.names import BIG_PATH, ORIGIN_NAME, SMALL_BODY, SMALL_PATH
from lib.processes import Service, clean_env, port_in_use, wait_for_port, wait_listening
from lib.session import Setup


def hosts_wrapper(workdir: Path, origin_ip: str) -> list[str]:
    """A command prefix under which origin.bench resolves to the origin (bare mitmdump, direct hey)."""
    try:
        current = socket.gethostbyname(ORIGIN_NAME)
    except OSError:
        current = None
    if current == origin_ip:
        return []
    hosts = workdir / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{origin_ip} {ORIGIN_NAME}\n")
    prefix = ["unshare", "--mount", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    probe = subprocess.run(prefix + ["getent", "hosts", ORIGIN_NAME], capture_output=True, text=True)
    if probe.returncode != 0 or origin_ip not in probe.stdout:
        raise BenchError(
            f"cannot make {ORIGIN_NAME} resolve for the baseline proxy: `unshare --mount` failed "
            f"({probe.stderr.strip() or probe.returncode}); run as root, or add '{origin_ip} {ORIGIN_NAME}' to /etc/hosts"
        )
    return prefix


def make_origin_files(setup: Setup, bulk_bytes: int) -> None:
    """The throw-away CA, a certificate for origin.bench and the document root (shared by both origins)."""
    from lib.pki import TestPKI  # the project's throw-away CA (bench/lib/pki.py; the tests use it too)

    pki = TestPKI(setup.workdir / "pki")
    setup.origin_cert = pki.issue([ORIGIN_NAME], stem="origin")
    setup.ca_cert = pki.ca_cert
    www = setup.www = setup.workdir / "www"
    www.mkdir()
    (www / SMALL_PATH.lstrip("/")).write_bytes(SMALL_BODY)
    with open(www / BIG_PATH.lstrip("/"), "wb") as f:  # sparse file: zeros, no disk writes
        f.truncate(bulk_bytes)


def start_nginx(setup: Setup, name: str, listen_ip: str, tools: dict[str, str], netns: str | None = None) -> Service:
    """nginx on listen_ip:443, in the host namespace or (transparent) in namespace `netns`."""
    assert setup.origin_cert is not None
    cert, key = setup.origin_cert
    tmp = setup.workdir / f"{name}-tmp"
    tmp.mkdir()
    conf = setup.workdir / f"{name}.conf"
    error_log = setup.workdir / f"{name}-error.log"
    conf.write_text(f"""
user root;
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {setup.workdir}/{name}.pid;
error_log {error_log} warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    open_file_cache max=100 inactive=300s;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ text/plain txt; application/octet-stream bin; }}
    default_type application/octet-stream;
    server {{
        listen {listen_ip}:443 ssl backlog=4096;
        server_name {ORIGIN_NAME};
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_session_cache shared:SSL:10m;
        root {setup.www};
        location / {{ try_files $uri =404; }}
    }}
}}
""")
    in_ns = ["ip", "netns", "exec", netns] if netns else []
    if not netns and port_in_use(listen_ip, 443):
        raise BenchError(f"{listen_ip}:443 is already in use: pick another --origin-ip in 127.0.0.0/8")
    nginx = Service(name, setup.cpu(1) + in_ns + [tools["nginx"], "-p", str(setup.workdir), "-e", str(error_log),
                                                 "-c", str(conf)],
                    setup.workdir / f"{name}.out", stop_signal=signal.SIGTERM)
    setup.nginx[name] = nginx.start()
    if netns:
        wait_listening(nginx.proc, nginx.pid, 443, address=listen_ip)
    else:
        wait_for_port(listen_ip, 443, nginx.proc)
    # direct sanity check, without any proxy (transparent: from the gateway namespace, over the veth)
    sanity_ns = ["ip", "netns", "exec", setup.net.topology.gw] if netns and setup.net else []
    out = subprocess.run(sanity_ns + ["curl", "-sS", "--fail", "--max-time", "10", "--cacert", str(setup.ca_cert),
                                      "--resolve", f"{ORIGIN_NAME}:443:{listen_ip}", f"https://{ORIGIN_NAME}{SMALL_PATH}"],
                         capture_output=True, env=clean_env())
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"origin sanity check ({name}) failed: {out.stderr.decode(errors='replace')}\n{nginx.tail()}")
    return nginx
