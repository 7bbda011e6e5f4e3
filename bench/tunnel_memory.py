#!/usr/bin/env python3
"""Memory per idle tunnel: the gateway (one worker) against bare mitmdump, in one run (issue 18).

    python bench/tunnel_memory.py                       # N=1000, 2 rounds, both configurations
    python bench/tunnel_memory.py --count 500 --rounds 3
    python bench/tunnel_memory.py --tracemalloc         # also: what the gateway's Python objects are, per tunnel
    python bench/tunnel_memory.py --sse --count 500     # open SSE streams instead of idle tunnels

Everything runs on loopback, on TCP ports --port-base .. --port-base+3 (default 31500..31503):

- a TLS origin (this script, `origin` subcommand: asyncio, HTTP/1.1 keep-alive, 174-byte answers)
  named origin.bench, with a certificate from a throw-away CA (bench/lib/pki.py);
- bare mitmdump intercepting, started like bench/run.py starts it (no script, lazy connections,
  flow_detail=0), under a private /etc/hosts that names the origin (`unshare --mount`, as root);
- the gateway, `python -m gateway run --workers 1 -q`, with a policy that allows GET/HEAD to the
  origin's name and port (static_hosts), upstream verified against the throw-away CA.

Each round starts fresh processes, in alternating order, and for each: a warm-up of --warmup tunnels
opened and closed (certificate generation, caches, lazy imports: one-time costs, not per tunnel), RSS
read, then --count tunnels opened through it by bench/idle_tunnels.py (CONNECT, TLS through the
tunnel, one GET answered, then idle), RSS read again after a settling pause. KiB per tunnel =
(RSS with the tunnels - RSS before) / tunnels open. The ratio gateway / mitmdump is taken per round.

--sse: each tunnel's GET opens a server-sent-events stream instead (`text/event-stream`, chunked; the
origin sends one event and then holds the stream open, idle, until the client closes it); a tunnel
counts once the client has that first event. mitmdump streams it as its users must configure it for
SSE (`--set stream_large_bodies=1`: a chunked body streams as soon as its buffer holds more than a
byte; mitmproxy's server_side_events addon otherwise warns that the events are swallowed). The gateway
needs no option. Configurations `gateway_bound` and `baseline_bound` ask for /bound/sse, whose rule
injects a credential, so the response streams through the redactor; the others ask for /unbound/sse.

--tracemalloc adds one more run of each configuration with tracemalloc on (a sitecustomize.py in the work directory,
enabled by an environment variable: it starts tracemalloc and writes a snapshot on SIGRTMIN+5), and
prints the per-tunnel difference of the two snapshots grouped by the allocating line and by owner
(the gateway's own code - the innermost frame of addons/ or gateway/ - mitmproxy, asyncio, the rest).
tracemalloc slows everything down and costs memory itself: its RSS is not used for the figures.

Not a test: pytest does not collect bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import resource
import shutil
import signal
import socket
import ssl
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

ORIGIN_NAME = "origin.bench"
ORIGIN_IP = "127.0.0.1"
SOURCES = "127.0.0.201,127.0.0.202,127.0.0.203,127.0.0.204"  # the client spreads over these
BODY = b"hello from origin.bench: a small static body for keep-alive and new-connection rounds.\n" * 2
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
SSE_EVENT = b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Sure, here is"}}\n\n'
SECRET_ENV = "EGRESS_BENCH_SSE_KEY"

SITECUSTOMIZE = '''\
import os
if os.environ.get("EGRESS_BENCH_TRACEMALLOC"):
    import collections, ctypes, gc, pickle, signal, tracemalloc
    _frames = int(os.environ.get("EGRESS_BENCH_TRACEMALLOC_FRAMES", "12"))
    if _frames:  # 0: no tracemalloc, only the process's figures and the objects by type
        tracemalloc.start(_frames)
    _out = os.environ["EGRESS_BENCH_TRACEMALLOC"]

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    def _malloc_in_use():
        try:
            f = ctypes.CDLL("libc.so.6").mallinfo2
            f.restype = _Mallinfo2
            m = f()
            return m.uordblks + m.hblkhd
        except (OSError, AttributeError):
            return None

    def _rss():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])

    def _details(objects):
        """What the common kinds of objects are: bound methods by method, functions and coroutines by
        name, tasks by coroutine, cells by content, partials by function. (Not who holds what: a pass
        of gc.get_referents over every object aborted CPython 3.12.1 on a corrupt FutureIter free list.)"""
        import asyncio, functools, types as t
        out = collections.Counter()
        name = lambda x: f"{type(x).__module__}.{type(x).__qualname__}"
        import sys
        own = ("addons", "gateway", "mitmproxy", "h11", "asyncio")
        for o in objects:
            k = type(o)
            module = k.__dict__.get("__module__") if isinstance(k, type) else None
            if isinstance(module, str) and module.startswith(own) and k.__dictoffset__:
                # an instance whose attributes live in a dict of their own, not CPython's inline values
                # (found among its referents without touching __dict__, which would make one)
                for r in gc.get_referents(o):
                    if type(r) is dict and r and all(type(a) is str and getattr(o, a, r) is v for a, v in r.items()):
                        out["~dict of " + name(o)] += 1
                        out["~bytes dict of " + name(o)] += sys.getsizeof(r)
                        break
            out["~bytes " + name(o)] += sys.getsizeof(o)  # (the object's own size: not what it refers to)
            if k is t.MethodType:
                out["~method " + name(o.__self__) + "." + getattr(o.__func__, "__name__", "?")] += 1
            elif k is t.FunctionType:
                out["~function " + o.__qualname__] += 1
            elif k is t.CoroutineType:
                out["~coroutine " + o.__qualname__] += 1
            elif isinstance(o, asyncio.Task):  # (3.12.1's get_coro() crashes on a task that ended eagerly)
                out["~task " + ("(done)" if o.done() else getattr(o.get_coro(), "__qualname__", "?"))] += 1
            elif k is t.CellType:
                try:
                    out["~cell " + name(o.cell_contents)] += 1
                except ValueError:
                    out["~cell (empty)"] += 1
            elif k is functools.partial:
                out["~partial " + getattr(o.func, "__qualname__", "?")] += 1
            elif k is tuple:  # by length and the types of the first two items
                out[f"~tuple {len(o)}: " + ", ".join(name(x) for x in o[:2])] += 1
        return out

    def _guarded(name):
        try:
            _dump_to(name)
        except BaseException:
            import traceback
            with open(f"{_out}/{name}.error", "w") as f:
                f.write(traceback.format_exc())

    def _dump(signum, frame):
        """Run the dump as a callback of the event loop, not inside whatever bytecode the signal
        interrupted."""
        import asyncio
        name = open(f"{_out}/cmd").read().strip()  # snapshot name; "-collect" suffix: full collection first
        loop = asyncio.events._get_running_loop()
        if loop is not None:
            loop.call_soon_threadsafe(_guarded, name)
        else:
            _guarded(name)

    def _dump_to(name):
        collected = None
        if name.endswith("-collect"):
            frozen = gc.get_freeze_count()
            gc.unfreeze()
            collected = gc.collect()
            if frozen:
                gc.freeze()
        rss, in_use = _rss(), _malloc_in_use()  # first: what follows allocates for itself
        traced = tracemalloc.get_traced_memory()[0] if _frames else None
        snap = tracemalloc.take_snapshot() if _frames else None
        frozen = gc.get_freeze_count()
        if frozen:
            gc.unfreeze()
        objects = gc.get_objects()
        types = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
        if os.environ.get("EGRESS_BENCH_DETAILS"):
            types.update(_details(objects))
        del objects
        if frozen:
            gc.freeze()
        info = {"rss_kib": rss, "malloc_in_use": in_use, "traced": traced,
                "frozen": frozen, "tracked": sum(types.values()), "collected": collected}
        with open(f"{_out}/{name}.pickle", "wb") as f:
            pickle.dump((snap, info, types), f)
        with open(f"{_out}/{name}.done", "w") as f:
            f.write("ok")

    signal.signal(signal.SIGRTMIN + 5, _dump)  # (mitmproxy takes SIGUSR1 and SIGUSR2)
'''


# ---------------------------------------------------------------------------------------------- origin

async def _serve_origin(port: int, cert: str, key: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(BODY)) + BODY

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    break
                if b"/sse" in head.split(b"\r\n", 1)[0]:  # an event stream: one event, then held open, idle
                    writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(SSE_EVENT), SSE_EVENT))
                    await writer.drain()
                    while await reader.read(65536):
                        pass
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, ORIGIN_IP, port, ssl=ctx, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def origin_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args(argv)
    _raise_nofile(20000)
    asyncio.run(_serve_origin(a.port, a.cert, a.key))
    return 0


# --------------------------------------------------------------------------------------------- helpers

def _raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def log(msg: str) -> None:
    print(f"[tunnel_memory] {msg}", file=sys.stderr, flush=True)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class ProxyDidNotListen(RuntimeError):
    pass


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def own_pid(proc: subprocess.Popen) -> int:
    """The proxy's Python process: wrappers (unshare, sh) exec, so normally proc.pid itself."""
    for _ in range(50):
        try:
            cmd = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        except OSError:
            break
        if b"python" in cmd or b"mitmdump" in cmd:
            return proc.pid
        time.sleep(0.1)
    return proc.pid


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)


