#!/usr/bin/env python3
"""Egress gate throughput, with baselines (direct, Squid, mitmproxy) measured in the same run.

    python3 bench/bench_gate.py [--quick] [--json] [--profile] [--duration S] [--tunnel-mb N]

Everything runs on loopback (127.0.0.1 and a unix socket); no other address is ever used.
Processes (so that no two share one GIL):

  upstream     a small asyncio-Protocol HTTP/1.1 server: a fixed 13-byte 200 answer, keep-alive
  tls-source   a threaded Python-ssl TLS server (cert for bench.test made with `cryptography`)
               that streams N bytes after the handshake
  gate         agentvm.gate.server.Gate with one endpoint (open_endpoint on a unix socket),
               policy compile_egress(extra_allow=[bench.test:PORT...], extra_hosts={bench.test:
               127.0.0.1}); one process, one thread (asyncio): it runs on one core
  squid        Debian's squid (apt-get installed if missing), own minimal config in a temp dir:
               http_port on 127.0.0.1, clients from 127.0.0.1 only, no cache, no access log
  mitmdump     mitmproxy in a venv under /tmp on Python >= 3.12 (pip-installed if missing),
               regular proxy mode; bench.test resolved through a private /etc/hosts bind mount
  loadgen      an asyncio-Protocol client: N keep-alive connections, one request in flight each
               (no pipelining), absolute-form `GET http://bench.test:PORT/` to a proxy, over
               TCP (squid, mitmproxy) or the gate's unix socket (same bytes)

Rows:
  HTTP req/s at concurrency 1 and 10 (fixed duration per cell after a warm-up; p50 latency)
  CONNECT tunnel MB/s: a real TLS 1.3 session to tls-source through the proxy (the gate checks
  the ClientHello's SNI against the CONNECT host), N MB server -> client; median of repeats

The gate's per-sandbox limits are raised for the run (50 req/s / burst 100 by default would
answer 429 and measure the token bucket, not the gate). Targets are printed next to the numbers;
the exit status is 0 whether they are met or not (a benchmark, not a test). Numbers from a loaded
machine are noise: 2 cores are shared by the load generator, the proxy and the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import select
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"  # the only address this benchmark ever talks to
NAME = "bench.test"
BODY = b"hello, world\n"
RESP_KEEP = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY
RESP_CLOSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
              % len(BODY)) + BODY
MITM_VENV = Path("/tmp/agentvm-bench-mitm-venv")
TARGETS = {"gate_vs_squid_c10": 1.0, "tunnel_gate_vs_direct": 0.8, "added_p99_ms": 1.0, "rss_500_mib": 200.0}
DENSITY = 500  # sandboxes, each with one keep-alive connection through the gate


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads), in seconds; None if unknown."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# ============================================================================ child roles


def role_upstream(args) -> None:
    """Fixed-answer HTTP/1.1 server; honours `Connection: close` (the gate sends it)."""

    class H(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t
            self.buf = b""

        def data_received(self, data):
            buf = self.buf + data
            while True:
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    break
                head = buf[:i].lower()
                buf = buf[i + 4:]
                if b"\r\nconnection: close" in head:
                    self.t.write(RESP_CLOSE)
                    self.t.close()
                    return
                self.t.write(RESP_KEEP)
            self.buf = buf

    async def main():
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(H, HOST, 0, backlog=1024)
        print("READY", srv.sockets[0].getsockname()[1], flush=True)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()

    asyncio.run(main())


def role_tls_source(args) -> None:
    """TLS server for bench.test: after the handshake read `N\\n`, send N bytes, close."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    payload = memoryview(os.urandom(1 << 20))
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((HOST, 0))
    ls.listen(64)

    def serve(c: socket.socket) -> None:
        try:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s = ctx.wrap_socket(c, server_side=True)
            line = b""
            while not line.endswith(b"\n"):
                d = s.recv(64)
                if not d:
                    return
                line += d
            left = int(line)
            chunk = 256 * 1024
            while left > 0:
                n = min(left, chunk)
                s.sendall(payload[:n])
                left -= n
            try:
                s.unwrap()
            except (OSError, ssl.SSLError):
                pass
        except (OSError, ssl.SSLError, ValueError):
            pass
        finally:
            c.close()

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("READY", ls.getsockname()[1], flush=True)
    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def gate_hot_path() -> str:
    """How the gate children run the request path (they import the same tree with the same
    environment): compiled (agentvm.gate.accel) or pure Python, and why."""
    try:
        from agentvm.gate import accel
    except ImportError as exc:
        return f"unknown ({exc})"
    return accel.summary()[1]


def role_gate(args) -> None:
    """The agent-vm gate with one endpoint, serving until SIGTERM (optionally under cProfile)."""
    import dataclasses

    from agentvm.gate.policy import EgressLimits, compile_egress
    from agentvm.gate.server import Gate

    pol = compile_egress(None, extra_allow=[f"{NAME}:{p}" for p in args.ports.split(",")],
                         extra_hosts={NAME: HOST})
    pol = dataclasses.replace(pol, limits=EgressLimits(connections=4096, requests_per_second=1e9,
                                                       burst=10**9, bytes_out=1 << 60))
    prof = None
    raise_fd_limit()

    async def main():
        nonlocal prof
        d = Path(args.state)
        gate = Gate(d / "state", d / "logs")
        await gate.open_endpoint("bench", "bench", pol, Path(args.sock))
        for i in range(args.endpoints or 0):  # one more endpoint per simulated sandbox
            await gate.open_endpoint(f"bench-{i}", "bench", pol, Path(f"{args.sock}.{i}"))
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        if args.profile_out:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        print("READY", args.sock, flush=True)
        await stop.wait()
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile_out)
        await gate.close_endpoint("bench")

    from agentvm.gate.server import run

    run(main())


