"""Local upstreams for the gate's end-to-end tests: a test CA, and threaded HTTP and HTTPS
servers on 127.0.0.1 that record every request they receive (so a test can assert that a
denied request never arrived). Names used by the tests are mapped to 127.0.0.1 through the
gate's operator-declared static hosts; no other address is ever used."""

from __future__ import annotations

import datetime
import http.server
import io
import json
import os
import hashlib
import socket
import ssl
import subprocess
import tarfile
import threading
import zipfile
from pathlib import Path

NAMES = ["allowed.test", "api.test", "other.test", "pkgs.test", "git.test", "denied.test", "dns.google", "echo.test", "evil.test",
         "s3.test", "h2.test", "grpc.test", "llm.test"]


def make_test_ca(directory: Path) -> tuple[Path, Path, Path]:
    """A CA plus one server certificate for every test name. Returns (ca.pem, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentvm test upstream CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentvm test upstream")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_pem = directory / "test-ca.pem"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem = directory / "server.pem"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = directory / "server.key"
    key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    for p in (ca_pem, cert_pem):
        os.chmod(p, 0o644)
    return ca_pem, cert_pem, key_pem


def sandbox_test_ca(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``make_test_ca`` under ``tmp_path/ca``, readable by the gate and the agent's uid (an
    agent file's ``upstreamCa`` is read from the host by the gate)."""
    d = tmp_path / "ca"
    ca, cert, key = make_test_ca(d)
    for x in (tmp_path, d):
        os.chmod(x, 0o755)
    os.chmod(ca, 0o644)
    return ca, cert, key


def make_wheel() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("agentvm_demo/__init__.py", "VALUE = 42\n")
        z.writestr("agentvm_demo-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: agentvm-demo\nVersion: 0.1\n")
        z.writestr("agentvm_demo-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("agentvm_demo-0.1.dist-info/RECORD", "")
    return buf.getvalue()


def make_npm_tarball() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        data = b'{"name": "agentvm-demo", "version": "0.1.0", "main": "index.js"}\n'
        info = tarfile.TarInfo("package/package.json")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_git_repo(directory: Path) -> Path:
    """A small bare repository served over git's dumb HTTP protocol (static files)."""
    bare = directory / "repo.git"
    work = directory / "repo-work"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_NOSYSTEM": "1",
           "HOME": str(directory)}

    def git(*args, cwd=None):
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)

    git("init", "-q", "--bare", "-b", "main", str(bare))
    git("init", "-q", "-b", "main", str(work))
    (work / "README.md").write_text("hello from the gate test repo\n")
    git("add", "README.md", cwd=work)
    git("commit", "-q", "-m", "initial", cwd=work)
    git("push", "-q", str(bare), "main", cwd=work)
    git("update-server-info", cwd=bare)
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return bare


class Upstream:
    """A threaded HTTP(S) server; ``seen`` lists (method, host header, path, body length)."""

    def __init__(self, tls: tuple[Path, Path] | None = None, git_root: Path | None = None):
        self.seen: list[tuple[str, str, str, int]] = []
        self.lock = threading.Lock()
        self.wheel = make_wheel()
        self.npm_tarball = make_npm_tarball()
        self.git_root = git_root
        self.tls = tls is not None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self) -> bytes:
                if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
                    data = b""
                    while True:
                        line = self.rfile.readline(1024)
                        if not line:
                            return data
                        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline(1024)
                n = int(self.headers.get("Content-Length") or 0)
                data = b""
                while len(data) < n:
                    chunk = self.rfile.read(min(65536, n - len(data)))
                    if not chunk:
                        break
                    data += chunk
                return data

            def _reply(self, code: int, body: bytes, ctype: str = "application/json", extra=()):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self):
                body = self._body()
                with outer.lock:
                    outer.seen.append((self.command, self.headers.get("Host", ""), self.path, len(body)))
                path = self.path.split("?", 1)[0]
                if path.startswith("/redirect"):
                    to = self.path.split("to=", 1)[1] if "to=" in self.path else "/"
                    return self._reply(302, b"", extra=[("Location", to)])
                if path == "/simple/agentvm-demo/":
                    page = b'<html><body><a href="/files/agentvm_demo-0.1-py3-none-any.whl">agentvm_demo-0.1-py3-none-any.whl</a></body></html>'
                    return self._reply(200, page, "text/html")
                if path == "/files/agentvm_demo-0.1-py3-none-any.whl":
                    return self._reply(200, outer.wheel, "application/octet-stream")
                if path == "/npm/agentvm-demo":
                    scheme = "https" if outer.tls else "http"
                    doc = {"name": "agentvm-demo", "dist-tags": {"latest": "0.1.0"},
                           "versions": {"0.1.0": {"name": "agentvm-demo", "version": "0.1.0",
                                                  "dist": {"tarball": f"{scheme}://{self.headers.get('Host')}/npm/agentvm-demo-0.1.0.tgz",
                                                           "shasum": hashlib.sha1(outer.npm_tarball).hexdigest()}}}}
                    return self._reply(200, json.dumps(doc).encode())
                if path == "/npm/agentvm-demo-0.1.0.tgz":
                    return self._reply(200, outer.npm_tarball, "application/octet-stream")
                if outer.git_root is not None and path.startswith("/repo.git/"):
                    f = outer.git_root / path[len("/repo.git/") :]
                    if f.is_file():
                        return self._reply(200, f.read_bytes(), "application/octet-stream")
                    return self._reply(404, b"{}")
                echo = {"method": self.command, "path": self.path, "host": self.headers.get("Host"), "body_len": len(body),
                        "headers": {k.lower(): v for k, v in self.headers.items()}}
                return self._reply(200, json.dumps(echo).encode())

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _handle

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            # handshake lazily in the handler thread: a client that never completes its
            # handshake must not block the accept loop for every other test
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def clear(self) -> None:
        with self.lock:
            self.seen.clear()

    def paths_seen(self) -> list[str]:
        with self.lock:
            return [s[2] for s in self.seen]

    def requests_to(self, host: str) -> list:
        with self.lock:
            return [s for s in self.seen if s[1].split(":")[0] == host]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Listener:
    """A raw TCP/UDP listener on a host loopback address that records whether anything arrived."""

    def __init__(self, family=socket.AF_INET, kind=socket.SOCK_STREAM, addr="127.0.0.1"):
        self.sock = socket.socket(family, kind)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, 0))
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        if kind == socket.SOCK_STREAM:
            self.sock.listen(8)
        self.sock.settimeout(0.2)
        self._stop = False
        self.kind = kind
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop:
            try:
                if self.kind == socket.SOCK_STREAM:
                    c, _ = self.sock.accept()
                    c.close()
                else:
                    self.sock.recvfrom(4096)
                self.hits += 1
            except (socket.timeout, OSError):
                continue

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def serve_https(handler, cert: Path, key: Path):
    """A threaded HTTPS server on 127.0.0.1 (an ephemeral port) for ``handler``, serving in a
    daemon thread; ``.shutdown()`` it when done."""
    import http.server
    import ssl
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


