"""Starting each configuration (mitmdump, the gateway, squid, or none), and checking that it does what
it is said to do before anything is measured through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lib.configurations import gateway_policy_text, label
from lib.log import BenchError
from lib.names import DENIED_NAME, ORIGIN_NAME, PROJECT_ROOT, SMALL_BODY, SMALL_PATH, TRANSPARENT_ORIGIN_IP, TRANSPARENT_PORTS
from lib.processes import Service, clean_env, free_port, wait_for_port, wait_listening
from lib.procfs import python_pid
from lib.session import Proxy, Setup


def start_proxy(setup: Setup, key: str, tools: dict[str, str], policy_text: str | None = None) -> Proxy:
    """Start configuration `key` and check it really does what it is said to do; BenchError if not."""
    if key == "direct":
        proxy = Proxy(key, label(key), None, setup.origin_ip, 443, setup.ca_cert, intercepts=False)
        sanity_check(setup, proxy)
        return proxy
    if key == "squid":
        return start_squid(setup, tools)
    transparent = key.endswith("_transparent")
    if transparent:
        assert setup.net is not None
        role = key.removesuffix("_transparent")
        port = TRANSPARENT_PORTS[role]
        mode = f"transparent@0.0.0.0:{port}"
        host = "0.0.0.0"
        wrap = ["ip", "netns", "exec", setup.net.topology.gw]
        origin_ip = TRANSPARENT_ORIGIN_IP
    else:
        port = free_port()
        mode = f"regular@127.0.0.1:{port}"
        host = "127.0.0.1"
        wrap = setup.wrap_hosts
        origin_ip = setup.origin_ip
    confdir = setup.workdir / f"confdir-{key}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    kind = key.removesuffix("_bulk")
    workers = 1
    cpu: int | None = 0
    passthrough = key.endswith("passthrough")
    if key.startswith("gateway"):
        policy = setup.workdir / f"{key}-policy.yaml"
        policy.write_text(policy_text or gateway_policy_text(origin_ip, transparent, passthrough=passthrough))
        cmd = [sys.executable, "-m", "gateway", "run", "-q", "--policy", str(policy),
               "--mode", mode, "--confdir", str(confdir),
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if setup.features.get("workers") is None:  # supported: say how many, the default is every core
            workers = (os.cpu_count() or 1) if kind == "gateway_workers" else 1
            cmd += ["--workers", str(workers)]
        if kind == "gateway_workers":
            cpu = None  # N workers run on every CPU (the scaling figure pins and throttles them)
        if setup.gateway_audit:
            cmd += ["--audit-log", str(setup.workdir / f"{key}-audit.jsonl")]
        env["PYTHONPATH"] = str(PROJECT_ROOT)
    else:
        cmd = [tools["mitmdump"], "-q", "--mode", mode,
               "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy", "--set", "flow_detail=0",
               "--set", "termlog_verbosity=warn",
               "--set", f"ssl_verify_upstream_trusted_ca={setup.ca_cert}"]
        if key == "mitmdump_stream":
            cmd += ["--set", "stream_large_bodies=1m"]
        if passthrough:
            cmd += ["--set", "ignore_hosts=.*"]  # mitmproxy's TLS passthrough: every host is relayed unread
    service = Service(key, setup.cpu(cpu) + wrap + cmd, setup.workdir / f"{key}.log", env=env, cwd=PROJECT_ROOT)
    service.start()
    proxy = Proxy(key, label(key, workers if kind == "gateway_workers" else None), service, host, port,
                  setup.ca_cert if passthrough else confdir / "mitmproxy-ca-cert.pem", intercepts=not passthrough,
                  workers=workers, nginx="nginx-transparent" if transparent else "nginx",
                  sandbox_ns=setup.net.sandboxes[key.removesuffix("_transparent")].ns if transparent else None,
                  cmd=cmd)
    try:
        if transparent:
            wait_listening(service.proc, service.pid, port)
        else:
            wait_for_port(proxy.host, port, service.proc)
        deadline = time.monotonic() + 15
        ca = confdir / "mitmproxy-ca-cert.pem"
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy.pid = python_pid(service.pid)
        if workers > 1:
            deadline = time.monotonic() + 20
            while len(proxy.pids()) < workers + 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            if len(proxy.pids()) < workers + 1:
                raise BenchError(f"expected a supervisor and {workers} workers, found processes {proxy.pids()}")
        sanity_check(setup, proxy)
    except Exception as exc:
        service.stop()
        raise BenchError(f"{key} did not start: {exc}\n{service.tail()}") from None
    return proxy


def start_squid(setup: Setup, tools: dict[str, str]) -> Proxy:
    """squid as a plain CONNECT proxy: no cache, no ssl-bump, foreground (-N), everything under the
    work directory, allowed to CONNECT to origin.bench:443 only, from loopback only."""
    if "squid" not in tools:
        raise BenchError("squid is not installed (apt-get install -y squid)")
    # its own directory, outside the (root-only) work directory: squid drops privileges to its user
    d = Path(tempfile.mkdtemp(prefix="egress-bench-squid-"))
    setup.extra_dirs.append(d)
    d.chmod(0o755)
    port = free_port()
    hosts = d / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{setup.origin_ip} {ORIGIN_NAME}\n")
    conf = d / "squid.conf"
    conf.write_text(f"""# generated by bench/run.py: a minimal CONNECT-only squid on loopback