class Run:
    def __init__(self, args, configs: list[str]) -> None:
        self.args = args
        self.python = sys.executable
        self.mitmdump = args.mitmdump or str(Path(sys.executable).with_name("mitmdump"))
        self.origin_port = args.port_base
        self.ports = {"mitmdump": args.port_base + 1, "gateway": args.port_base + 2, "gateway_tm": args.port_base + 3,
                      "baseline": args.port_base + 4, "gateway_bound": args.port_base + 5,
                      "baseline_bound": args.port_base + 6, "gateway_w2": args.port_base + 7,
                      "floor": args.port_base + 8}
        for port in (self.origin_port, self.ports["gateway_tm"], *(self.ports[c] for c in configs)):
            if not port_free(port):  # (only the ports this run listens on: the others may be clients' now)
                raise RuntimeError(f"port {port} is taken (use --port-base)")
        self.work = Path(tempfile.mkdtemp(prefix="egress-tunnel-mem-"))  # (after the check: none left behind)
        from lib.pki import TestPKI

        pki = TestPKI(self.work / "pki")
        self.ca = str(pki.ca_cert)
        self.cert, self.key = (str(p) for p in pki.issue([ORIGIN_NAME], [ORIGIN_IP], stem="origin"))
        hosts = self.work / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{ORIGIN_IP} {ORIGIN_NAME}\n")
        self.hosts_prefix = ["unshare", "--mount", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                             str(hosts)]
        probe = subprocess.run(self.hosts_prefix + ["getent", "hosts", ORIGIN_NAME], capture_output=True, text=True)
        if probe.returncode != 0:
            raise RuntimeError(f"cannot give mitmdump a private /etc/hosts (run as root): {probe.stderr.strip()}")
        self.policy = self.work / "policy.yaml"
        self.policy.write_text(f"""version: 1
network:
  deny_ip_ranges: default
  allow_ip_ranges: [127.0.0.0/8]
resolver:
  static_hosts:
    {ORIGIN_NAME}: [{ORIGIN_IP}]
secrets:
  key: {{env: {SECRET_ENV}}}
rules:
  - id: bench-bound
    hosts: [{ORIGIN_NAME}]
    ports: [{self.origin_port}]
    methods: [GET]
    paths: ["/bound/**"]
    inject:
      - header: Authorization
        value: "Bearer ${{secrets.key}}"
  - id: bench-origin
    hosts: [{ORIGIN_NAME}]
    ports: [{self.origin_port}]
    methods: [GET, HEAD]
    paths: ["/small.txt", "/unbound/**"]
""")
        self.secret = "sk-bench-" + secrets.token_urlsafe(80)  # a credential of an API key's length
        (self.work / "site").mkdir()
        (self.work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.origin = subprocess.Popen([self.python, __file__, "origin", "--port", str(self.origin_port),
                                        "--cert", self.cert, "--key", self.key],
                                       stdout=subprocess.DEVNULL, stderr=open(self.work / "origin.log", "ab"))
        wait_port(self.origin_port, self.origin)

    def close(self) -> None:
        stop(self.origin)
        if self.args.keep_workdir:
            log(f"work directory kept: {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def _listen_port(self, preferred: int) -> int:
        """`preferred`, or the next free port above the configurations' own: the ports of this range may
        be ephemeral ports of clients at the moment a proxy starts."""
        for port in (preferred, *range(self.args.port_base + 10, self.args.port_base + 50)):
            if port_free(port):
                return port
        raise RuntimeError(f"no free port near {preferred} (use --port-base)")

    def start(self, key: str, tracemalloc_dir: Path | None = None, frames: int = 12) -> tuple[subprocess.Popen, str]:
        """Start configuration `key`; returns the process and the CA its clients must trust. A proxy that
        exits before it listens (its port taken, between the check and its bind, by a client's ephemeral
        port) is started again on another port, twice at most."""
        for attempt in range(3):
            try:
                return self._start_once(key, tracemalloc_dir, frames)
            except ProxyDidNotListen:
                if attempt == 2:
                    raise
                log(f"  {key} did not listen (its port taken?): starting it again")
        raise AssertionError("unreachable")

    def _start_once(self, key: str, tracemalloc_dir: Path | None, frames: int) -> tuple[subprocess.Popen, str]:
        port = self._listen_port(self.ports["gateway_tm" if tracemalloc_dir else key])
        confdir = self.work / f"confdir-{key}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env[SECRET_ENV] = self.secret
        env.pop("EGRESS_BENCH_TRACEMALLOC", None)
        root = Path(self.args.baseline) if key.startswith("baseline") else PROJECT_ROOT
        if key.startswith(("gateway", "baseline")):
            workers = "2" if key.endswith("_w2") else "1"  # (bench/worker_scaling.py)
            cmd = [self.python, "-m", "gateway", "run", "-q", "--workers", workers, "--policy", str(self.policy),
                   "--mode", f"regular@127.0.0.1:{port}", "--confdir", str(confdir),
                   "--set", f"ssl_verify_upstream_trusted_ca={self.ca}"]
            env["PYTHONPATH"] = str(root)
        elif key == "floor":  # mitmproxy with only the addons serving needs (bench/mitmproxy_floor.py)
            cmd = self.hosts_prefix + [
                self.python, str(BENCH_DIR / "mitmproxy_floor.py"), "--listen", f"127.0.0.1:{port}",
                "--confdir", str(confdir), "--upstream-ca", str(self.ca)]
        else:
            cmd = self.hosts_prefix + [
                self.mitmdump, "-q", "--mode", f"regular@127.0.0.1:{port}", "--set", f"confdir={confdir}",
                "--set", "connection_strategy=lazy", "--set", "flow_detail=0", "--set", "termlog_verbosity=warn",
                "--set", f"ssl_verify_upstream_trusted_ca={self.ca}"]
            if self.args.sse:
                cmd[-2:-2] = ["--set", "stream_large_bodies=1"]  # mitmproxy's SSE workaround (issue 4469)
        if tracemalloc_dir is not None:
            env["PYTHONPATH"] = f"{self.work / 'site'}{os.pathsep}{env.get('PYTHONPATH', '')}"
            env["EGRESS_BENCH_TRACEMALLOC"] = str(tracemalloc_dir)
            env["EGRESS_BENCH_TRACEMALLOC_FRAMES"] = str(frames)
            if self.args.details:
                env["EGRESS_BENCH_DETAILS"] = "1"
        logf = open(self.work / f"{key}{'-tm' if tracemalloc_dir else ''}.log", "ab")
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=root)
        proc.port = port  # type: ignore[attr-defined]
        try:
            wait_port(port, proc, 60)
        except RuntimeError as exc:
            stop(proc)
            raise ProxyDidNotListen(str(exc)) from exc
        ca = confdir / "mitmproxy-ca-cert.pem"
        deadline = time.monotonic() + 15
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc, str(ca)

    def tunnels(self, proc: subprocess.Popen, ca: str, count: int, key: str = "") -> subprocess.Popen:
        """Open `count` idle tunnels (--sse: held event streams of configuration `key`'s kind) through the
        proxy; returns the client once they are open (its first line, the report, is in client.report).
        Close its stdin to close them."""
        path = ("/bound/sse" if key.endswith("_bound") else "/unbound/sse") if self.args.sse else "/small.txt"
        cmd = [self.python, str(BENCH_DIR / "idle_tunnels.py"), "--proxy", f"127.0.0.1:{proc.port}",  # type: ignore[attr-defined]
               "--target", f"{ORIGIN_NAME}:{self.origin_port}", "--cafile", ca, "--path", path,
               "--count", str(count), "--concurrency", "32", "--sources", SOURCES, "--timeout", "120"]
        cmd += ["--sse"] if self.args.sse else []
        client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = client.stdout.readline()
        if not line:
            client.wait(5)
            raise RuntimeError(f"idle tunnel client failed: {client.stderr.read()[-800:]}")
        client.report = json.loads(line)  # type: ignore[attr-defined]
        return client

    @staticmethod
    def close_tunnels(client: subprocess.Popen) -> dict:
        try:
            out, _ = client.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            client.kill()
            out, _ = client.communicate()
        tail = {}
        for ln in out.splitlines():
            try:
                tail.update(json.loads(ln))
            except ValueError:
                pass
        return tail

    def measure(self, key: str) -> dict:
        proc, ca = self.start(key)
        try:
            pid = own_pid(proc)
            if self.args.warmup:
                warm = self.tunnels(proc, ca, self.args.warmup, key)
                self.close_tunnels(warm)
                if warm.report["failed"]:  # type: ignore[attr-defined]
                    raise RuntimeError(f"{key}: warm-up tunnels failed: {warm.report}")  # type: ignore[attr-defined]
                time.sleep(2.0)
            before = rss_kib(pid)
            cpu = cpu_seconds(pid)
            client = self.tunnels(proc, ca, self.args.count, key)
            cpu = cpu_seconds(pid) - cpu
            time.sleep(self.args.settle)
            with_tunnels = max(rss_kib(pid), 0)
            time.sleep(0.5)
            with_tunnels = max(with_tunnels, rss_kib(pid))
            tail = self.close_tunnels(client)
            report = client.report  # type: ignore[attr-defined]
            n = report["open"]
            return {"config": key, "open": n, "failed": report["failed"], "errors": report.get("errors"),
                    "open_seconds": report["seconds"], "still_open_at_end": tail.get("still_open_at_end"),
                    "rss_before_kib": before, "rss_tunnels_kib": with_tunnels,
                    "kib_per_tunnel": (with_tunnels - before) / n if n else None,
                    "cpu_ms_per_tunnel": 1000 * cpu / n if n else None}
        finally:
            stop(proc)

    def profile(self, key: str, frames: int) -> dict:
        """One run of `key` with the dump handler: tracemalloc with `frames` frames, or none (0)."""
        out = self.work / f"profile-{key}-{frames}"
        out.mkdir(exist_ok=True)
        proc, ca = self.start(key, tracemalloc_dir=out, frames=frames)
        try:
            pid = own_pid(proc)
            if self.args.warmup:
                self.close_tunnels(self.tunnels(proc, ca, self.args.warmup, key))
                time.sleep(2.0)
            before = self._snapshot(pid, out, "before")
            client = self.tunnels(proc, ca, self.args.tm_count, key)
            time.sleep(self.args.settle)
            idle = self._snapshot(pid, out, "tunnels")
            collected = self._snapshot(pid, out, "tunnels-collect")
            self.close_tunnels(client)
            return analyse(before, idle, collected, client.report["open"], self.args.top)  # type: ignore[attr-defined]
        finally:
            stop(proc)

    @staticmethod
    def _snapshot(pid: int, out: Path, name: str):
        (out / "cmd").write_text(name)
        os.kill(pid, signal.SIGRTMIN + 5)
        done = out / f"{name}.done"
        deadline = time.monotonic() + 300
        while not done.exists():
            if (out / f"{name}.error").exists():
                raise RuntimeError(f"the proxy's snapshot failed: {(out / f'{name}.error').read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError("no tracemalloc snapshot from the proxy")
            time.sleep(0.2)
        with open(out / f"{name}.pickle", "rb") as f:
            return pickle.load(f)


# ------------------------------------------------------------------------------------------- tracemalloc

def _owner(filename: str) -> str:
    f = filename.replace(os.sep, "/")
    root = str(PROJECT_ROOT).replace(os.sep, "/") + "/"
    if f.startswith(root + "addons/") or f.startswith(root + "gateway/"):
        return "gateway"
    if "/mitmproxy/" in f:
        return "mitmproxy"
    if "/asyncio/" in f:
        return "asyncio"
    if "/OpenSSL/" in f or f.endswith("/ssl.py") or "/cryptography/" in f:
        return "TLS (pyOpenSSL, ssl)"
    return "other"


def _short(filename: str) -> str:
    f = filename.replace(os.sep, "/")
    for marker in (str(PROJECT_ROOT) + "/", "site-packages/", "lib/python3.12/"):
        if marker in f:
            return f.split(marker, 1)[1]
    return f


def analyse(before, idle, collected, tunnels: int, top: int) -> dict:
    """Per-tunnel difference of two snapshots (with the tunnels, before them): by innermost line, by owner
    of the innermost frame, by the innermost frame that is the gateway's own code, and the objects the
    collector tracks by type; and what a full collection with the tunnels open would free."""
    snap1, info1, types1 = before
    snap2, info2, types2 = idle
    snap3, info3, _ = collected
    diff = snap2.compare_to(snap1, "traceback") if snap1 is not None else []
    by_line: dict[str, int] = {}
    by_owner: dict[str, int] = {}
    by_gateway_frame: dict[str, int] = {}
    for d in diff:
        if not d.size_diff:
            continue
        inner = d.traceback[0]
        line = f"{_short(inner.filename)}:{inner.lineno}"
        by_line[line] = by_line.get(line, 0) + d.size_diff
        owner = _owner(inner.filename)
        by_owner[owner] = by_owner.get(owner, 0) + d.size_diff
        ours = next((fr for fr in d.traceback if _owner(fr.filename) == "gateway"), None)
        key = f"{_short(ours.filename)}:{ours.lineno}" if ours else "(no gateway frame in the traceback)"
        by_gateway_frame[key] = by_gateway_frame.get(key, 0) + d.size_diff

    def per(table: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, round(v / tunnels / 1024, 2)) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:top]]

    types = {k: (types2.get(k, 0) - types1.get(k, 0)) / tunnels for k in set(types1) | set(types2)}
    kib = lambda a, b, unit=1024: round((a - b) / tunnels / unit, 2) if a is not None and b is not None else None
    return {
        "tunnels": tunnels,
        "traced_kib_per_tunnel": kib(info2["traced"], info1["traced"]),
        "traced_kib_per_tunnel_collected": kib(info3["traced"], info1["traced"]),
        "malloc_kib_per_tunnel": kib(info2["malloc_in_use"], info1["malloc_in_use"]),
        "rss_kib_per_tunnel": kib(info2["rss_kib"], info1["rss_kib"], 1),
        "objects_per_tunnel": round((info2["tracked"] - info1["tracked"]) / tunnels, 1),
        "objects_per_tunnel_collected": round((info3["tracked"] - info1["tracked"]) / tunnels, 1),
        "collected_per_tunnel": round(info3["collected"] / tunnels, 1) if info3["collected"] is not None else None,
        "by_owner": per(by_owner), "by_line": per(by_line), "by_gateway_frame": per(by_gateway_frame),
        "types": [(k, round(v, 2)) for k, v in sorted(types.items(), key=lambda kv: -kv[1])
                  if not k.startswith("~")][:top],
        "details": [(k, round(v, 2)) for k, v in sorted(types.items(), key=lambda kv: -abs(kv[1]))
                    if k.startswith("~") and abs(v) >= 0.5][:top * 2],
        "info": [info1, info2, info3],
    }


