"""HTTP/2 through the gate: a terminated tunnel offers ``h2`` where the upstream speaks it, and
every stream is decided, swapped, scrubbed and logged on its own.

Two layers: the gate in this process with a real HTTP/2 client (the ``h2`` library over TLS
over the gate's socket: exact frames, several streams on one connection), and real clients in
real sandboxes - ``httpx`` with HTTP/2 and a ``grpcio`` client - to local TLS upstreams.
Names map to 127.0.0.1 through the gate's static hosts; nothing else is ever reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import ssl
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentvm.gate.policy import compile_egress
from agentvm.gate.server import Gate
from tests.helpers import needs_root
from tests.integration.gate_upstreams import H2Upstream, make_test_ca

REAL = "sk-fake-REAL-" + secrets.token_hex(12)  # an obviously fake test value


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    d = tmp_path_factory.mktemp("h2ca")
    return make_test_ca(d)


@pytest.fixture(scope="module")
def upstream(ca):
    up = H2Upstream(ca[1], ca[2])
    yield up
    up.close()


def _policy(ca_pem: Path, port: int):
    rule = lambda host, paths, rid: SimpleNamespace(host=host, ports=[port], methods=[], paths=paths,  # noqa: E731
                                                   max_body=None, websocket=False, id=rid)
    spec = SimpleNamespace(
        allow=[rule("h2.test", ["/v1/**", "/trailers/**", "/big"], "h2-api"),
               SimpleNamespace(host="h2.test", ports=[port], methods=["POST"], paths=["/upload"], max_body=100,
                               websocket=False, id="h2-upload"),
               SimpleNamespace(host="h2.test", ports=[port], methods=["POST"], paths=["/charge"], max_body=None,
                               websocket=False, id="h2-ask", action="ask")],
        deny=[], hosts={"h2.test": "127.0.0.1"}, upstream_ca=str(ca_pem), limits=None)
    return compile_egress(spec)


class H2Client:
    """CONNECT through the gate's socket, TLS (ALPN h2), then HTTP/2 streams with ``h2``."""

    def __init__(self, reader, writer, conn):
        self.r, self.w, self.conn = reader, writer, conn

    @classmethod
    async def open(cls, sock: Path, host: str, port: int, ca_pem: Path, alpn=("h2", "http/1.1")):
        import h2.config
        import h2.connection

        r, w = await asyncio.open_unix_connection(str(sock))
        w.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = await r.readuntil(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0], head
        ctx = ssl.create_default_context(cafile=str(ca_pem))
        ctx.set_alpn_protocols(list(alpn))
        await w.start_tls(ctx, server_hostname=host)
        proto = w.get_extra_info("ssl_object").selected_alpn_protocol()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        c = cls(r, w, conn)
        c.alpn = proto
        if proto == "h2":
            conn.initiate_connection()
            w.write(conn.data_to_send())
        return c

    async def requests(self, reqs: list[tuple[str, str, dict, bytes]], authority: str):
        """Send every request on its own stream at once; -> one dict per request, in order."""
        import h2.events

        out: dict[int, dict] = {}
        pending: dict[int, memoryview] = {}
        order = []
        for method, path, headers, body in reqs:
            sid = self.conn.get_next_available_stream_id()
            order.append(sid)
            hs = [(":method", method), (":scheme", "https"), (":authority", authority), (":path", path)]
            hs += list(headers.items())
            self.conn.send_headers(sid, [(k.encode(), v.encode()) for k, v in hs], end_stream=not body)
            if body:
                pending[sid] = memoryview(body)
            out[sid] = {"status": None, "headers": {}, "body": b"", "trailers": {}, "ended": False, "reset": None}

        def pump():  # request bodies as the flow-control windows allow
            for sid, view in list(pending.items()):
                if out[sid]["reset"] is not None or out[sid]["ended"]:
                    del pending[sid]
                    continue
                while view:
                    n = min(len(view), self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
                    if n <= 0:
                        break
                    self.conn.send_data(sid, bytes(view[:n]))
                    view = view[n:]
                pending[sid] = view
                if not view:
                    self.conn.end_stream(sid)
                    del pending[sid]

        pump()
        self.w.write(self.conn.data_to_send())
        while not all(v["ended"] or v["reset"] is not None for v in out.values()):
            data = await asyncio.wait_for(self.r.read(65536), 10)
            if not data:
                break
            for ev in self.conn.receive_data(data):
                st = out.get(getattr(ev, "stream_id", None))
                if isinstance(ev, h2.events.ResponseReceived):
                    hd = {bytes(k).decode(): bytes(v).decode() for k, v in ev.headers}
                    st["status"], st["headers"] = int(hd.pop(":status")), hd
                elif isinstance(ev, h2.events.DataReceived):
                    st["body"] += ev.data
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.TrailersReceived):
                    st["trailers"] = {bytes(k).decode(): bytes(v).decode() for k, v in ev.headers}
                elif isinstance(ev, h2.events.StreamEnded):
                    st["ended"] = True
                elif isinstance(ev, h2.events.StreamReset) and st is not None:
                    st["reset"] = ev.error_code
            pump()
            self.w.write(self.conn.data_to_send())
        return [out[s] for s in order]

    def close(self):
        self.w.close()


