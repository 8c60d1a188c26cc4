"""The gate as a shared egress gateway, attacked with real TLS clients on loopback.

A real gateway (agentvm.gateway.server: the gate's exchange core behind an mTLS listener) in
a thread; a real HTTPS upstream on 127.0.0.1 (names mapped by egress.hosts) that echoes what
arrived; clients are Python's ssl and curl with --proxy-cert. Two agents, several sandboxes
each, at once: each sandbox must get only its own policy and its own credentials; a client
without a certificate, with one from another CA, an expired one, a revoked one, or a forged
one naming another sandbox is refused; a revocation and a policy change in the configuration
source take effect on the next request of an open connection."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentvm.gate.server import new_event_loop
from agentvm.gateway import server as gs
from agentvm.gateway.audit import verify
from agentvm.gateway.ca import GatewayCA
from agentvm.gateway.config import edit_revocations
from agentvm.gateway.identity import Identity
from tests.integration.gate_upstreams import make_test_ca, serve_https

SECRET_A = "sk-test-real-value-of-agent-a-0000001"  # obviously fake test values
SECRET_B = "sk-test-real-value-of-agent-b-0000002"
PH_A = "sk-agentvm-placeholder-a-xxxxxxxxxxxxxxxx"
PH_B = "sk-agentvm-placeholder-b-yyyyyyyyyyyyyyyy"


def _agent(name: str, host: str, port: int, ca: Path, cred: str, extra: str = "") -> str:
    return f"""apiVersion: agentvm/v1
kind: Agent
metadata: {{name: {name}}}
spec:
  command: ["true"]
  riskTier: L3
  egress:
    hosts: {{api.test: 127.0.0.1, other.test: 127.0.0.1}}
    upstreamCa: {ca}
    allow:
      - {{host: {host}, ports: [{port}]}}
{extra}  credentials:
    - name: {cred}
      env: {cred}
      ref: vault:unused
      hosts: [{host}]
      inject: {{header: Authorization, format: "Bearer {{}}"}}
"""


class Recorder:
    """An HTTPS upstream on 127.0.0.1 that records the Authorization header of every request by
    path (what really arrived: the gate scrubs real values out of the answers a sandbox reads)."""

    def __init__(self, cert: Path, key: Path) -> None:
        import http.server

        self.auth: dict[str, str | None] = {}
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.auth[self.path] = self.headers.get("Authorization")
                body = json.dumps({"path": self.path}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = serve_https(H, cert, key)
        self.port = self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Gateway:
    """A gateway replica in a thread of this process, with its own event loop."""

    def __init__(self, tmp: Path, cfg: Path, ca_dir: Path, replica: str = "r1") -> None:
        self.loop = new_event_loop()
        self.stop = asyncio.Event()
        got: dict = {}
        self.done = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(gs.serve(cfg, ca_dir, "127.0.0.1", 0, state_dir=tmp / f"state-{replica}",
                                                      audit_dir=tmp / "audit", replica=replica,
                                                      ready=lambda a, g: got.update(addr=a, gate=g), stop=self.stop))
            finally:
                self.done.set()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while "addr" not in got:
            assert time.monotonic() < deadline and not self.done.is_set(), "the gateway did not start"
            time.sleep(0.02)
        self.addr, self.gate = got["addr"], got["gate"]
        self.state = tmp / f"state-{replica}"

    @property
    def intercept_ca(self) -> Path:  # the gate's own CA, which signs the leaves of terminated tunnels
        return Path(self.gate.ca.cert_path)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.done.wait(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw")
    test_ca, cert, key = make_test_ca(tmp / "upca")
    up = Recorder(cert, key)
    gwca = GatewayCA.create(tmp / "ca")
    cfg = tmp / "cfg"
    (cfg / "agents").mkdir(parents=True)
    (cfg / "agents" / "a.yaml").write_text(_agent("agent-a", "api.test", up.port, test_ca, "TOK_A"))
    (cfg / "agents" / "b.yaml").write_text(_agent("agent-b", "other.test", up.port, test_ca, "TOK_B"))
    (cfg / "agents" / "c.yaml").write_text(_agent("agent-c", "api.test", up.port, test_ca, "TOK_A",
                                                  extra="  limits:\n    budget: {requests: 2, hosts: [api.test]}\n"))
    os.environ["GWTEST_SECRET_A"], os.environ["GWTEST_SECRET_B"] = SECRET_A, SECRET_B
    (cfg / "gateway.yaml").write_text(f"""apiVersion: agentvm/v1