class _LoadConn(asyncio.Protocol):
    __slots__ = ("lg", "t", "buf", "need", "status", "close_after", "t0", "busy")

    def __init__(self, lg: "_LoadGen"):
        self.lg = lg
        self.buf = bytearray()
        self.need = -1
        self.busy = False

    def connection_made(self, t):
        self.t = t
        self.send()

    def send(self):
        self.busy = True
        self.t0 = time.perf_counter()
        self.t.write(self.lg.request)

    def data_received(self, data):
        buf = self.buf
        buf += data
        if self.need < 0:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(buf[:i]).lower()
            try:
                self.status = int(head[9:12])
                j = head.index(b"\r\ncontent-length:")
                k = head.find(b"\r\n", j + 2)
                cl = int(head[j + 17: k if k > 0 else None])
            except ValueError:  # no Content-Length (or garbage): count as an error, drop the connection
                self.lg.errors += 1
                self.busy = False
                self.t.close()
                return
            self.close_after = b"\r\nconnection: close" in head
            self.need = i + 4 + cl
        if len(buf) < self.need:
            return
        del buf[: self.need]
        self.need = -1
        self.busy = False
        lg = self.lg
        lg.record(self.status, time.perf_counter() - self.t0)
        if self.close_after or buf:
            self.t.close()  # connection_lost opens a replacement
            return
        if lg.running:
            self.send()
        else:
            self.t.close()

    def connection_lost(self, exc):
        lg = self.lg
        if self.busy:
            lg.errors += 1
        lg.conns.discard(self)
        if lg.running:
            lg.reconnects += 1
            lg.open()
        elif not lg.conns:
            lg.all_closed.set()


class _LoadGen:
    """Keep-alive load: ``args.conc`` connections, each sending its next request when the last
    is answered; a warm-up, then ``args.duration`` seconds measured (and the CPU of
    ``args.watch_pid``). bench_credentials' load generator is one of these with TLS tunnels."""

    def __init__(self, args):
        self.args = args
        self.request = args.request.encode().decode("unicode_escape").encode("latin-1")
        self._counters()

    def _counters(self) -> None:
        self.running = True
        self.measuring = False
        self.count = 0
        self.bad_status = 0
        self.errors = 0
        self.reconnects = 0
        self.lat: list[float] = []
        self.conns: set[_LoadConn] = set()
        self.all_closed = asyncio.Event()
        self.connect_failures = 0

    def record(self, status: int, dt: float) -> None:
        if not self.measuring:
            return
        if status == 200:
            self.count += 1
            self.lat.append(dt)
        else:
            self.bad_status += 1

    def open(self) -> None:
        asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        c = _LoadConn(self)
        try:
            if self.args.unix:
                await loop.create_unix_connection(lambda: c, self.args.unix)
            else:
                await loop.create_connection(lambda: c, HOST, self.args.port)
            self.conns.add(c)
        except OSError:
            await self._connect_failed()

    async def _connect_failed(self) -> None:
        self.connect_failures += 1
        self.errors += 1
        if self.running and self.connect_failures < 1000:
            await asyncio.sleep(0.01)
            self.open()

    async def run(self) -> dict:
        for _ in range(self.args.conc):
            self.open()
        start_at = getattr(self.args, "start_at", None)  # (many load generators measuring one window)
        if start_at:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.sleep(self.args.warmup)
        self.measuring = True
        t0 = time.perf_counter()
        c0 = cpu_seconds(self.args.watch_pid)
        await asyncio.sleep(self.args.duration)
        self.measuring = False
        el = time.perf_counter() - t0
        c1 = cpu_seconds(self.args.watch_pid)
        cpu = (c1 - c0) / el if c0 is not None and c1 is not None else None
        self.running = False
        if self.conns:
            self._close_idle()
            try:
                await asyncio.wait_for(self.all_closed.wait(), 5)
            except asyncio.TimeoutError:
                pass
        return self._result(el, cpu)

    def _close_idle(self) -> None:
        """The connections not waiting for an answer are closed (here: each closes itself)."""

    def _result(self, el: float, cpu: float | None) -> dict:
        lat = sorted(self.lat)
        q = (lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000) if lat else (lambda p: None)
        return {"requests": self.count, "seconds": el, "rps": self.count / el, "p50_ms": q(0.5), "p99_ms": q(0.99),
                "bad_status": self.bad_status, "errors": self.errors, "reconnects": self.reconnects,
                "proxy_cpu": cpu}


def role_loadgen(args) -> None:
    print(json.dumps(asyncio.run(_LoadGen(args).run())), flush=True)


# ============================================================================ orchestration


