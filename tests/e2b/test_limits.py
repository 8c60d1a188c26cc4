"""What one E2B tenant can make the daemon hold (security review: the E2B API runs inside the
root daemon). Each test attacks the real code path of the adapter over a fake backend (the
sandbox side of a real WebSocket server in another process for the port proxy) and fails on
the code before the bounds:

* a sandbox's WebSocket server sending one 64 MiB message: refused as it arrives (1009), the
  proxy's memory does not grow by the message; a client's 17 MiB message: refused too;
* request bodies: refused on Content-Length before a byte is read (413), a chunked body read
  only up to the limit, an upload staged in a file, never whole in memory;
* concurrent Starts cannot pass MAX_PROCS; a cancelled Start leaves no orphan (pump task or
  thread); an ended process leaves box.procs; a first stderr line without newline is bounded;
* watch_dir streams and file reads are capped per sandbox / tenant.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentvm.e2b import app as e2bapp
from agentvm.e2b import envd
from agentvm.e2b import templates as tpls
from agentvm.e2b._gen import filesystem_pb as fpb
from agentvm.e2b._gen import process_pb as ppb
from agentvm.e2b.backend import DaemonBackend, EventChannel, ExecEvent, Upload
from agentvm.e2b.cpbackend import ControlPlaneBackend

MiB = 1024 * 1024


# -- a fake backend and raw ASGI calls -----------------------------------------------------------

class Handle:
    def __init__(self, pid: int):
        self.pid = pid
        self.chan = EventChannel()
        self.closed = False

    def events(self):
        return self.chan.events()

    def close(self):
        self.closed = True
        self.chan.close()

    def exit(self, code: int = 0):
        self.chan.finish(ExecEvent("exit", exit_code=code))


class Fake:
    def __init__(self):
        self.gate = asyncio.Event()
        self.gate.set()
        self.execs = 0
        self.reads = 0
        self.written: dict[str, tuple[str, int, str]] = {}
        self.handles: list[Handle] = []

    async def create(self, name, spec_text, ttl):
        pass

    async def kill(self, name):
        pass

    async def exec(self, name, spec):
        self.execs += 1
        await self.gate.wait()
        h = Handle(1000 + len(self.handles))
        self.handles.append(h)
        return h

    async def read_file(self, name, path):
        self.reads += 1
        await self.gate.wait()
        return b"data"

    async def write_file(self, name, path, data):
        h = hashlib.sha256()
        if isinstance(data, Upload):
            data.rewind()
            n = 0
            while chunk := await data.read():
                h.update(chunk)
                n += len(chunk)
            self.written[path] = ("upload", n, h.hexdigest())
        else:
            h.update(data)
            self.written[path] = ("bytes", len(data), h.hexdigest())

    async def list_dir(self, name, path, depth):
        return []


class Ctx:
    def __init__(self, box):
        self.request_headers = {"e2b-sandbox-id": box.id, "x-access-token": box.token}


def _service(tmp_path):
    backend = Fake()
    app = e2bapp.make_app(backend, {"key-a": "a"}, home=tmp_path)
    return app, app.service, backend


async def _box(svc):
    return await svc.create("a", {"templateID": "base"})


async def _call(app, method, path, headers, chunks=(), query=b""):
    """One request to the ASGI app; returns (status, body, bytes of the request body it pulled)."""
    chunks = iter(chunks)
    pulled = [0]
    sent = []

    async def receive():
        try:
            c = next(chunks)
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled[0] += len(c)
        return {"type": "http.request", "body": c, "more_body": True}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": query,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), pulled[0]


def _stream(total: int, chunk: bytes = b"x" * (64 * 1024)):
    for _ in range(total // len(chunk)):
        yield chunk


def _envd_headers(box, **kw):
    return {"e2b-sandbox-id": box.id, "x-access-token": box.token, **kw}


# -- 2. request bodies ------------------------------------------------------------------------

def test_a_rest_body_is_refused_on_its_length_before_it_is_read(tmp_path):
    async def go():
        app, svc, _ = _service(tmp_path)
        st, body, pulled = await _call(app, "POST", "/sandboxes", {"x-api-key": "key-a", "content-length": str(1 << 30)},
                                       _stream(16 * MiB))
        assert st == 413 and b"larger than" in body
        assert pulled == 0
        st, body, pulled = await _call(app, "POST", "/sandboxes", {"x-api-key": "key-a"}, _stream(16 * MiB))
        assert st == 413  # chunked: read up to the limit only
        assert pulled <= e2bapp.MAX_JSON_BODY + 64 * 1024
        st, body, _ = await _call(app, "POST", "/sandboxes", {"x-api-key": "key-a"}, [b'{"templateID": "base"}'])
        assert st == 201, body
        await svc.close()

    asyncio.run(go())


def test_an_upload_is_refused_on_its_length_and_stopped_at_the_limit(tmp_path, monkeypatch):
    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        st, body, pulled = await _call(app, "POST", "/files", _envd_headers(
            box, **{"content-type": "application/octet-stream", "content-length": str(e2bapp.MAX_UPLOAD + 1)}),
            _stream(8 * MiB), query=b"path=big")
        assert st == 413 and pulled == 0 and backend.written == {}
        monkeypatch.setattr(e2bapp, "MAX_UPLOAD", 1 * MiB)
        st, body, pulled = await _call(app, "POST", "/files", _envd_headers(
            box, **{"content-type": "application/octet-stream"}), _stream(8 * MiB), query=b"path=big")
        assert st == 413 and pulled <= 1 * MiB + 64 * 1024 and backend.written == {}
        assert svc.transfers == {}  # the slot was given back
        await svc.close()

    asyncio.run(go())


def test_an_upload_is_staged_in_a_file_not_held_in_memory(tmp_path):
    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        chunk = b"y" * MiB
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            st, body, pulled = await _call(app, "POST", "/files", _envd_headers(
                box, **{"content-type": "application/octet-stream", "content-length": str(32 * MiB)}),
                (chunk for _ in range(32)), query=b"path=f.bin")
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert st == 200, body
        assert backend.written["/workspace/f.bin"] == ("upload", 32 * MiB, hashlib.sha256(chunk * 32).hexdigest())
        assert peak < 8 * MiB, f"{peak} bytes held for a 32 MiB upload"
        await svc.close()

    asyncio.run(go())


def test_a_multipart_upload_still_arrives_whole(tmp_path):
    import httpx

    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/files", params={"path": "m.bin"}, headers=_envd_headers(box),
                             files={"file": ("m.bin", b"z" * (3 * MiB))})
        assert r.status_code == 200, r.text
        assert backend.written["/workspace/m.bin"] == ("upload", 3 * MiB, hashlib.sha256(b"z" * (3 * MiB)).hexdigest())
        await svc.close()

    asyncio.run(go())


# -- 3. MAX_PROCS is not raced past -------------------------------------------------------------

def _start_req(cmd="/bin/true"):
    return ppb.StartRequest(process=ppb.ProcessConfig(cmd=cmd))


def test_concurrent_starts_cannot_pass_max_procs(tmp_path):
    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        ps = envd.ProcessService(svc)
        backend.gate.clear()  # every exec waits: the Starts are all in flight together
        n = envd.MAX_PROCS + 8
        gens = [ps.start(_start_req(), Ctx(box)) for _ in range(n)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0.2)
        refused = [t for t in tasks if t.done() and isinstance(t.exception(), ConnectError)]
        assert backend.execs == envd.MAX_PROCS
        assert len(refused) == 8 and all(t.exception().code == Code.RESOURCE_EXHAUSTED for t in refused)
        backend.gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(box.procs) == envd.MAX_PROCS and box.starting == 0
        for h in backend.handles:
            h.exit()
        for g in gens:
            await g.aclose()
        await asyncio.sleep(0.05)
        assert box.procs == {}
        await svc.close()

    asyncio.run(go())


# -- 4. a cancelled Start leaves no orphan --------------------------------------------------------

def test_a_start_cancelled_while_the_control_plane_execs_cancels_that_exec():
    class CP:
        def __init__(self):
            self.managed = {"s": type("M", (), {"handle": object()})()}
            self.entered = asyncio.Event()
            self.ended = asyncio.Event()

        async def exec(self, name, argv, out, timeout=None, actor=None):
            self.entered.set()
            try:
                await asyncio.sleep(3600)  # a command that never writes its pid line
            finally:
                self.ended.set()

    async def go():
        from agentvm.e2b.backend import ExecSpec

        cp = CP()
        t = asyncio.ensure_future(ControlPlaneBackend(cp).exec("s", ExecSpec(["/bin/true"])))
        await asyncio.wait_for(cp.entered.wait(), 5)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.wait_for(cp.ended.wait(), 5)  # the exec was not left running for nobody

    asyncio.run(go())


class _Client:
    """DaemonBackend's HTTP client: ``exec`` streams the given events, waiting on ``go`` first."""

    def __init__(self, events, go=None):
        self.events, self.go = events, go
        self.left = threading.Event()  # the stream was left (closed) before its end
        self.end = threading.Event()

    def exec(self, name, argv, timeout):
        try:
            if self.go is not None:
                self.go.wait(10)
            yield from self.events
            self.end.wait(10)
        except GeneratorExit:
            self.left.set()
            raise