async def _gate(tmp: Path, ca, port: int, creds=None):
    gate = Gate(tmp / "gate", tmp / "logs")
    sock = tmp / f"g-{secrets.token_hex(3)}.sock"
    ep = await gate.open_endpoint("sbx-h2", "agent", _policy(ca[0], port), sock, creds=creds)
    gate.ca  # noqa: B018 - created now: the clients below trust it
    return gate, ep, sock


def _gate_ca(tmp: Path) -> Path:
    return tmp / "gate" / "ca" / "ca.crt"


def _bearer_creds():
    """(a CredentialSet holding REAL for h2.test as ``Authorization: Bearer``, its placeholder)."""
    from agentvm.gate.credentials import CredentialSet, compile_credentials, make_placeholder

    b = SimpleNamespace(
        name="api", env="API_KEY", ref="vault:api", hosts=["h2.test"],
        inject=SimpleNamespace(header="Authorization", format="Bearer {}", basic=None, query=None), file=None,
        placeholder=SimpleNamespace(prefix="sk-", length=None, charset="alnum"), sigv4=None, hmac=None)
    bindings = compile_credentials([b])
    ph = make_placeholder(bindings[0], len(REAL))
    return CredentialSet(bindings, {"api": ph}, lambda n: REAL, lambda n: False), ph


def _records(ep):
    return [json.loads(ln) for ln in ep.log_path.read_text().splitlines()]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_streams_are_decided_one_by_one_on_one_connection(tmp_path, ca, upstream):
    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        assert c.alpn == "h2"
        n_before = len(upstream.seen)
        res = await c.requests([
            ("GET", "/v1/items?x=1", {"accept": "*/*"}, b""),
            ("GET", "/admin", {}, b""),  # no rule allows it: 403 on this stream only
            ("POST", "/v1/echo", {"content-type": "text/plain"}, b"hello over h2"),
            ("GET", "/trailers/x", {"te": "trailers"}, b""),
            ("GET", "/big?n=300000", {}, b""),  # more than a window: flow control end to end
            ("POST", "/v1/upload-big", {}, b"u" * 400000),  # and the other way
        ], authority=f"h2.test:{upstream.port}")
        c.close()
        await gate.close_endpoint("sbx-h2")
        return res, upstream.seen[n_before:], _records(ep)

    res, seen, recs = run(go())
    ok, denied, post, trailers, big, upload = res
    assert ok["status"] == 200 and json.loads(ok["body"])["path"] == "/v1/items?x=1"
    assert denied["status"] == 403 and denied["headers"]["x-agentvm-denied"] == "default-deny"
    assert json.loads(denied["body"])["rule"] == "default-deny"
    assert json.loads(post["body"])["body"] == "hello over h2"
    assert trailers["trailers"] == {"x-trailer": "done"}
    assert json.loads(trailers["body"])["headers"].get("te") == "trailers"
    assert big["status"] == 200 and len(big["body"]) == 300000
    assert upload["status"] == 200 and len(json.loads(upload["body"])["body"]) == 400000
    assert sorted(r["path"] for r in seen) == sorted(["/v1/items?x=1", "/v1/echo", "/trailers/x", "/big?n=300000",
                                                      "/v1/upload-big"])
    assert all(r["authority"] == f"h2.test:{upstream.port}" for r in seen)
    by_path = {r["path"]: r for r in recs if r.get("path")}
    assert by_path["/admin"]["verdict"] == "deny" and by_path["/admin"]["protocol"] == "h2"
    assert by_path["/v1/echo"]["verdict"] == "allow" and by_path["/v1/echo"]["protocol"] == "h2"
    assert by_path["/v1/echo"]["bytes_out"] == len(b"hello over h2")
    assert by_path["/big?n=300000"]["bytes_in"] == 300000