http_port 127.0.0.1:{port}
visible_hostname egress-bench-squid
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log none
cache_store_log none
coredump_dir {d}
cache deny all
cache_mem 8 MB
hosts_file {hosts}
dns_nameservers 127.0.0.1
max_filedescriptors 16384
workers 1
shutdown_lifetime 1 seconds
netdb_filename none
pinger_enable off
acl bench_clients src 127.0.0.0/8
acl bench_origin dstdomain {ORIGIN_NAME}
acl bench_port port 443
acl CONNECT method CONNECT
http_access allow CONNECT bench_clients bench_origin bench_port
http_access deny all
""")
    try:
        import pwd

        user = pwd.getpwnam("proxy")  # Debian's squid drops privileges to this user
        for path in (d, hosts, conf):
            os.chown(path, user.pw_uid, user.pw_gid)
    except KeyError:
        pass
    parse = subprocess.run([tools["squid"], "-k", "parse", "-f", str(conf)], capture_output=True, text=True)
    if parse.returncode != 0:
        raise BenchError(f"squid -k parse failed: {(parse.stderr or parse.stdout).strip()[-500:]}")
    cmd = [tools["squid"], "-N", "-f", str(conf)]
    service = Service("squid", setup.cpu(0) + cmd, setup.workdir / "squid.log", stop_signal=signal.SIGINT)
    service.start()
    proxy = Proxy("squid", label("squid"), service, "127.0.0.1", port, setup.ca_cert, intercepts=False, cmd=cmd)
    try:
        wait_for_port("127.0.0.1", port, service.proc)
        proxy.pid = python_pid(service.pid)
        sanity_check(setup, proxy)
    except Exception as exc:
        service.stop()
        tail = (d / "cache.log").read_text(errors="replace")[-1500:] if (d / "cache.log").exists() else ""
        raise BenchError(f"squid did not start: {exc}\n{service.tail()}\n{tail}") from None
    return proxy


def client_prefix(setup: Setup, proxy: Proxy) -> list[str]:
    """Transparent: run the client inside the proxy's sandbox (no proxy settings at all); direct: under
    the private /etc/hosts that names the origin."""
    if proxy.sandbox_ns:
        return ["ip", "netns", "exec", proxy.sandbox_ns]
    if proxy.service is None:
        return list(setup.wrap_hosts)
    return []


def client_proxy_args(proxy: Proxy) -> list[str]:
    return [] if proxy.sandbox_ns or proxy.service is None else ["-x", proxy.url]


def sanity_check(setup: Setup, proxy: Proxy) -> None:
    """A real request through the configuration, verifying the CA it should present: the proxy's CA when
    it intercepts (the origin's certificate is not signed by it), the origin's own when it passes TLS
    through. The gateway must also refuse a name its policy does not allow."""
    out = subprocess.run(client_prefix(setup, proxy) + ["curl", "-sS", "--fail", "--max-time", "15"]
                         + client_proxy_args(proxy) + ["--cacert", str(proxy.client_ca),
                                                       f"https://{ORIGIN_NAME}{SMALL_PATH}"],
                         capture_output=True, env=clean_env())
    if out.returncode != 0 or out.stdout != SMALL_BODY:
        raise BenchError(f"request through {proxy.key} failed: {out.stderr.decode(errors='replace')}")
    if not proxy.key.startswith("gateway"):
        return
    if proxy.sandbox_ns:
        # transparent: the sandbox dials the origin's own address with a refused SNI: 403 after the handshake
        out = subprocess.run(client_prefix(setup, proxy) + [
            "curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(proxy.client_ca),
            "--resolve", f"{DENIED_NAME}:443:{TRANSPARENT_ORIGIN_IP}", f"https://{DENIED_NAME}/"],
            capture_output=True, text=True, env=clean_env())
        if out.stdout.strip() != "403":
            raise BenchError(f"the transparent gateway did not refuse {DENIED_NAME} (answered {out.stdout.strip()!r})")
    else:
        out = subprocess.run(["curl", "-sS", "--max-time", "15", "-o", "/dev/null", "-w", "%{http_connect}",
                              "-x", proxy.url, "--cacert", str(proxy.client_ca), f"https://{DENIED_NAME}/"],
                             capture_output=True, text=True, env=clean_env())
        if out.stdout.strip() != "403":
            raise BenchError(f"{proxy.key} did not refuse {DENIED_NAME} (CONNECT answered {out.stdout.strip()!r})")