# ------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["origin"]:
        return origin_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1000, help="idle tunnels per configuration and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", help="mitmdump, gateway (this tree's), baseline (the gateway of the tree --baseline "
                   "names); with --sse also gateway_bound, baseline_bound (default: mitmdump,gateway; with --sse "
                   "mitmdump,gateway,gateway_bound)")
    p.add_argument("--sse", action="store_true", help="each tunnel holds an open SSE stream (one event received)")
    p.add_argument("--baseline", help="another checkout of the gateway (e.g. `git archive` of an older commit), "
                                      "measured as configuration `baseline` in the same rounds")
    p.add_argument("--warmup", type=int, default=20, help="tunnels opened and closed before RSS is first read")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between the last tunnel and the RSS reading")
    p.add_argument("--tracemalloc", action="store_true", help="also a tracemalloc profile of each configuration")
    p.add_argument("--native", action="store_true",
                   help="also a profile run of each configuration without tracemalloc: RSS, malloc in use, objects")
    p.add_argument("--details", action="store_true",
                   help="profile runs also break objects down (bound methods, functions, coroutines, tasks, cells, partials)")
    p.add_argument("--profile-only", action="store_true", help="only the profile runs (--tracemalloc, --native)")
    p.add_argument("--tm-count", type=int, default=500, help="tunnels of the profile runs")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--port-base", type=int, default=31500)
    p.add_argument("--mitmdump", help="mitmdump to run (default: next to this Python)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--keep-workdir", action="store_true")
    args = p.parse_args(argv)
    _raise_nofile(20000)
    configs = [c for c in (args.configs or ("mitmdump,gateway,gateway_bound" if args.sse else "mitmdump,gateway"))
               .split(",") if c]
    run = Run(args, configs)
    results: dict = {"count": args.count, "sse": args.sse, "rounds": [], "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              cwd=PROJECT_ROOT).stdout.strip()}
    try:
        if not args.profile_only:
            for r in range(args.rounds):
                order = configs if r % 2 == 0 else configs[::-1]
                this = {}
                for key in order:
                    log(f"round {r + 1}: {key}, {args.count} tunnels")
                    this[key] = run.measure(key)
                    log(f"  {json.dumps(this[key])}")
                results["rounds"].append(this)
        for kind, frames in (("native", 0), ("tracemalloc", 12)):
            if getattr(args, kind):
                results[kind] = {}
                for key in configs:
                    log(f"{kind} profile run of {key}, {args.tm_count} tunnels")
                    results[kind][key] = run.profile(key, frames)
    finally:
        run.close()
    print(report(results, configs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def report(results: dict, configs: list[str]) -> str:
    what = "open SSE stream" if results.get("sse") else "idle tunnel"
    out = [f"# Memory per {what} ({results['count']} tunnels, commit {results['commit']}, {results['started']})", ""]
    if results["rounds"]:
        gateways = [c for c in configs if c != "mitmdump"] if "mitmdump" in configs else []
        out += ["| round | " + " | ".join(f"{c} RSS before, MiB | {c} KiB/tunnel" for c in configs)
                + "".join(f" | {c} / mitmdump" for c in gateways) + " |",
                "|---" * (1 + 2 * len(configs) + len(gateways)) + "|"]
        ratios: dict[str, list[float]] = {c: [] for c in gateways}
        for i, rnd in enumerate(results["rounds"], 1):
            cells = []
            for c in configs:
                m = rnd[c]
                cells += [f"{m['rss_before_kib'] / 1024:.1f}", f"{m['kib_per_tunnel']:.1f}"
                          + ("" if not m["failed"] else f" ({m['failed']} failed)")]
            for c in gateways:
                ratio = rnd[c]["kib_per_tunnel"] / rnd["mitmdump"]["kib_per_tunnel"]
                ratios[c].append(ratio)
                cells.append(f"{ratio:.2f}")
            out.append(f"| {i} | " + " | ".join(cells) + " |")
        med = {c: statistics.median(r[c]["kib_per_tunnel"] for r in results["rounds"]) for c in configs}
        out += ["", "median KiB per tunnel: " + ", ".join(f"{c} {v:.1f}" for c, v in med.items())]
        if all("cpu_ms_per_tunnel" in r[c] for r in results["rounds"] for c in configs):
            cpu = {c: statistics.median(r[c]["cpu_ms_per_tunnel"] for r in results["rounds"]) for c in configs}
            out += ["median CPU ms of the proxy per tunnel opened (CONNECT, two handshakes, one request; noisy): "
                    + ", ".join(f"{c} {v:.2f}" for c, v in cpu.items())]
        out += [f"{c} / mitmdump: median {statistics.median(x):.2f} (rounds: " + ", ".join(f"{y:.2f}" for y in x) + ")"
                for c, x in ratios.items()]
    for kind in ("native", "tracemalloc"):
        for key, tm in (results.get(kind) or {}).items():
            out += ["", f"## {kind} profile, {key}, {tm['tunnels']} tunnels", ""]
            if kind == "tracemalloc":
                out += [f"Per tunnel: {tm['traced_kib_per_tunnel']} KiB of Python allocations "
                        f"({tm['traced_kib_per_tunnel_collected']} KiB after a full collection, which freed "
                        f"{tm['collected_per_tunnel']} objects a tunnel); malloc in use {tm['malloc_kib_per_tunnel']} KiB "
                        f"and RSS {tm['rss_kib_per_tunnel']} KiB (both inflated by tracemalloc's own tables); "
                        f"objects the collector tracks {tm['objects_per_tunnel_collected']} (after the collection).", "",
                        "By owner of the innermost frame (KiB per tunnel): "
                        + ", ".join(f"{k} {v}" for k, v in tm["by_owner"]), "",
                        "| innermost line | KiB per tunnel |", "|---|---:|"]
                out += [f"| {k} | {v} |" for k, v in tm["by_line"]]
                if key.startswith(("gateway", "baseline")):
                    out += ["", "| innermost gateway frame on the stack | KiB per tunnel |", "|---|---:|"]
                    out += [f"| {k} | {v} |" for k, v in tm["by_gateway_frame"]]
            else:
                out += [f"Per tunnel: RSS {tm['rss_kib_per_tunnel']} KiB; malloc in use (mallinfo2: OpenSSL, "
                        f"Python objects over 512 bytes, other native) {tm['malloc_kib_per_tunnel']} KiB; the rest of "
                        f"the RSS is Python's small-object arenas and allocator slack; objects the collector tracks "
                        f"{tm['objects_per_tunnel']} ({tm['objects_per_tunnel_collected']} after a full collection, "
                        f"which freed {tm['collected_per_tunnel']} a tunnel).", ""]
            out += ["", "| type (objects the collector tracks) | per tunnel |", "|---|---:|"]
            out += [f"| {k} | {v} |" for k, v in tm["types"] if not k.startswith("~")]
            details = [(k, v) for k, v in tm["details"]]
            if details:
                out += ["", "| detail (--details) | per tunnel |", "|---|---:|"]
                out += [f"| {k[1:]} | {v} |" for k, v in details]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