class Child:
    """A child process that prints `READY <info>` on stdout once it serves."""

    def __init__(self, name: str, argv: list[str], *, ready_timeout: float = 20.0, env=None, stderr=None):
        self.name = name
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True,
                                  env=env)
        deadline = time.monotonic() + ready_timeout
        line = ""
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.p.stdout], [], [], 0.2)
            if r:
                line = self.p.stdout.readline()
                if line.startswith("READY") or not line:
                    break
            if self.p.poll() is not None:
                break
        if not line.startswith("READY"):
            self.stop()
            raise RuntimeError(f"{name} did not start (exit {self.p.returncode})")
        self.info = line.split(None, 1)[1].strip()

    def stop(self, timeout: float = 5.0) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def me(role: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--role", role, *extra]


def free_port() -> int:
    s = socket.socket()
    s.bind((HOST, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_listen(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            socket.create_connection((HOST, port), 0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def make_cert(d: Path) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cp, kp = d / "bench.crt", d / "bench.key"
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return str(cp), str(kp)


# ---------------------------------------------------------------------------- squid


def squid_base_conf(d: Path) -> str:
    """What every benchmark Squid is told besides its port: loopback clients only, no cache, no
    access log, its files in ``d``, names from ``d/hosts``."""
    return f"""\
acl benchclients src 127.0.0.1/32
http_access allow benchclients
http_access deny all
cache deny all
cache_mem 0 MB
access_log none
cache_store_log none
cache_log {d}/cache.log
pid_filename {d}/squid.pid
coredump_dir {d}
hosts_file {d}/hosts
dns_nameservers 127.0.0.1
pinger_enable off
netdb_filename none
logfile_rotate 0
shutdown_lifetime 0 seconds
"""


def start_squid(tmp: Path, log, prefix: list[str] | None = None, ready: float = 20) -> tuple[subprocess.Popen, int, str]:
    """Squid on a free loopback port with this benchmark's config (in ``tmp/squid``, which its
    user owns); ``prefix`` runs it under another program (icount_squid.py: valgrind)."""
    squid = shutil.which("squid") or ("/usr/sbin/squid" if os.path.exists("/usr/sbin/squid") else None)
    if squid is None:
        log("squid: not installed, apt-get install -y squid ...")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "squid"], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            r = subprocess.run(["apt-get", "install", "-y", "-qq", "squid"], env=env, capture_output=True, text=True)
        squid = shutil.which("squid") or ("/usr/sbin/squid" if os.path.exists("/usr/sbin/squid") else None)
        if squid is None:
            raise RuntimeError("apt-get install squid failed: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    version = subprocess.run([squid, "-v"], capture_output=True, text=True).stdout.split("\n")[0]
    version = version.replace("Squid Cache: Version ", "")
    d = tmp / "squid"
    d.mkdir()
    port = free_port()
    (d / "hosts").write_text(f"127.0.0.1 localhost\n127.0.0.1 {NAME}\n")
    conf = d / "squid.conf"
    conf.write_text(f"http_port {HOST}:{port}\n" + squid_base_conf(d))
    try:  # squid started as root drops to `proxy`: it must be able to write its own files
        import pwd

        pw = pwd.getpwnam("proxy")
        os.chown(d, pw.pw_uid, pw.pw_gid)
    except (KeyError, OSError):
        os.chmod(d, 0o777)
    p = subprocess.Popen([*(prefix or ()), squid, "-N", "-f", str(conf)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_listen(port, p, ready):
        p.kill()
        p.wait()
        tail = ""
        try:
            tail = (d / "cache.log").read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            pass
        raise RuntimeError(f"squid did not listen ({tail or 'no cache.log'})")
    return p, port, f"squid {version}"


# ---------------------------------------------------------------------------- mitmproxy


def find_py312() -> str | None:
    cands = [shutil.which(f"python3.{m}") for m in (12, 13, 14)]
    cands += sorted(glob.glob("/root/.pyenv/versions/3.1[2-9]*/bin/python3"))
    cands += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")))
    for c in cands:
        if not c:
            continue
        try:
            out = subprocess.run([c, "-c", "import sys; print(sys.version_info >= (3, 12))"], capture_output=True,
                                 text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out == "True":
            return c
    return None


def ensure_mitmdump(log) -> Path:
    """mitmdump, installed once into MITM_VENV with a Python >= 3.12 (what mitmproxy 12 needs)."""
    mitmdump = MITM_VENV / "bin" / "mitmdump"
    if mitmdump.exists():
        return mitmdump
    py = find_py312()
    if py is None:
        raise RuntimeError("no Python >= 3.12 found")
    log(f"mitmproxy: installing into {MITM_VENV} with {py} (one-time) ...")
    r = subprocess.run([py, "-m", "venv", str(MITM_VENV)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("venv failed: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    r = subprocess.run([str(MITM_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "mitmproxy"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not mitmdump.exists():
        err = [ln for ln in r.stderr.strip().splitlines() if "WARNING" not in ln]
        raise RuntimeError("pip install mitmproxy failed: " + (err or ["?"])[-1])
    return mitmdump


def mitmdump_setup(tmp: Path, log) -> tuple[Path, str, Path, int, Path]:
    """mitmdump (:func:`ensure_mitmdump`), its label (versions), a fresh config folder, a free
    port and a hosts file there that sends NAME to loopback (for :func:`launch_mitmdump`)."""
    mitmdump = ensure_mitmdump(log)
    ver = subprocess.run([str(mitmdump), "--version"], capture_output=True, text=True, timeout=60).stdout
    vline = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in ver.splitlines() if ":" in ln}
    label = f"mitmproxy {vline.get('Mitmproxy', '?')} (Python {vline.get('Python', '?')})"
    d = tmp / "mitm"
    d.mkdir()
    port = free_port()
    hosts = d / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {NAME}\n")
    return mitmdump, label, d, port, hosts


def launch_mitmdump(cmd: list[str], d: Path, port: int, hosts: Path, fallback: list[str],
                    ready=None) -> tuple[subprocess.Popen, str]:
    """Start mitmdump (``cmd``) where NAME resolves to loopback (it uses getaddrinfo): as root, a
    private mount namespace whose /etc/hosts is ``hosts`` (the host's file is not touched); else
    ``cmd + fallback`` (an addon that resolves it). Started: its port listens (and ``ready()``).
    -> (process, how NAME was resolved)."""
    unshare = shutil.which("unshare")
    attempts = []
    if unshare and os.geteuid() == 0:
        attempts.append(([unshare, "-m", "--propagation", "private", "sh", "-c",
                          f'mount --bind "{hosts}" /etc/hosts && exec "$@"', "sh", *cmd], "private /etc/hosts"))
    attempts.append((cmd + fallback, "addon resolves bench.test"))
    why = ""
    for argv, how in attempts:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(d / "stderr.log", "w"))
        if wait_listen(port, p, 30) and (ready is None or ready()):
            return p, how
        p.kill()
        p.wait()
        try:
            why = (d / "stderr.log").read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            why = f"exit {p.returncode}"
    raise RuntimeError(f"mitmdump did not start ({why})")


def start_mitmproxy(tmp: Path, log) -> tuple[subprocess.Popen, int, str]:
    mitmdump, label, d, port, hosts = mitmdump_setup(tmp, log)
    cmd = [str(mitmdump), "--listen-host", HOST, "--listen-port", str(port), "-q", "--set", f"confdir={d}"]
    # the fallback: an addon that sends bench.test to 127.0.0.1 (keeps the Host header)
    addon = d / "resolve_bench.py"
    addon.write_text(
        "def request(flow):\n"
        f"    if flow.request.host == {NAME!r}:\n"
        "        h = flow.request.headers.get('host')\n"
        f"        flow.request.host = {HOST!r}\n"
        "        if h:\n"
        "            flow.request.headers['host'] = h\n")
    p, how = launch_mitmdump(cmd, d, port, hosts, ["-s", str(addon)])
    return p, port, f"{label}; {how}"


# ---------------------------------------------------------------------------- measurements


def http_cell(target: dict, conc: int, warmup: float, duration: float) -> dict:
    argv = me("loadgen", "--conc", str(conc), "--warmup", str(warmup), "--duration", str(duration),
              "--request", target["request"])
    argv += ["--unix", target["unix"]] if target.get("unix") else ["--port", str(target["port"])]
    if target.get("pid"):
        argv += ["--watch-pid", str(target["pid"])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=warmup + duration + 60)
    if r.returncode != 0:
        raise RuntimeError("loadgen failed: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(r.stdout.strip().splitlines()[-1])


def median_cell(cells: list[dict]) -> dict:
    """One HTTP cell from its interleaved rounds: the median of each rate, latency and CPU share
    (and of the CPU per request, round by round); counts summed. An error in any round is the
    cell's error."""
    for c in cells:
        if "error" in c:
            return {"error": c["error"]}

    def med(key):
        xs = [c[key] for c in cells if c.get(key) is not None]
        return statistics.median(xs) if xs else None

    per_req = [c["proxy_cpu"] / c["rps"] * 1e6 for c in cells if c.get("proxy_cpu") and c.get("rps")]
    return {"rps": med("rps"), "p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"), "proxy_cpu": med("proxy_cpu"),
            "cpu_us_per_request": statistics.median(per_req) if per_req else None,
            "requests": sum(c["requests"] for c in cells), "seconds": sum(c["seconds"] for c in cells),
            "bad_status": sum(c["bad_status"] for c in cells), "errors": sum(c["errors"] for c in cells),
            "reconnects": sum(c["reconnects"] for c in cells), "rounds_rps": [c["rps"] for c in cells]}


def connect_through(sock: socket.socket, port: int) -> None:
    sock.sendall(f"CONNECT {NAME}:{port} HTTP/1.1\r\nHost: {NAME}:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        d = sock.recv(1)  # byte at a time: nothing after the head may be consumed
        if not d:
            raise ConnectionError("proxy closed the CONNECT")
        head += d
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        raise ConnectionError("CONNECT refused: " + head.split(b"\r\n")[0].decode("latin-1"))


def tunnel_once(kind: str, env: dict, nbytes: int) -> float:
    """MB/s (1e6 bytes) of one TLS session reading `nbytes` from tls-source, handshake included."""
    t0 = time.perf_counter()
    if kind == "direct":
        s = socket.create_connection((HOST, env["tls_port"]))
    elif kind == "gate":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(env["gate_sock"])
        connect_through(s, env["tls_port"])
    else:
        s = socket.create_connection((HOST, env[kind + "_port"]))
        connect_through(s, env["tls_port"])
    if s.family == socket.AF_INET:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ss = env["tls_ctx"].wrap_socket(s, server_hostname=NAME)
    try:
        ss.sendall(b"%d\n" % nbytes)
        buf = bytearray(1 << 18)
        got = 0
        while got < nbytes:
            n = ss.recv_into(buf)
            if not n:
                break
            got += n
        dt = time.perf_counter() - t0
    finally:
        ss.close()
    if got != nbytes:
        raise ConnectionError(f"tunnel stopped after {got} of {nbytes} bytes")
    return nbytes / dt / 1e6


def tunnel_cell(kind: str, env: dict, nbytes: int, repeats: int) -> dict:
    tunnel_once(kind, env, min(nbytes, 20_000_000))  # warm-up
    pid = env.get(kind + "_pid")
    xs, cpus = [], []
    for _ in range(repeats):
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        xs.append(tunnel_once(kind, env, nbytes))
        c1, dt = cpu_seconds(pid), time.perf_counter() - t0
        if c0 is not None and c1 is not None:
            cpus.append((c1 - c0) / dt)
    return {"mb_s": statistics.median(xs), "runs": xs, "mb": nbytes / 1e6,
            "proxy_cpu": statistics.median(cpus) if cpus else None}


def print_profile(path: str, title: str, top: int = 15) -> None:
    import io
    import pstats

    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        st = pstats.Stats(path, stream=out)
        st.sort_stats(key).print_stats(top)
        body = out.getvalue()
        body = body[body.find("   ncalls"):] if "   ncalls" in body else body  # drop pstats' preamble
        print(f"\n--- gate cProfile, top {top} by {key} ({title}) ---")
        print(body.rstrip())


def raise_fd_limit() -> None:
    """The density cell holds thousands of sockets (a listener, a client and an upstream
    connection per sandbox): lift the soft descriptor limit to the hard one, as the daemon does."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 1024
    return float("nan")


def density_cell(pid: int, sock: str, n: int, request: str) -> dict:
    """``n`` sandboxes (endpoints), each with one keep-alive connection that made one request
    (so the gate also holds a pooled upstream connection per sandbox): the gate's RSS."""
    raise_fd_limit()
    idle = rss_mib(pid)
    req = request.encode().decode("unicode_escape").encode()

    async def main():
        conns, ok = [], 0
        for i in range(n):
            r, w = await asyncio.open_unix_connection(f"{sock}.{i}")
            w.write(req)
            conns.append((r, w))
        for r, _ in conns:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
            if b" 200 " in head.split(b"\r\n")[0]:
                ok += 1
                await r.readexactly(len(BODY))
        await asyncio.sleep(0.5)
        rss = rss_mib(pid)
        for _, w in conns:
            w.close()
        return ok, rss

    ok, rss = asyncio.run(main())
    return {"rss_mib": rss, "idle_mib": idle, "ok": ok}


# ============================================================================ main


def role_sequential(args) -> None:
    """``--count`` requests one after another on one keep-alive connection to ``--unix`` (for
    icount_gate.sh: a fixed amount of work, not a duration); every answer must be a 200."""
    req = args.request.encode().decode("unicode_escape").encode("latin-1")
    s = socket.socket(socket.AF_UNIX)
    s.connect(args.unix)
    sequential(s, req, args.count, "the gate")


def sequential(s: socket.socket, req: bytes, count: int, who: str) -> None:
    """``count`` times: send ``req`` on ``s``, read the whole answer (Content-Length framed),
    which must be a 200. Closes ``s`` (icount_squid.py: the same with Squid)."""
    buf = b""
    for _ in range(count):
        s.sendall(req)
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = buf[:end]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, v = line.split(b":", 1)
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                if len(buf) >= end + 4 + length:
                    if not head.startswith(b"HTTP/1.1 200"):
                        raise SystemExit(f"{who}: not a 200: {head[:200]!r}")
                    buf = buf[end + 4 + length:]
                    break
            data = s.recv(65536)
            if not data:
                raise SystemExit(f"{who} closed the connection")
            buf += data
    s.close()


# ---------------------------------------------------------------------------- the real path

REAL_LOADGEN = """import argparse, sys
sys.path.insert(0, {here!r})
import bench_gate as bg
bg.role_loadgen(argparse.Namespace(request={request!r}, conc={conc}, warmup={warmup}, duration={duration},
                                   unix=None, port={port}, watch_pid=None,
                                   start_at=float(sys.argv[1]) if len(sys.argv) > 1 else None))
"""


def real_path(args) -> int:
    """c=10 keep-alive GETs from a load generator *inside a sandbox* (``agentvm run -f``, embedded
    gate, no daemon: the sandbox's bridge on 127.0.0.1:3128 -> its gate socket -> the gate ->
    the upstream) against Squid on the same upstream with the same load generator (the same
    Debian python3, on the host: Squid has no bridge to cross). Interleaved rounds, their order
    alternated; each round's ratio is printed and the count of rounds at >= 1.0x (the target:
    every round). The sandbox row's rate is the load generator's own count over its measured
    window (its warm-up and the sandbox's start are outside it)."""
    rounds = args.rounds or 5
    duration = args.duration or 3.0
    warmup = 0.5
    sandboxes = max(1, args.sandboxes or 1)
    conc = args.conc or (10 if sandboxes == 1 else 2)
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    entry = Path(sys.executable).parent / "agentvm"
    cli = [str(entry)] if entry.exists() else [sys.executable, "-m", "agentvm"]
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-bench-real-", dir="/tmp"))
    home = tmp / "home"
    home.mkdir()
    os.chmod(tmp, 0o755)
    os.chmod(home, 0o711)
    procs: list[subprocess.Popen] = []
    try:
        upp = subprocess.Popen(me("upstream"), stdout=subprocess.PIPE, text=True)
        procs.append(upp)
        port = int(upp.stdout.readline().split()[1])
        sq, sq_port, label = start_squid(tmp, lambda m: print(m, file=sys.stderr))
        procs.append(sq)
        request = f"GET http://{NAME}:{port}/ HTTP/1.1\\r\\nHost: {NAME}:{port}\\r\\n\\r\\n"
        box = tmp / "box"  # what the sandbox sees at /bench: this script and its load generator
        box.mkdir()
        shutil.copy(__file__, box / "bench_gate.py")
        (box / "lg.py").write_text(REAL_LOADGEN.format(here="/bench", request=request, conc=conc, warmup=warmup,
                                                       duration=duration, port=3128))
        (tmp / "lg_host.py").write_text(REAL_LOADGEN.format(here=str(box), request=request, conc=conc,
                                                            warmup=warmup, duration=duration, port=sq_port))
        for f in box.iterdir():
            os.chmod(f, 0o644)
        os.chmod(box, 0o755)
        agent = tmp / "agent.yaml"
        agent.write_text(f"""apiVersion: agentvm/v1
kind: Agent
metadata: {{name: bench-real}}
spec:
  command: [{py}, /bench/lg.py]
  workspace: {{enabled: false}}
  mounts: [{{host: {box}, path: /bench, mode: ro}}]
  egress:
    hosts: {{{NAME}: 127.0.0.1}}
    allow: [{{host: {NAME}, ports: [{port}]}}]
    limits: {{requestsPerSecond: 1000000000, burst: 1000000000, bytesOut: 1T}}
""")
        env = dict(os.environ, AGENTVM_NO_DAEMON="1", AGENTVM_HOME=str(home))
        if sandboxes > 1:
            return _real_path_spread(args, cli, env, tmp, agent, py, label, rounds, sandboxes, conc, warmup, duration)

        def one(kind: str) -> dict:
            argv = cli + ["run", "-f", str(agent)] if kind == "gate" else [py, str(tmp / "lg_host.py")]
            r = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                               timeout=warmup + duration + 120)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode != 0 or not lines:
                raise RuntimeError(f"{kind} round failed ({r.returncode}): {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            out = json.loads(lines[-1])
            if out["bad_status"] or out["errors"]:
                raise RuntimeError(f"{kind} round: {out['bad_status']} non-200 answers, {out['errors']} errors")
            return out

        one("gate")  # warm: the /etc view, the uid range, the preset and the compiled gate loaded once
        one("squid")
        res, ratios, met = _interleaved(rounds, one, lambda g: f"gate (in a sandbox) {g['gate']['rps']:8.0f} req/s p50 "
                                        f"{g['gate']['p50_ms']:.2f} ms   squid {g['squid']['rps']:8.0f} req/s p50 "
                                        f"{g['squid']['p50_ms']:.2f} ms")
        summary = {"label": label, "conc": conc, "duration_s": duration, "rounds": res, "ratios": ratios,
                   "median_ratio": statistics.median(ratios), "rounds_at_parity": met}
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print(f"real path, HTTP c={conc}: gate/squid median {statistics.median(ratios):.2f}x "
                  f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x); {met} of {rounds} rounds >= 1.0x "
                  f"(target: {rounds} of {rounds}); {label}; load average {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} CPUs")
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _interleaved(rounds: int, measure, describe) -> tuple[list, list, int]:
    """``rounds`` rounds of ``measure("gate")`` and ``measure("squid")``, their order alternated,
    each printed (``describe(round)`` and the ratio) -> (rounds, ratios, rounds at >= 1.0x)."""
    res = []
    for i in range(rounds):
        order = ("gate", "squid") if i % 2 == 0 else ("squid", "gate")
        got = {k: measure(k) for k in order}
        res.append(got)
        print(f"round {i + 1}: {describe(got)}   {got['gate']['rps'] / got['squid']['rps']:.2f}x   "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    ratios = [r["gate"]["rps"] / r["squid"]["rps"] for r in res]
    return res, ratios, sum(x >= 1.0 for x in ratios)


def _real_path_spread(args, cli, env, tmp, agent, py, label, rounds, sandboxes, conc, warmup, duration) -> int:
    """The real path spread over ``sandboxes`` sandboxes of one agent, each with ``conc``
    connections, served by a daemon with the gate's default layout (its confined worker for the
    agent), against Squid with as many load generators on the host. Every load generator of a
    round measures the same window (a start time given to all); a row's rate is their sum."""
    denv = {k: v for k, v in env.items() if k != "AGENTVM_NO_DAEMON"}
    layout = args.gate_workers or "agent"
    up = subprocess.run(cli + ["up", "--gate-workers", layout], env=denv, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        raise RuntimeError("agentvm up failed: " + (up.stderr.strip().splitlines() or ["?"])[-1])
    lead = 3.0 + 0.08 * sandboxes  # time to start every sandbox (or host load generator) before the window
    # one agent per sandbox: a named agent runs one sandbox at a time (they would share its uid),
    # and the default layout gives each agent a confined gate worker of its own
    text = agent.read_text()
    agents = []
    for i in range(sandboxes):
        a = tmp / f"agent-{i}.yaml"
        a.write_text(text.replace("metadata: {name: bench-real}", f"metadata: {{name: bench-real-{i}}}"))
        agents.append(a)

    def spread(kind: str) -> dict:
        start_at = time.time() + lead
        argvs = [cli + ["run", "-f", str(a), "--", py, "/bench/lg.py", repr(start_at)] if kind == "gate"
                 else [py, str(tmp / "lg_host.py"), repr(start_at)] for a in agents]
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=denv,
                                  stdin=subprocess.DEVNULL) for argv in argvs]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=lead + warmup + duration + 120)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"{kind}: a load generator failed ({p.returncode}): {(err.strip().splitlines() or ['?'])[-1]}")
            outs.append(json.loads(lines[-1]))
        late = [o for o in outs if o["seconds"] > duration * 1.5]
        bad = sum(o["bad_status"] + o["errors"] for o in outs)
        if bad:
            raise RuntimeError(f"{kind}: {bad} non-200 answers or errors")
        return {"rps": sum(o["rps"] for o in outs), "p50_ms": statistics.median(o["p50_ms"] or 0 for o in outs),
                "late": len(late)}

    try:
        spread("gate")  # warm
        res, ratios, met = _interleaved(rounds, spread, lambda g: f"gate ({sandboxes} sandboxes x c={conc}) "
                                        f"{g['gate']['rps']:8.0f} req/s   squid {g['squid']['rps']:8.0f} req/s")
        if args.json:
            print(json.dumps({"label": label, "sandboxes": sandboxes, "conc": conc, "gate_workers": layout, "rounds": res,
                              "ratios": ratios,
                              "median_ratio": statistics.median(ratios), "rounds_at_parity": met}, indent=2))
        else:
            what = "default gate layout: a confined worker per agent" if layout == "agent" else f"--gate-workers {layout}"
            print(f"real path, {sandboxes} sandboxes x c={conc} through the daemon ({what}): gate/squid "
                  f"median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x); {met} of "
                  f"{rounds} rounds >= 1.0x (target: >= 1.0x); {label}; load average {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} CPUs")
        return 0
    finally:
        subprocess.run(cli + ["down"], env=denv, capture_output=True, timeout=120)


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _python import agentvm_python

    agentvm_python()  # python3 without agentvm: again on its venv's python
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~20 s run: shorter cells, smaller tunnel")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("--profile", action="store_true",
                    help="afterwards, run the gate under cProfile for one c=10 HTTP cell and print the top functions")
    ap.add_argument("--duration", type=float, help="seconds per HTTP cell (default 5, --quick 1.5), split over the rounds")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of the HTTP cells (default 5, --quick 2)")
    ap.add_argument("--tunnel-mb", type=int, help="MB per tunnel transfer (default 200, --quick 50)")
    ap.add_argument("--no-squid", action="store_true")
    ap.add_argument("--no-mitmproxy", action="store_true")
    ap.add_argument("--real-path", action="store_true",
                    help="the real path only: the load generator inside a sandbox (agentvm run, embedded gate, "
                    "the sandbox's bridge) against Squid with the same load generator on the host, interleaved")
    # child roles (internal)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--cert", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--sock", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--conc", type=int, help="--real-path: connections per load generator (default 10; 2 with --sandboxes)")
    ap.add_argument("--gate-workers", help="--sandboxes: the daemon's gate layout (agentvm up --gate-workers; "
                    "default: agent, a confined worker per agent; N: N shared workers, to measure what the "
                    "per-agent processes cost)")
    ap.add_argument("--sandboxes", type=int, help="--real-path: spread the load over this many sandboxes of one agent, "
                    "through a daemon (its default gate layout), against as many load generators at Squid")
    ap.add_argument("--warmup", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--request", help=argparse.SUPPRESS)
    ap.add_argument("--unix", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--watch-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    roles = {"upstream": role_upstream, "tls-source": role_tls_source, "gate": role_gate, "loadgen": role_loadgen,
             "sequential": role_sequential}
    if args.role:
        roles[args.role](args)
        return 0
    if args.real_path:
        return real_path(args)

    duration = args.duration or (1.5 if args.quick else 5.0)
    warmup = 0.5 if args.quick else 1.0
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    if rounds < 1:
        ap.error("--rounds must be 1 or more")
    round_warmup = 0.3 if args.quick else 0.5
    tunnel_bytes = (args.tunnel_mb or (50 if args.quick else 200)) * 1_000_000
    repeats = 1 if args.quick else 3
    quiet = args.json

    def log(msg: str) -> None:
        print(f"[bench_gate] {msg}", file=sys.stderr if quiet else sys.stdout, flush=True)

    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="agentvm-bench-gate-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    children: list[Child] = []
    procs: list[subprocess.Popen] = []
    res: dict = {"python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
                 "http": {}, "tunnel": {}, "unavailable": {}, "labels": {},
                 "gate_hot_path": gate_hot_path()}
    try:
        up = Child("upstream", me("upstream"))
        children.append(up)
        http_port = int(up.info)
        cert, key = make_cert(tmp)
        src = Child("tls-source", me("tls-source", "--cert", cert, "--key", key))
        children.append(src)
        tls_port = int(src.info)
        tls_ctx = ssl.create_default_context(cafile=cert)
        env = {"tls_port": tls_port, "tls_ctx": tls_ctx}

        def gate_child(profile_out: str | None = None) -> Child:
            sock = str(tmp / ("gate-prof.sock" if profile_out else "gate.sock"))
            extra = ["--profile-out", profile_out] if profile_out else []
            return Child("gate", me("gate", "--ports", f"{http_port},{tls_port}", "--sock", sock,
                                    "--state", str(tmp / "gate"), *extra),
                         # cProfile cannot see into compiled functions: the profiled gate runs the .py
                         env=dict(os.environ, AGENTVM_GATE_PURE="1") if profile_out else None)

        gate = gate_child()
        children.append(gate)
        env["gate_sock"] = gate.info

        absolute = f"GET http://{NAME}:{http_port}/ HTTP/1.1\\r\\nHost: {NAME}:{http_port}\\r\\n\\r\\n"
        targets: dict[str, dict] = {
            "direct": {"port": http_port, "request": f"GET / HTTP/1.1\\r\\nHost: {NAME}:{http_port}\\r\\n\\r\\n"},
            "gate": {"unix": gate.info, "request": absolute, "pid": gate.p.pid},
        }
        env["gate_pid"] = gate.p.pid
        res["labels"]["direct"] = "direct (asyncio upstream)"
        res["labels"]["gate"] = "agent-vm gate (unix socket)"
        if not args.no_squid:
            try:
                p, port, label = start_squid(tmp, log)
                procs.append(p)
                targets["squid"] = {"port": port, "request": absolute, "pid": p.pid}
                env["squid_port"], env["squid_pid"] = port, p.pid
                res["labels"]["squid"] = label
            except Exception as exc:  # noqa: BLE001 - reported in the table
                res["unavailable"]["squid"] = str(exc)
        else:
            res["unavailable"]["squid"] = "skipped (--no-squid)"
        if not args.no_mitmproxy:
            try:
                p, port, label = start_mitmproxy(tmp, log)
                procs.append(p)
                targets["mitmproxy"] = {"port": port, "request": absolute, "pid": p.pid}
                res["labels"]["mitmproxy"] = label
            except Exception as exc:  # noqa: BLE001
                res["unavailable"]["mitmproxy"] = str(exc)
        else:
            res["unavailable"]["mitmproxy"] = "skipped (--no-mitmproxy)"

        # Interleaved: each round visits every path in turn, so all of them share the same
        # minutes of a machine whose speed drifts (30% over minutes on a shared VM); a cell is
        # the median of its rounds. Sequential cells let the drift decide gate against squid.
        runs: dict[tuple[str, int], list] = {}
        for rnd in range(rounds):
            log(f"http round {rnd + 1}/{rounds}: {', '.join(targets)} at c=1 and c=10 "
                f"({round_warmup:g} s warm-up + {duration / rounds:g} s each)")
            names = list(targets)
            names = names[rnd % len(names):] + names[:rnd % len(names)]  # the order rotated: less place bias
            for name in names:
                tgt = targets[name]
                for conc in (1, 10):
                    try:
                        runs.setdefault((name, conc), []).append(http_cell(tgt, conc, round_warmup, duration / rounds))
                    except Exception as exc:  # noqa: BLE001
                        runs.setdefault((name, conc), []).append({"error": str(exc)})
        for (name, conc), cells in runs.items():
            res["http"].setdefault(name, {})[f"c{conc}"] = median_cell(cells)
        res["http_rounds"] = rounds
        res["http_round_warmup"] = round_warmup

        for kind in ("direct", "gate", "squid"):
            if kind == "squid" and "squid_port" not in env:
                continue
            log(f"tunnel {kind} ({tunnel_bytes / 1e6:g} MB x {repeats})")
            try:
                res["tunnel"][kind] = tunnel_cell(kind, env, tunnel_bytes, repeats)
            except Exception as exc:  # noqa: BLE001
                res["tunnel"][kind] = {"error": f"{type(exc).__name__}: {exc}"}

        log(f"density: {DENSITY} sandboxes, one keep-alive connection each")
        try:
            dense = Child("gate", me("gate", "--ports", f"{http_port},{tls_port}", "--sock", str(tmp / "dense.sock"),
                                     "--state", str(tmp / "gate-dense"), "--endpoints", str(DENSITY)), ready_timeout=120)
            children.append(dense)
            res["density"] = density_cell(dense.p.pid, str(tmp / "dense.sock"), DENSITY,
                                          f"GET http://{NAME}:{http_port}/ HTTP/1.1\r\nHost: {NAME}:{http_port}\r\n\r\n")
            dense.stop()
        except Exception as exc:  # noqa: BLE001
            res["density"] = {"error": f"{type(exc).__name__}: {exc}"}

        res["bench_seconds"] = time.monotonic() - t_start

        profiles = {}
        if args.profile:
            # a fresh gate under cProfile per workload; the .prof files are kept for pstats/snakeviz
            pdur = max(duration, 5.0)
            for what in ("http", "tunnel"):
                path = f"/tmp/agentvm-bench-gate-{what}.prof"
                pg = gate_child(path)
                children.append(pg)
                if what == "http":
                    log(f"profiling the gate: HTTP c=10 for {pdur:g} s")
                    cell = http_cell(dict(targets["gate"], unix=pg.info, pid=None), 10, 0.0, pdur)
                    note = f"HTTP c=10 under cProfile: {cell['rps']:.0f} req/s, p50 {cell['p50_ms']:.2f} ms"
                else:
                    log(f"profiling the gate: one {tunnel_bytes / 1e6:g} MB tunnel")
                    mb = tunnel_once("gate", dict(env, gate_sock=pg.info), tunnel_bytes)
                    note = f"one {tunnel_bytes / 1e6:g} MB TLS tunnel under cProfile: {mb:.0f} MB/s"
                pg.stop(timeout=30)
                profiles[what] = (path, note)
    finally:
        for c in children:
            c.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        report(res, duration, warmup, tunnel_bytes, repeats)
        for what, (path, note) in profiles.items():
            if os.path.exists(path):
                print_profile(path, f"{note}; saved as {path}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(res: dict, duration: float, warmup: float, tunnel_bytes: int, repeats: int) -> None:
    print()
    print(f"agent-vm egress gate benchmark - loopback only, {os.cpu_count()} cores")
    print(f"python: {res['python']}")
    print(f"gate hot path: {res['gate_hot_path']}")
    print("gate: one process, one thread (asyncio event loop) -> it uses at most one core")
    print("cpu = the proxy process's CPU time / wall time during the cell (100% = one core busy)")
    print()
    rounds = res.get("http_rounds", 1)
    print(f"HTTP GET, 13-byte body, keep-alive client; {rounds} interleaved rounds of "
          f"{res.get('http_round_warmup', warmup):g} s warm-up + {duration / rounds:g} s per cell (paths taking "
          f"turns, their order rotated each round), the median of the rounds (p99: the median of the rounds' p99)")
    print(f"{'path':38} {'c=1 req/s':>10} {'p50 ms':>7} {'cpu':>5} {'c=10 req/s':>11} {'p50 ms':>7} {'cpu':>5}  notes")
    order = ["direct", "gate", "squid", "mitmproxy"]
    for name in order:
        label = res["labels"].get(name, name).split(";")[0]
        if name in res["unavailable"]:
            print(f"{name}: not available ({res['unavailable'][name]})")
            continue
        cells = res["http"].get(name)
        if not cells:
            continue
        parts, notes = [], []
        for c in ("c1", "c10"):
            cell = cells.get(c, {})
            if "error" in cell:
                parts.append(f"{'error':>10} {'':>7} {'':>5}")
                notes.append(f"{c}: {cell['error']}")
                continue
            cpu = f"{cell['proxy_cpu'] * 100:4.0f}%" if cell.get("proxy_cpu") is not None else "    -"
            parts.append(f"{cell['rps']:10.0f} {cell['p50_ms'] or 0:7.2f} {cpu}")
            bad = cell["bad_status"] + cell["errors"]
            if bad:
                notes.append(f"{c}: {cell['bad_status']} non-200, {cell['errors']} errors")
        print(f"{label[:38]:38} {parts[0]} {' ' + parts[1]}  {'; '.join(notes)}")
    print()
    print(f"CONNECT tunnel, TLS 1.3 (Python ssl both ends), {tunnel_bytes / 1e6:g} MB server->client; "
          f"MB/s, median of {repeats}")
    for kind in ("direct", "gate", "squid"):
        t = res["tunnel"].get(kind)
        if t is None:
            if kind == "squid" and "squid" in res["unavailable"]:
                print(f"{'squid':38} not available")
            continue
        label = {"direct": "direct (TLS to tls-source)", "gate": "agent-vm gate (SNI checked, spliced)",
                 "squid": res["labels"].get("squid", "squid").split(";")[0]}[kind]
        if "error" in t:
            print(f"{label[:38]:38} error: {t['error']}")
        else:
            runs = ", ".join(f"{x:.0f}" for x in t["runs"])
            cpu = f"proxy cpu {t['proxy_cpu'] * 100:3.0f}%" if t.get("proxy_cpu") is not None else ""
            print(f"{label[:38]:38} {t['mb_s']:8.0f} MB/s  {cpu:14} (runs: {runs})")
    print()
    print("ratios")

    def rps(name, c="c10"):
        cell = res["http"].get(name, {}).get(c, {})
        return cell.get("rps")

    def line(label, a, b, target=None, why=""):
        if a is None or b is None or not b:
            print(f"  {label:38} n/a {why}")
            return
        r = a / b
        t = f"  (target >= {target:.1f}x: {'met' if r >= target else 'MISSED'})" if target else "  (no target)"
        print(f"  {label:38} {r:6.2f}x{t}")

    line("gate / squid, HTTP c=10", rps("gate"), rps("squid"), TARGETS["gate_vs_squid_c10"],
         "(squid: not available)" if "squid" in res["unavailable"] else "")
    line("gate / squid, HTTP c=1", rps("gate", "c1"), rps("squid", "c1"))
    tg, td = res["tunnel"].get("gate", {}), res["tunnel"].get("direct", {})
    line("tunnel gate / direct", tg.get("mb_s"), td.get("mb_s"), TARGETS["tunnel_gate_vs_direct"])
    line("tunnel gate / squid", tg.get("mb_s"), res["tunnel"].get("squid", {}).get("mb_s"))
    if "mitmproxy" in res["unavailable"]:
        print(f"  {'gate / mitmproxy, HTTP c=10':38} n/a (mitmproxy: not available)")
    else:
        line("gate / mitmproxy, HTTP c=10", rps("gate"), rps("mitmproxy"))
        line("gate / mitmproxy, HTTP c=1", rps("gate", "c1"), rps("mitmproxy", "c1"))
    line("gate / direct, HTTP c=10", rps("gate"), rps("direct"))

    def cpu_us(name, c="c10"):
        cell = res["http"].get(name, {}).get(c, {})
        if cell.get("cpu_us_per_request") is not None:
            return cell["cpu_us_per_request"]
        return cell["proxy_cpu"] / cell["rps"] * 1e6 if cell.get("proxy_cpu") and cell.get("rps") else None

    g_cpu, s_cpu = cpu_us("gate"), cpu_us("squid")
    if g_cpu is not None:
        verdict = (f"(target <= squid's {s_cpu:.0f} us: {'met' if g_cpu <= s_cpu else 'MISSED'})" if s_cpu
                   else "(squid: n/a)")
        print(f"  {'gate CPU per request, HTTP c=10':38} {g_cpu:6.0f} us  {verdict}")
    gp99 = res["http"].get("gate", {}).get("c10", {}).get("p99_ms")
    dp99 = res["http"].get("direct", {}).get("c10", {}).get("p99_ms")
    if gp99 is not None and dp99 is not None:
        added = gp99 - dp99
        print(f"  {'added p99 latency, HTTP c=10':38} {added:6.2f} ms  (gate {gp99:.2f} - direct {dp99:.2f}; "
              f"target <= {TARGETS['added_p99_ms']:.1f} ms: {'met' if added <= TARGETS['added_p99_ms'] else 'MISSED'})")
    dn = res.get("density") or {}
    if "error" in dn:
        print(f"  {'gate RSS, ' + str(DENSITY) + ' sandboxes':38} error: {dn['error']}")
    elif dn:
        ok = dn["rss_mib"] <= TARGETS["rss_500_mib"]
        print(f"  {'gate RSS, ' + str(DENSITY) + ' sandboxes':38} {dn['rss_mib']:6.0f} MiB  ({dn['ok']}/{DENSITY} "
              f"connections answered and held; {dn['idle_mib']:.0f} MiB with the endpoints only; "
              f"target <= {TARGETS['rss_500_mib']:.0f} MiB: {'met' if ok else 'MISSED'})")
    print()
    for name in ("squid", "mitmproxy"):
        if name in res["labels"]:
            print(f"{name}: {res['labels'][name]}")
    print(f"(measured in {res['bench_seconds']:.0f} s; the gate's rate/connection/bytes limits were raised for the run; "
          "2 cores are shared by load generator, proxy and upstream)")


if __name__ == "__main__":
    sys.exit(main())