def test_authority_must_be_the_tunnel_host_and_max_body_is_enforced(tmp_path, ca, upstream):
    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        n_before = len(upstream.seen)
        res = await c.requests([
            ("GET", "/v1/x", {}, b""),
            ("POST", "/upload", {}, b"y" * 500),  # over the rule's maxBody of 100
        ], authority=f"h2.test:{upstream.port}")
        fronted = await c.requests([("GET", "/v1/x", {}, b"")], authority=f"evil.test:{upstream.port}")
        c.close()
        await gate.close_endpoint("sbx-h2")
        return res, fronted, upstream.seen[n_before:], _records(ep)

    (ok, upload), (fronted,), seen, recs = run(go())
    assert ok["status"] == 200
    assert upload["status"] == 413 or upload["reset"] is not None
    assert fronted["status"] == 403 and fronted["headers"]["x-agentvm-denied"] == "host-mismatch"
    assert not any(r["path"] == "/upload" and len(r["body"]) > 100 for r in seen)
    assert any(r["rule"] == "h2-upload:max-body" for r in recs)


def test_a_request_that_needs_an_approval_is_refused_on_http2_and_never_forwarded(tmp_path, ca, upstream):
    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        n_before = len(upstream.seen)
        res = await c.requests([("POST", "/charge", {}, b"amount=1"), ("GET", "/v1/x", {}, b"")],
                               authority=f"h2.test:{upstream.port}")
        c.close()
        await gate.close_endpoint("sbx-h2")
        return res, upstream.seen[n_before:], _records(ep)

    (held, ok), seen, recs = run(go())
    assert held["status"] == 403 and held["headers"]["x-agentvm-denied"] == "approval:h2-unsupported"
    assert ok["status"] == 200  # the connection's other streams go on
    assert not any(r["path"] == "/charge" for r in seen)
    assert any(r["rule"] == "approval:h2-unsupported" for r in recs)


def test_a_placeholder_is_swapped_in_a_header_and_an_echo_is_scrubbed(tmp_path, ca, upstream):
    creds, ph = _bearer_creds()

    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port, creds=creds)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        n_before = len(upstream.seen)
        res = await c.requests([
            ("GET", "/v1/me", {"authorization": f"Bearer {ph}"}, b""),
            ("POST", "/v1/echo", {}, f"token={ph}".encode()),  # a placeholder in a body: a leak
        ], authority=f"h2.test:{upstream.port}")
        c.close()
        await gate.close_endpoint("sbx-h2")
        return res, upstream.seen[n_before:], _records(ep)

    (me, leak), seen, recs = run(go())
    got = [r for r in seen if r["path"] == "/v1/me"]
    assert got and got[0]["headers"]["authorization"] == f"Bearer {REAL}"  # the upstream got the real value
    assert REAL not in me["body"].decode() and "[agentvm:scrubbed" in me["body"].decode() or REAL not in me["body"].decode()
    assert REAL.encode() not in me["body"]  # its echo never reaches the sandbox
    assert leak["status"] == 403 or leak["reset"] is not None
    assert not any(ph in r["body"] for r in seen)
    assert any(r["rule"].startswith("credential:") and r.get("protocol") == "h2" for r in recs)
    assert any(r.get("credentials") == ["api"] and r["path"] == "/v1/me" for r in recs)