kind: Gateway
agents:
  agent-a: {{file: agents/a.yaml, placeholders: {{TOK_A: {PH_A}}}, credentials: {{TOK_A: "env:GWTEST_SECRET_A"}}}}
  agent-b: {{file: agents/b.yaml, placeholders: {{TOK_B: {PH_B}}}, credentials: {{TOK_B: "env:GWTEST_SECRET_B"}}}}
  agent-c: {{file: agents/c.yaml, placeholders: {{TOK_A: {PH_A}}}, credentials: {{TOK_A: "env:GWTEST_SECRET_A"}}}}
identities:
  - {{match: "agentvm://team/c-*", agent: agent-c}}
  - {{match: "agentvm://team/a-*", agent: agent-a}}
  - {{match: "agentvm://team/b-*", agent: agent-b}}
""")
    gw = Gateway(tmp, cfg, tmp / "ca")
    yield {"tmp": tmp, "up": up, "ca": gwca, "cfg": cfg, "gw": gw, "test_ca": test_ca}
    gw.close()
    up.close()
    for k in ("GWTEST_SECRET_A", "GWTEST_SECRET_B"):
        os.environ.pop(k, None)


class Client:
    """A sandbox's proxy bridge, in Python: TLS with its client certificate to the gateway, then
    CONNECT and TLS (the gate's interception CA) to the upstream, requests kept alive."""

    def __init__(self, world, cert: Path | None, key: Path | None, host: str = "api.test", *,
                 trust: Path | None = None) -> None:
        gw = world["gw"]
        ctx = ssl.create_default_context(cafile=str(trust or world["ca"].cert_path))
        if cert is not None:
            ctx.load_cert_chain(str(cert), str(key))
        raw = socket.create_connection(gw.addr, timeout=10)
        self.sock = ctx.wrap_socket(raw, server_hostname="localhost")
        self.world, self.host = world, host
        self.inner = None

    def _read_response(self, s) -> tuple[int, dict, bytes]:
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = s.recv(65536)
            if not d:
                raise ConnectionError(f"closed after {buf!r}")
            buf += d
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while not body.endswith(b"0\r\n\r\n"):
                d = s.recv(65536)
                if not d:
                    break
                body += d
            out, rest = b"", body
            while rest:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size, 16)
                if n == 0:
                    break
                out, rest = out + rest[:n], rest[n + 2:]
            return status, headers, out
        n = int(headers.get("content-length", "0"))
        while len(body) < n:
            d = s.recv(65536)
            if not d:
                break
            body += d
        return status, headers, body

    def connect(self) -> int:
        port = self.world["up"].port
        self.sock.sendall(f"CONNECT {self.host}:{port} HTTP/1.1\r\nHost: {self.host}:{port}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = self.sock.recv(4096)
            if not d:
                raise ConnectionError(buf)
            buf += d
        status = int(buf.split()[1])
        if status == 200:
            self._handshake()
        return status

    # TLS inside the (already TLS) proxy connection: a memory-BIO session over self.sock
    def _handshake(self) -> None:
        self._in_bio, self._out_bio = ssl.MemoryBIO(), ssl.MemoryBIO()
        ctx = ssl.create_default_context(cafile=str(self.world["gw"].intercept_ca))
        self.inner = ctx.wrap_bio(self._in_bio, self._out_bio, server_hostname=self.host)
        while True:
            try:
                self.inner.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                d = self.sock.recv(65536)
                if not d:
                    raise ConnectionError("closed during the inner handshake")
                self._in_bio.write(d)
        self._flush()

    def _flush(self) -> None:
        data = self._out_bio.read()
        if data:
            self.sock.sendall(data)

    def _inner_recv(self, _n=65536) -> bytes:
        while True:
            try:
                return self.inner.read(65536)
            except ssl.SSLWantReadError:
                self._flush()
                d = self.sock.recv(65536)
                if not d:
                    return b""
                self._in_bio.write(d)
            except ssl.SSLZeroReturnError:
                return b""

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        port = self.world["up"].port
        hdrs = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        req = f"GET {path} HTTP/1.1\r\nHost: {self.host}:{port}\r\n{hdrs}\r\n".encode()
        if self.inner is None:  # plain request on the proxy connection
            self.sock.sendall(f"GET http://{self.host}:{port}{path} HTTP/1.1\r\nHost: {self.host}:{port}\r\n{hdrs}\r\n".encode())
            return self._read_response(self.sock)
        self.inner.write(req)
        self._flush()

        class _S:
            def recv(_s, n):
                return self._inner_recv(n)

        return self._read_response(_S())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _mint(world, ident: str, **kw) -> tuple[Path, Path]:
    ca: GatewayCA = kw.pop("ca", None) or world["ca"]
    m = ca.mint(Identity.parse(ident), **kw)
    out = world["tmp"] / "certs" / f"{Identity.parse(ident).key}-{m.serial_hex[:8]}"
    files = ca.write_client(m, out)
    return files["tls.crt"], files["tls.key"]


def _log(world, ident: str) -> list[dict]:
    p = world["gw"].state / "logs" / "r1" / f"{Identity.parse(ident).key}.egress.jsonl"
    for ep in list(world["gw"].gate.endpoints.values()):
        world["gw"].loop.call_soon_threadsafe(ep.flush_log)
    time.sleep(0.2)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def test_many_identities_at_once_each_sees_only_its_own_policy_and_credentials(world):
    idents = [f"agentvm://team/a-{i}" for i in range(4)] + [f"agentvm://team/b-{i}" for i in range(4)]
    certs = {i: _mint(world, i) for i in idents}

    def one(ident: str) -> dict:
        a = "/team/a-" in ident
        own_host, own_ph = ("api.test", PH_A) if a else ("other.test", PH_B)
        foreign_host = "other.test" if a else "api.test"
        other_ph = PH_B if a else PH_A
        out = {}
        c = Client(world, *certs[ident], host=own_host)
        assert c.connect() == 200
        for n in range(3):  # a few requests on one kept-alive tunnel, all identities at once
            st, _h, body = c.get(f"/echo/{Identity.parse(ident).key}/{n}",
                                 {"Authorization": f"Bearer {own_ph}", "X-Agentvm-Sandbox": "team/other"})
            assert st == 200, body
            out.setdefault("auth", []).append(world["up"].auth[f"/echo/{Identity.parse(ident).key}/{n}"])
        # the other agent's placeholder is nothing to this identity: never swapped for anything
        fp = f"/foreign/{Identity.parse(ident).key}"
        st, _h, body = c.get(fp, {"Authorization": f"Bearer {other_ph}"})
        out["foreign"] = (st, world["up"].auth.get(fp))
        c.close()
        d = Client(world, *certs[ident], host=foreign_host)
        out["other_host"] = d.connect()
        d.close()
        return out

    with ThreadPoolExecutor(len(idents)) as pool:
        results = dict(zip(idents, pool.map(one, idents)))
    for ident, r in results.items():
        a = "/team/a-" in ident
        assert r["auth"] == [f"Bearer {SECRET_A if a else SECRET_B}"] * 3, ident
        assert r["foreign"] == (200, f"Bearer {PH_B if a else PH_A}"), ident  # passed as an opaque string
        assert r["other_host"] == 403, ident  # the other agent's host is not in this identity's policy
        # each identity's decision log holds its own requests only
        recs = _log(world, ident)
        key = Identity.parse(ident).key
        assert recs and all(r_["sandbox"] == key for r_ in recs)
        paths = {r_.get("path") for r_ in recs if r_.get("phase") == "request"}
        assert any(p and p.startswith(f"/echo/{key}/") for p in paths)
        assert not any(p and p.startswith("/echo/") and not p.startswith(f"/echo/{key}/") for p in paths)
    # a real value arrived only on its own agent's requests
    for path, auth in world["up"].auth.items():
        if path.startswith("/echo/team.a-"):
            assert auth == f"Bearer {SECRET_A}"
        elif path.startswith("/echo/team.b-"):
            assert auth == f"Bearer {SECRET_B}"


def test_curl_with_a_client_certificate_is_served_and_without_one_refused(world):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    cert, key = _mint(world, "agentvm://team/a-curl")
    gw, up = world["gw"], world["up"]
    base = ["curl", "-sS", "--max-time", "10", "--proxy", f"https://localhost:{gw.addr[1]}",
            "--proxy-cacert", str(world["ca"].cert_path), "--cacert", str(gw.intercept_ca),
            "--resolve", f"localhost:{gw.addr[1]}:127.0.0.1",
            "-H", f"Authorization: Bearer {PH_A}", f"https://api.test:{up.port}/curl"]
    ok = subprocess.run(base[:1] + ["--proxy-cert", str(cert), "--proxy-key", str(key)] + base[1:],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"path": "/curl"}
    assert world["up"].auth.pop("/curl") == f"Bearer {SECRET_A}"
    no = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert no.returncode != 0 and "/curl" not in world["up"].auth


def _refused(world, cert, key, *, trust=None) -> str:
    """How a client with this certificate fares: 'handshake' (TLS refused it), or the 403's rule."""
    try:
        c = Client(world, cert, key, trust=trust)
        st = c.connect()
    except (ssl.SSLError, ConnectionError, OSError) as exc:
        return f"handshake:{type(exc).__name__}"
    return f"status:{st}"


def test_no_certificate_is_refused(world):
    assert _refused(world, None, None).startswith("handshake")


def test_a_certificate_from_another_ca_is_refused(world):
    other = GatewayCA.create(world["tmp"] / "other-ca")
    cert, key = _mint(world, "agentvm://team/a-1", ca=other)
    assert _refused(world, cert, key).startswith("handshake")


def test_a_forged_certificate_naming_another_sandbox_is_refused(world):
    """Same issuer name as the gateway's CA, the victim's identity and serial, signed by a key
    that is not the CA's: the signature does not verify."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    victim = world["ca"].mint(Identity.parse("agentvm://team/b-0"))
    real = x509.load_pem_x509_certificate(victim.cert_pem)
    evil_ca = ec.generate_private_key(ec.SECP256R1())
    key = ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateBuilder().subject_name(real.subject).issuer_name(real.issuer).public_key(key.public_key())
    b = b.serial_number(real.serial_number).not_valid_before(real.not_valid_before_utc).not_valid_after(real.not_valid_after_utc)
    for ext in real.extensions:
        b = b.add_extension(ext.value, ext.critical)
    forged = b.sign(evil_ca, hashes.SHA256())
    d = world["tmp"] / "forged"
    d.mkdir(exist_ok=True)
    (d / "c.pem").write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    (d / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    assert _refused(world, d / "c.pem", d / "k.pem").startswith("handshake")


def test_another_sandboxs_certificate_without_its_key_cannot_be_used(world):
    """The victim's certificate with the attacker's key: no TLS stack will even offer it (the
    CertificateVerify would not verify); the attacker's own certificate names only itself."""
    vcert, _vkey = _mint(world, "agentvm://team/b-1")
    _acert, akey = _mint(world, "agentvm://team/a-1")
    ctx = ssl.create_default_context(cafile=str(world["ca"].cert_path))
    with pytest.raises(ssl.SSLError):
        ctx.load_cert_chain(str(vcert), str(akey))


def test_an_expired_certificate_is_refused(world):
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
    cert, key = _mint(world, "agentvm://team/a-2", lifetime=60, now=past)
    assert _refused(world, cert, key).startswith("handshake")


def test_revocation_and_policy_change_take_effect_on_the_next_request(world):
    cfg = world["cfg"]
    cert, key = _mint(world, "agentvm://team/a-3")
    c = Client(world, cert, key)
    assert c.connect() == 200
    assert c.get("/before", {"Authorization": f"Bearer {PH_A}"})[0] == 200
    # a policy change: the agent file now allows another port only; the open tunnel's next request
    path = cfg / "agents" / "a.yaml"
    old = path.read_text()
    try:
        path.write_text(old.replace(f"ports: [{world['up'].port}]", "ports: [1]"))
        st, h, _ = c.get("/after-change", {"Authorization": f"Bearer {PH_A}"})
        assert st == 403 and h.get("x-agentvm-denied") == "default-deny"
    finally:
        path.write_text(old)
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    c.close()
    # a revoked serial: refused on the next request of an open connection and on a new one
    cert2, key2 = _mint(world, "agentvm://team/a-4")
    serial = format(__import__("cryptography.x509", fromlist=["x"]).load_pem_x509_certificate(cert2.read_bytes()).serial_number, "x")
    c2 = Client(world, cert2, key2)
    assert c2.connect() == 200
    assert c2.get("/serial-before", {"Authorization": f"Bearer {PH_A}"})[0] == 200
    cfg_text = (cfg / "gateway.yaml").read_text()
    try:
        edit_revocations(cfg, serials=[serial])
        try:
            st, h, _ = c2.get("/serial-after", {"Authorization": f"Bearer {PH_A}"})
            assert st == 403 and h.get("x-agentvm-denied") == "identity:revoked"
        except ConnectionError:
            pass  # (the timer cut it first: refused too)
        assert _refused(world, cert2, key2) == "status:403"
        # a revoked identity: every certificate of it, but no other identity
        edit_revocations(cfg, identities=["agentvm://team/a-5"])
        cert5, key5 = _mint(world, "agentvm://team/a-5")
        assert _refused(world, cert5, key5) == "status:403"
        cert6, key6 = _mint(world, "agentvm://team/a-6")
        assert _refused(world, cert6, key6) == "status:200"
    finally:
        (cfg / "gateway.yaml").write_text(cfg_text)
        c2.close()
    assert "/serial-after" not in world["up"].auth
    recs = _log(world, "agentvm://team/a-3")
    assert any(r["rule"] == "default-deny" and r.get("path") == "/after-change" for r in recs)


def test_a_credential_revoked_in_the_source_is_refused_on_the_next_request(world):
    cfg = world["cfg"]
    cert, key = _mint(world, "agentvm://team/a-7")
    c = Client(world, cert, key)
    assert c.connect() == 200
    assert c.get("/cred-before", {"Authorization": f"Bearer {PH_A}"})[0] == 200
    text = (cfg / "gateway.yaml").read_text()
    try:
        edit_revocations(cfg, credentials=["TOK_A"])
        st, h, _ = c.get("/cred-after", {"Authorization": f"Bearer {PH_A}"})
        assert st == 403 and h.get("x-agentvm-denied") == "credential:revoked:TOK_A"
    finally:
        (cfg / "gateway.yaml").write_text(text)
        c.close()


def test_the_audit_sink_holds_one_verifiable_chain_per_sandbox(world):
    cert, key = _mint(world, "agentvm://team/b-9")
    c = Client(world, cert, key, host="other.test")
    assert c.connect() == 200
    for i in range(3):
        assert c.get(f"/audit/{i}", {"Authorization": f"Bearer {PH_B}"})[0] == 200
    c.close()
    time.sleep(1.5)  # (heads are written at most every second: agentvm.gateway.audit.HEAD_INTERVAL)
    audit = world["tmp"] / "audit"
    merged: list = []
    v = verify(audit, "team.b-9", merged=merged)
    assert v.ok, v.problems
    assert v.records >= 3 and v.replicas == ["r1"]
    assert all(r["sandbox"] == "team.b-9" for r in merged)
    # tampering breaks it
    f = audit / "team.b-9" / "r1.jsonl"
    lines = f.read_text().splitlines()
    copy = world["tmp"] / "audit-copy"
    shutil.copytree(audit, copy)
    edited = json.loads(lines[1])
    edited["rec"]["path"] = "/nothing-to-see"
    (copy / "team.b-9" / "r1.jsonl").write_text("\n".join([lines[0], json.dumps(edited)] + lines[2:]) + "\n")
    assert not verify(copy, "team.b-9").ok
    # a removed tail breaks it too (the head file)
    (copy / "team.b-9" / "r1.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert not verify(copy, "team.b-9").ok


def test_the_proxy_bridge_carries_a_plain_proxy_client_to_the_gateway(world):
    """What the pod's agent container does: HTTPS_PROXY=http://127.0.0.1:3128 (the bridge), no
    certificate of its own; the bridge (holding the identity) takes it to the gateway."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    from agentvm.gateway.bridge import bridge

    cert, key = _mint(world, "agentvm://team/a-bridge")
    ident = cert.parent
    loop = new_event_loop()
    stop = asyncio.Event()
    got: dict = {}
    t = threading.Thread(target=lambda: loop.run_until_complete(
        bridge(("127.0.0.1", 0), world["gw"].addr, "localhost", ident, ready=lambda a: got.update(addr=a), stop=stop)),
        daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while "addr" not in got:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        up = world["up"]
        r = subprocess.run(["curl", "-sS", "--max-time", "10", "--proxy", f"http://127.0.0.1:{got['addr'][1]}",
                            "--cacert", str(world["gw"].intercept_ca), "-H", f"Authorization: Bearer {PH_A}",
                            f"https://api.test:{up.port}/via-bridge"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert world["up"].auth.pop("/via-bridge") == f"Bearer {SECRET_A}"
        r = subprocess.run(["curl", "-sS", "--max-time", "10", "--proxy", f"http://127.0.0.1:{got['addr'][1]}",
                            "--cacert", str(world["gw"].intercept_ca), f"https://other.test:{up.port}/not-mine"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "/not-mine" not in world["up"].auth  # agent-a's policy: other.test denied
        assert any(x["rule"] == "default-deny" and x["host"] == "other.test" for x in _log(world, "agentvm://team/a-bridge"))
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(5)


def test_an_idle_identity_is_closed_and_served_again_with_its_budget_store(world, monkeypatch):
    """Endpoints do not pile up (10,000 sandboxes): one idle past IDLE_CLOSE is closed by the
    recheck timer; the identity's next connection opens it again."""
    cert, key = _mint(world, "agentvm://team/a-idle")
    c = Client(world, cert, key)
    assert c.connect() == 200
    assert c.get("/idle-1", {"Authorization": f"Bearer {PH_A}"})[0] == 200
    c.close()
    gate = world["gw"].gate
    monkeypatch.setattr(gs, "IDLE_CLOSE", 0.0)
    deadline = time.monotonic() + 10
    while "team.a-idle" in gate.endpoints:
        assert time.monotonic() < deadline, "the idle endpoint was not closed"
        time.sleep(0.1)
    c = Client(world, cert, key)
    assert c.connect() == 200
    assert c.get("/idle-2", {"Authorization": f"Bearer {PH_A}"})[0] == 200
    c.close()
    assert world["up"].auth["/idle-2"] == f"Bearer {SECRET_A}"


def test_budgets_are_per_identity(world):
    """agent-c allows 2 requests to api.test per sandbox: c-1 spends its own, c-2 still has its own."""
    out = {}
    for sb in ("c-1", "c-2"):
        cert, key = _mint(world, f"agentvm://team/{sb}")
        c = Client(world, cert, key)
        assert c.connect() == 200
        out[sb] = [c.get(f"/budget/{sb}/{i}")[0] for i in range(3 if sb == "c-1" else 1)]
        c.close()
    assert out["c-1"][:2] == [200, 200] and out["c-1"][2] in (402, 403, 429)
    assert out["c-2"] == [200]
    recs = _log(world, "agentvm://team/c-1")
    assert any(r["rule"].startswith("budget:") for r in recs if r["verdict"] == "deny")