class H2Upstream:
    """An HTTP/2 (ALPN h2 only) TLS server on 127.0.0.1, made with the ``h2`` library, in its own
    thread and event loop. Every request is answered with JSON describing what arrived
    (method, path, authority, headers, body); ``/trailers...`` also sends trailers
    (``x-trailer: done``); ``/big?n=N`` answers N bytes. ``seen`` records every request."""

    def __init__(self, cert: Path, key: Path):
        import asyncio

        self.seen: list[dict] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        ctx.set_alpn_protocols(["h2"])
        started = threading.Event()

        async def main():
            self.stop = asyncio.Event()
            self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=ctx)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()
            await self.stop.wait()
            self.server.close()

        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(main()), daemon=True)
        self.thread.start()
        started.wait(10)

    async def _conn(self, reader, writer):
        import h2.config
        import h2.connection
        import h2.events

        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        reqs: dict[int, dict] = {}
        self._pending = {}
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        h = [(bytes(k).decode(), bytes(v).decode()) for k, v in ev.headers]
                        reqs[ev.stream_id] = {"headers": h, "body": b""}
                    elif isinstance(ev, h2.events.DataReceived):
                        reqs[ev.stream_id]["body"] += ev.data
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    if isinstance(ev, (h2.events.RequestReceived, h2.events.DataReceived)) and ev.stream_ended:
                        self._answer(conn, ev.stream_id, reqs.pop(ev.stream_id))
                    elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id in reqs:
                        self._answer(conn, ev.stream_id, reqs.pop(ev.stream_id))
                    elif isinstance(ev, h2.events.WindowUpdated):
                        for sid in list(self._pending):
                            self._pump(conn, sid)
                    elif isinstance(ev, h2.events.StreamReset):
                        self._pending.pop(ev.stream_id, None)
                        reqs.pop(ev.stream_id, None)
                writer.write(conn.data_to_send())
                await writer.drain()
        except Exception as exc:  # a broken test client: recorded for the test to see
            self.errors.append(repr(exc))
            return
        finally:
            writer.close()

    def _answer(self, conn, sid: int, req: dict) -> None:
        pseudo = {k: v for k, v in req["headers"] if k.startswith(":")}
        rec = {"method": pseudo.get(":method"), "path": pseudo.get(":path"), "authority": pseudo.get(":authority"),
               "headers": {k: v for k, v in req["headers"] if not k.startswith(":")},
               "body": req["body"].decode("latin-1")}
        with self.lock:
            self.seen.append(rec)
        if rec["path"].startswith("/big"):
            body = b"x" * int(rec["path"].split("n=")[1])
        else:
            body = json.dumps(rec).encode()
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())])
        self._pending[sid] = [memoryview(body), rec["path"].startswith("/trailers")]
        self._pump(conn, sid)

    def _pump(self, conn, sid: int) -> None:
        """Send what the flow-control window allows; the end (or trailers) once all is sent."""
        import h2.exceptions

        view, trailers = self._pending[sid]
        try:
            while view:
                n = min(len(view), conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if n <= 0:
                    self._pending[sid][0] = view
                    return
                conn.send_data(sid, bytes(view[:n]))
                view = view[n:]
        except h2.exceptions.StreamClosedError:  # the client (the gate) reset it meanwhile
            del self._pending[sid]
            return
        del self._pending[sid]
        if trailers:
            conn.send_headers(sid, [(b"x-trailer", b"done")], end_stream=True)
        else:
            conn.end_stream(sid)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)