def test_an_http1_only_upstream_gets_http1_and_the_sandbox_is_offered_http1(tmp_path, ca):
    from tests.integration.gate_upstreams import serve_https
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            body = b"h1 only"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = serve_https(H, ca[1], ca[2])
    port = httpd.server_address[1]

    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, port)
        c = await H2Client.open(sock, "h2.test", port, _gate_ca(tmp_path))
        alpn = c.alpn
        c.w.write(f"GET /v1/x HTTP/1.1\r\nHost: h2.test:{port}\r\n\r\n".encode())
        data = await asyncio.wait_for(c.r.read(65536), 10)
        c.close()
        await gate.close_endpoint("sbx-h2")
        return alpn, data

    try:
        alpn, data = run(go())
    finally:
        httpd.shutdown()
    assert alpn == "http/1.1" and data.startswith(b"HTTP/1.1 200") and data.endswith(b"h1 only")


# ---------------------------------------------------------------------------- real clients in real sandboxes

TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))
GRPC_TOKEN = "grpc-fake-REAL-" + secrets.token_hex(12)  # an obviously fake test value


class GrpcUpstream:
    """A grpcio server (TLS, the test CA's certificate) with two methods on raw bytes:
    ``/echo.Echo/Say`` answers the request and the ``authorization`` metadata it got (so the
    test sees the swap, and the gate must scrub the echo), ``/echo.Echo/Secret`` exists but no
    rule allows it. ``seen`` records (method, metadata, request)."""

    def __init__(self, cert: Path, key: Path):
        import grpc
        from concurrent import futures

        self.seen: list[tuple[str, dict, bytes]] = []

        def handler(name):
            def call(request: bytes, context) -> bytes:
                md = dict(context.invocation_metadata())
                self.seen.append((name, md, request))
                return b"said:" + request + b";auth=" + md.get("authorization", "").encode()
            return grpc.unary_unary_rpc_method_handler(call)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "echo.Echo", {"Say": handler("Say"), "Secret": handler("Secret")}),))
        creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        self.server.start()

    def close(self):
        self.server.stop(0)