def test_a_start_cancelled_while_the_daemon_execs_leaves_its_stream():
    async def go():
        from agentvm.e2b.backend import ExecSpec

        gate = threading.Event()
        client = _Client([{"stream": "stdout", "data": b"a"}, {"stream": "stdout", "data": b"b"}], gate)
        t = asyncio.ensure_future(DaemonBackend(client).exec("s", ExecSpec(["/bin/true"])))
        await asyncio.sleep(0.1)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        gate.set()
        try:
            assert await asyncio.to_thread(client.left.wait, 5), "the thread still follows the cancelled exec"
        finally:
            client.end.set()

    asyncio.run(go())


# -- 5. ended processes leave box.procs ---------------------------------------------------------

def test_an_ended_process_whose_start_stream_left_first_is_forgotten(tmp_path):
    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        ps = envd.ProcessService(svc)
        g = ps.start(_start_req(), Ctx(box))
        await g.__anext__()  # the start event; then the client goes away
        await g.aclose()
        (pid,) = box.procs
        proc = box.procs[pid]
        backend.handles[0].exit()
        await asyncio.wait_for(proc.task, 5)
        assert box.procs == {}
        await svc.close()

    asyncio.run(go())


def test_an_ended_process_whose_end_is_never_read_is_dropped_after_the_lag(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_E2B_SUBSCRIBER_LAG", "1")

    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        ps = envd.ProcessService(svc)
        g = ps.start(_start_req(), Ctx(box))
        await g.__anext__()  # the stream stays open and never reads on
        (pid,) = box.procs
        proc = box.procs[pid]
        backend.handles[0].exit()
        await asyncio.wait_for(proc.task, 5)
        assert pid in box.procs  # its end is still owed to the open stream
        for _ in range(100):
            if not box.procs:
                break
            await asyncio.sleep(0.05)
        assert box.procs == {} and proc.subscribers == []
        with pytest.raises(ConnectError) as ei:  # the stream learns why
            while True:
                await g.__anext__()
        assert ei.value.code == Code.RESOURCE_EXHAUSTED
        await svc.close()

    asyncio.run(go())


# -- 6. the first stderr line is bounded ---------------------------------------------------------

def test_a_first_stderr_line_without_newline_is_not_held_without_limit():
    async def go():
        from agentvm.e2b.backend import ExecSpec

        client = _Client([{"stream": "stderr", "data": b"x" * (64 * 1024)} for _ in range(4)])
        try:
            proc = await asyncio.wait_for(DaemonBackend(client).exec("s", ExecSpec(["/bin/true"])), 5)
            ev = await asyncio.wait_for(proc.events().__anext__(), 5)
            assert ev.kind == "stderr" and len(ev.data) == 64 * 1024
            assert len(proc._stderr_head) == 0
            proc.abort()
        finally:
            client.end.set()

    asyncio.run(go())


# -- 7. watch streams and file reads are capped ---------------------------------------------------

def test_watch_dir_streams_are_capped_per_sandbox(tmp_path):
    async def go():
        app, svc, backend = _service(tmp_path)
        box = await _box(svc)
        fs = envd.FilesystemService(svc)
        req = fpb.WatchDirRequest(path="/workspace")
        gens = []
        for _ in range(envd.MAX_WATCH_STREAMS):
            g = fs.watch_dir(req, Ctx(box))
            await g.__anext__()
            gens.append(g)
        extra = fs.watch_dir(req, Ctx(box))
        with pytest.raises(ConnectError) as ei:
            await extra.__anext__()
        assert ei.value.code == Code.RESOURCE_EXHAUSTED
        await gens.pop().aclose()
        g = fs.watch_dir(req, Ctx(box))
        await g.__anext__()  # a slot again
        gens.append(g)
        for g in gens:
            await g.aclose()
        assert box.watch_streams == 0
        await svc.close()

    asyncio.run(go())


def test_concurrent_file_reads_are_capped_per_tenant(tmp_path):
    async def go():
        app, svc, backend = _service(tmp_path)
        boxes = [await _box(svc) for _ in range(2)]
        backend.gate.clear()
        tasks = [asyncio.ensure_future(_call(app, "GET", "/files", _envd_headers(boxes[i % 2]), query=b"path=f"))
                 for i in range(e2bapp.MAX_TRANSFERS_PER_TENANT)]
        for _ in range(100):
            if backend.reads == e2bapp.MAX_TRANSFERS_PER_TENANT:
                break
            await asyncio.sleep(0.01)
        st, body, _ = await asyncio.wait_for(_call(app, "GET", "/files", _envd_headers(boxes[0]), query=b"path=f"), 5)
        assert st == 429 and b"at most" in body
        backend.gate.set()
        assert [r[0] for r in await asyncio.gather(*tasks)] == [200] * e2bapp.MAX_TRANSFERS_PER_TENANT
        assert svc.transfers == {}
        await svc.close()

    asyncio.run(go())


# -- 1. WebSocket messages through the port proxy ------------------------------------------------

WS_SERVER = r"""
import asyncio, sys
from websockets.asyncio.server import serve

async def handler(ws):
    if ws.request.path == "/big":
        await ws.send(b"x" * (64 << 20))
        await ws.wait_closed()
        return
    async for m in ws:
        await ws.send(m)

async def main():
    async with serve(handler, "127.0.0.1", int(sys.argv[1]), max_size=None, compression=None):
        print("listening", flush=True)
        await asyncio.Future()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def ws_upstream():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-c", WS_SERVER, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        assert b"listening" in proc.stdout.readline()
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def ws_client(tmp_path, ws_upstream):
    from starlette.testclient import TestClient

    from tests.e2b.test_ports_unit import PortBackend

    f = tmp_path / "web.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: web}\nspec:\n  command: [/bin/true]\n")
    tpls.add(f, name="web", ports=[8080], home=tmp_path)
    app = e2bapp.make_app(PortBackend(ws_upstream), {"key-a": "a"}, home=tmp_path, domain="localhost:49983")
    with TestClient(app) as c:
        doc = c.post("/v2/sandboxes", json={"templateID": "web"}, headers={"X-API-Key": "key-a"}).json()
        c.headers_ws = {"Host": f"8080-{doc['sandboxID']}.localhost:49983", "X-Access-Token": doc["envdAccessToken"]}
        yield c


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_64_mib_websocket_message_from_the_sandbox_is_refused_not_reassembled(ws_client):
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    base = _rss()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        with ws_client.websocket_connect("/big", headers=ws_client.headers_ws) as ws:
            got = ws.receive()
            assert got["type"] == "websocket.close", f"relayed: {len(got.get('bytes') or b'')} bytes"
            assert got["code"] == 1009
    finally:
        stop.set()
        t.join()
    assert peak[0] - base < 40 * MiB, f"the proxy grew by {(peak[0] - base) // MiB} MiB"
    # the proxy still relays ordinary messages
    with ws_client.websocket_connect("/echo", headers=ws_client.headers_ws) as ws:
        ws.send_bytes(b"ok")
        assert ws.receive_bytes() == b"ok"


def test_a_websocket_message_over_16_mib_from_the_client_is_refused(ws_client):
    with ws_client.websocket_connect("/echo", headers=ws_client.headers_ws) as ws:
        ws.send_bytes(b"z" * (17 * MiB))
        got = ws.receive()
        assert got["type"] == "websocket.close", f"relayed: {len(got.get('bytes') or b'')} bytes"
        assert got["code"] == 1009


# -- the daemon itself: an upload does not grow its memory ----------------------------------------

@pytest.mark.integration
def test_a_60_mib_upload_to_the_daemon_served_api_is_not_held_in_its_memory(avm_home):
    """A chunked 60 MiB upload through the daemon (`up --e2b-listen`, ControlPlaneBackend: the
    daemon's copy_in stages it): it arrives whole, and the root daemon's RSS, sampled while it
    is sent, grows by less than half of it."""
    import os

    import httpx

    from tests.e2b.conftest import _cleanup, _free_port, daemon_up

    if os.geteuid() != 0:
        pytest.skip("the daemon's sandboxes need root here")
    env = daemon_up(_free_port())
    try:
        pid = int((avm_home / "run" / "daemon.pid").read_text())
        url, key = env["E2B_API_URL"], env["E2B_API_KEY"]
        doc = httpx.post(f"{url}/sandboxes", json={"templateID": "base", "timeout": 300},
                         headers={"X-API-Key": key}, timeout=120).json()
        hdrs = {"E2b-Sandbox-Id": doc["sandboxID"], "X-Access-Token": doc["envdAccessToken"]}

        def rss() -> int:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
            raise AssertionError("no VmRSS")

        base, peak, stop = rss(), [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.01)

        chunk = os.urandom(MiB)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            r = httpx.post(f"{url}/files", params={"path": "big.bin"}, headers={
                **hdrs, "Content-Type": "application/octet-stream"}, content=(chunk for _ in range(60)), timeout=300)
        finally:
            stop.set()
            t.join()
        assert r.status_code == 200, r.text
        got = httpx.get(f"{url}/files", params={"path": "big.bin"}, headers=hdrs, timeout=300).content
        assert hashlib.sha256(got).digest() == hashlib.sha256(chunk * 60).digest()
        assert peak[0] - base < 30 * MiB, f"the daemon grew by {(peak[0] - base) // MiB} MiB for a 60 MiB upload"
        # a length over the limit: answered 413 at once, with none of the body sent
        host, port = url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(f"POST /files?path=big2.bin HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: {doc['sandboxID']}\r\n"
                      f"X-Access-Token: {doc['envdAccessToken']}\r\nContent-Type: application/octet-stream\r\n"
                      f"Content-Length: {65 * MiB}\r\n\r\n".encode())
            assert c.recv(64).startswith(b"HTTP/1.1 413 ")
        httpx.delete(f"{url}/sandboxes/{doc['sandboxID']}", headers={"X-API-Key": key}, timeout=120)
    finally:
        _cleanup(avm_home)