@pytest.fixture(scope="module")
def sbx(tmp_path_factory):
    import shutil
    import subprocess
    import textwrap

    from tests.helpers import agentvm_cmd

    if not (TESTLIB / "grpc").is_dir() or not (TESTLIB / "h2").is_dir():
        pytest.fail(f"{TESTLIB} lacks grpcio/h2: run `bash scripts/install.sh --test`")
    d = Path(f"/tmp/agentvm-h2-test-{secrets.token_hex(3)}")
    d.mkdir(mode=0o755)
    ca, cert, key = make_test_ca(d / "ca")
    os.chmod(d / "ca", 0o755)
    h2up, grpcup = H2Upstream(cert, key), GrpcUpstream(cert, key)
    r = subprocess.run(agentvm_cmd() + ["secret", "set", "grpc-token"], input=GRPC_TOKEN.encode(), capture_output=True)
    assert r.returncode == 0, r.stderr
    agent = d / "h2-agent.yaml"
    agent.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: h2-agent}}
        spec:
          riskTier: L3
          limits: {{timeout: 90s, memory: 1G}}
          mounts: [{{host: {TESTLIB}, path: /opt/testlib}}]
          env: {{PYTHONPATH: /opt/testlib}}
          egress:
            hosts: {{h2.test: 127.0.0.1, grpc.test: 127.0.0.1}}
            upstreamCa: {ca}
            allow:
              - {{host: h2.test, ports: [{h2up.port}], paths: ["/v1/**"], id: h2-api}}
              - {{host: grpc.test, ports: [{grpcup.port}], methods: [POST], paths: ["/echo.Echo/Say"], id: grpc-say}}
          credentials:
            - {{name: grpc, env: GRPC_TOKEN, ref: "vault:grpc-token", hosts: [grpc.test],
               inject: {{header: Authorization, format: "Bearer {{}}"}}}}
        """))
    yield SimpleNamespace(dir=d, agent=agent, h2=h2up, grpc=grpcup)
    h2up.close()
    grpcup.close()
    shutil.rmtree(d, ignore_errors=True)


def _run_py(env, code: str):
    import subprocess

    from tests.helpers import agentvm_cmd, last_json

    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(env.agent), "--json", "--", "python3", "-c", code],
                       capture_output=True, timeout=120)
    res = last_json(r.stdout)
    recs = [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]
    return r, res, recs


@pytest.mark.integration
@needs_root
def test_httpx_http2_client_in_a_sandbox(sbx):
    import textwrap

    p = sbx.h2.port
    code = textwrap.dedent(f"""
        import httpx
        with httpx.Client(http2=True) as c:
            r = c.get("https://h2.test:{p}/v1/items")
            print("OK", r.http_version, r.status_code, r.json()["path"])
            r = c.get("https://h2.test:{p}/admin")
            print("DENIED", r.http_version, r.status_code, r.headers.get("x-agentvm-denied"))
            r = c.post("https://h2.test:{p}/v1/echo", content=b"payload-h2")
            print("POST", r.http_version, r.json()["body"])
    """)
    before = len(sbx.h2.seen)
    r, res, recs = _run_py(sbx, code)
    out = r.stdout.decode()
    assert r.returncode == 0, (out, r.stderr.decode()[-3000:])
    assert "OK HTTP/2 200 /v1/items" in out and "POST HTTP/2 payload-h2" in out, out
    assert "DENIED HTTP/2 403 default-deny" in out, out
    assert [s["path"] for s in sbx.h2.seen[before:]] == ["/v1/items", "/v1/echo"]  # the denied one never left
    h2recs = [x for x in recs if x.get("protocol") == "h2"]
    assert {(x["path"], x["verdict"]) for x in h2recs} >= {("/v1/items", "allow"), ("/admin", "deny"), ("/v1/echo", "allow")}


@pytest.mark.integration
@needs_root
def test_grpc_client_in_a_sandbox_allowed_denied_and_the_token_swapped(sbx):
    import textwrap

    g = sbx.grpc.port
    code = textwrap.dedent(f"""
        import os, grpc
        token = os.environ["GRPC_TOKEN"]
        ch = grpc.secure_channel("grpc.test:{g}", grpc.ssl_channel_credentials())
        say = ch.unary_unary("/echo.Echo/Say")
        reply = say(b"hello-grpc", metadata=[("authorization", "Bearer " + token)], timeout=20)
        print("REPLY", reply.decode())
        try:
            ch.unary_unary("/echo.Echo/Secret")(b"x", timeout=20)
            print("SECRET-ANSWERED")
        except grpc.RpcError as e:
            print("SECRET", e.code().name)
        print("PH", token)
    """)
    before = len(sbx.grpc.seen)
    r, res, recs = _run_py(sbx, code)
    out = r.stdout.decode()
    assert r.returncode == 0, (out, r.stderr.decode()[-3000:])
    ph = out.split("PH ")[1].split()[0]
    assert ph != GRPC_TOKEN and GRPC_TOKEN not in out  # the echo of the real token was scrubbed
    assert "REPLY said:hello-grpc;auth=" in out, out
    assert "SECRET PERMISSION_DENIED" in out, out  # gRPC's reading of the gate's 403 on that stream
    seen = sbx.grpc.seen[before:]
    assert [s[0] for s in seen] == ["Say"]  # the denied method never reached the server
    assert seen[0][1]["authorization"] == f"Bearer {GRPC_TOKEN}" and seen[0][2] == b"hello-grpc"
    say = [x for x in recs if x.get("path") == "/echo.Echo/Say"]
    assert say and say[0]["verdict"] == "allow" and say[0]["protocol"] == "h2" and say[0].get("credentials") == ["grpc"]
    assert say[0].get("scrubbed") and say[0].get("alert")
    assert any(x.get("path") == "/echo.Echo/Secret" and x["verdict"] == "deny" for x in recs)


def test_a_stream_the_sandbox_resets_ends_alone_and_is_logged(tmp_path, ca, upstream):
    import h2.errors
    import h2.events

    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        conn = c.conn
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                (b":authority", f"h2.test:{upstream.port}".encode()), (b":path", b"/big?n=200000")],
                          end_stream=True)
        c.w.write(conn.data_to_send())
        got = 0
        while got == 0:  # the first data of the response, then the sandbox gives up on it
            for ev in conn.receive_data(await asyncio.wait_for(c.r.read(65536), 10)):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    got += len(ev.data)
        conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        c.w.write(conn.data_to_send())
        (after,) = await c.requests([("GET", "/v1/after", {}, b"")], authority=f"h2.test:{upstream.port}")
        c.close()
        await gate.close_endpoint("sbx-h2")
        return after, _records(ep)

    after, recs = run(go())
    assert after["status"] == 200 and json.loads(after["body"])["path"] == "/v1/after"  # the connection lives on
    big = [r for r in recs if r.get("path") == "/big?n=200000"]
    assert len(big) == 1 and big[0]["error"] == "client-reset" and big[0]["bytes_in"] < 200000


def _zstd_rle(blocks: int) -> bytes:
    """A valid zstd frame of ``blocks`` RLE blocks of 128 KiB each: 4 bytes per 128 KiB decoded."""
    import struct

    out = b"\x28\xb5\x2f\xfd\x00" + bytes([(23 - 10) << 3])  # magic, no flags, a 8 MiB window
    for i in range(blocks):
        out += struct.pack("<I", (1 if i == blocks - 1 else 0) | 2 | ((128 * 1024) << 3))[:3] + b"A"
    return out


async def _bridged(monkeypatch):
    """Capture the H2Bridge objects the gate makes (to look at what they hold)."""
    import agentvm.gate.h2relay as hr

    made = []
    orig = hr.H2Bridge.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(hr.H2Bridge, "__init__", init)
    return made


def test_a_compressed_answer_is_decoded_no_faster_than_the_sandbox_reads(tmp_path, ca, monkeypatch):
    """With credentials in the sandbox a compressed response is decoded to be scrubbed; a
    32 MiB zstd bomb (1 KiB on the wire) to a sandbox that never opens its window must not
    make the gate hold the decoded bytes."""
    import h2.config
    import h2.connection
    import h2.events

    bomb = _zstd_rle(256)

    async def bomb_upstream(r, w):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        w.write(conn.data_to_send())
        while data := await r.read(65536):
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    conn.send_headers(ev.stream_id, [(b":status", b"200"), (b"content-encoding", b"zstd")])
                    conn.send_data(ev.stream_id, bomb, end_stream=True)
            w.write(conn.data_to_send())
            await w.drain()

    creds, _ = _bearer_creds()

    async def go():
        made = await _bridged(monkeypatch)
        sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        sctx.load_cert_chain(str(ca[1]), str(ca[2]))
        sctx.set_alpn_protocols(["h2"])
        srv = await asyncio.start_server(bomb_upstream, "127.0.0.1", 0, ssl=sctx)
        port = srv.sockets[0].getsockname()[1]
        gate, ep, sock = await _gate(tmp_path, ca, port, creds=creds)
        c = await H2Client.open(sock, "h2.test", port, _gate_ca(tmp_path))
        sid = c.conn.get_next_available_stream_id()
        c.conn.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", f"h2.test:{port}".encode()),
                                  (b":path", b"/v1/bomb"), (b"accept-encoding", b"zstd")], end_stream=True)
        c.w.write(c.conn.data_to_send())
        got = 0
        for _ in range(10):  # read, never acknowledge: the sandbox's window stays shut
            try:
                data = await asyncio.wait_for(c.r.read(65536), 0.3)
            except asyncio.TimeoutError:
                break
            for ev in c.conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived):
                    got += len(ev.data)
        held = sum(len(x) for s in made[0].streams.values() for x, _ in s.to_down
                   if isinstance(x, (bytes, bytearray, memoryview)))
        c.close()
        await gate.close_endpoint("sbx-h2")
        srv.close()
        return got, held

    got, held = run(go())
    assert got <= 65535 and held < 1 << 20, (got, held)


def test_denied_streams_are_not_kept(tmp_path, ca, upstream, monkeypatch):
    async def go():
        made = await _bridged(monkeypatch)
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        statuses = set()
        for _ in range(4):
            res = await c.requests([("GET", "/not-allowed", {}, b"")] * 50, authority=f"h2.test:{upstream.port}")
            statuses |= {r["status"] for r in res}
        kept = len(made[0].streams) + len(made[0].by_up)
        c.close()
        await gate.close_endpoint("sbx-h2")
        return statuses, kept

    statuses, kept = run(go())
    assert statuses <= {403, 429} and kept == 0


def test_a_declared_length_the_body_does_not_match_never_reaches_the_upstream_as_a_length(tmp_path, ca, upstream):
    """H2.CL: a content-length with no body (END_STREAM on the head), or a shorter body ended by
    trailers, is refused; and the gate never passes a sandbox's content-length upstream (HTTP/2
    ends bodies with END_STREAM), so a front that would trust it cannot be desynced."""
    import h2.events

    async def go():
        gate, ep, sock = await _gate(tmp_path, ca, upstream.port)
        c = await H2Client.open(sock, "h2.test", upstream.port, _gate_ca(tmp_path))
        conn, auth = c.conn, f"h2.test:{upstream.port}".encode()
        base = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", auth)]
        n_before = len(upstream.seen)
        a = conn.get_next_available_stream_id()
        conn.send_headers(a, base + [(b":path", b"/v1/a"), (b"content-length", b"60")], end_stream=True)
        b = conn.get_next_available_stream_id()
        conn.send_headers(b, base + [(b":path", b"/v1/b"), (b"content-length", b"60")])
        conn.send_data(b, b"0123456789")
        conn.send_headers(b, [(b"x-trailer", b"t")], end_stream=True)
        c.w.write(conn.data_to_send())
        status, done = {}, set()
        while len(done) < 2:
            data = await asyncio.wait_for(c.r.read(65536), 10)
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    status[ev.stream_id] = dict(ev.headers)[b":status"]
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    done.add(ev.stream_id)
            c.w.write(conn.data_to_send())
        (ok,) = await c.requests([("POST", "/v1/c", {"content-length": "3"}, b"abc")], authority=auth.decode())
        c.close()
        await gate.close_endpoint("sbx-h2")
        return status, upstream.seen[n_before:], _records(ep), ok, a, b

    status, seen, recs, ok, a, b = run(go())
    assert status.get(a) == b"400" and status.get(b) in (b"400", None)
    assert not any(r["path"] in ("/v1/a", "/v1/b") and r["body"] for r in seen)  # no body of theirs ever completed
    assert {r["path"] for r in recs if r["rule"] == "bad-request:bad-content-length"} == {"/v1/a", "/v1/b"}
    c_seen = [r for r in seen if r["path"] == "/v1/c"]
    assert ok["status"] == 200 and c_seen and "content-length" not in c_seen[0]["headers"] and c_seen[0]["body"] == "abc"
