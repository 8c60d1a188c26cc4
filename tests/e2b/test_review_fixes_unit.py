"""Security review 2026-11-28, findings 2, 3, 4 and 9, on the adapter's real code paths over a
fake backend (the real-daemon side is tests/e2b/test_review_fixes.py):

* 4: a template belongs to one tenant (or is public): another tenant's create gets exactly the
  answer of a template that does not exist; templates registered before tenants existed are
  public only if they grant nothing, otherwise no tenant may use them until assigned;
* 9: wrong JSON types in create (and in timeout bodies) are 400 with E2B's error shape, never
  500, and ``timeout: true`` is not one second (a small type fuzz);
* 2: a watch's state is a digest per path counted against the tenant's WATCH_BUDGET;
* 3: the listener guard caps connections (oldest half-open one evicted, beyond: closed) and
  aborts a connection without a whole head after its deadline - a real uvicorn on loopback.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentvm.e2b import app as e2bapp
from agentvm.e2b import envd
from agentvm.e2b import templates as tpls
from agentvm.e2b._gen import filesystem_pb as fpb
from agentvm.e2b.backend import Entry

GRANTING = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {{name: tenanta}}
spec:
  lifecycle: persistent
  command: [/bin/sleep, infinity]
  mounts:
    - {{host: {data}, path: /data}}
"""
PLAIN = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {name: plain}
spec:
  command: [/bin/true]
"""


class Fake:
    def __init__(self):
        self.created = []
        self.entries: list[Entry] = []

    async def create(self, name, spec_text, ttl):
        self.created.append(spec_text)

    async def kill(self, name):
        pass

    async def list_dir(self, name, path, depth):
        return list(self.entries)


def _client(tmp_path, keys=None):
    from starlette.testclient import TestClient

    backend = Fake()
    app = e2bapp.make_app(backend, keys or {"key-a": "a", "key-b": "b", "key-d": "default"}, home=tmp_path)
    return TestClient(app), backend


def _create(c, key, body):
    return c.post("/sandboxes", json=body, headers={"X-API-Key": key})


def _answer(r, name):
    """A create's answer with the template's name taken out (compared across names)."""
    return r.status_code, r.json()["message"].replace(repr(name), "NAME"), r.json()["code"]


# -- 4. templates and tenants -----------------------------------------------------------------

def test_another_tenants_template_is_answered_as_a_missing_one(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    f = tmp_path / "a.yaml"
    f.write_text(GRANTING.format(data=data))
    tpls.add(f, name="tenanta", home=tmp_path, tenant="a")
    c, backend = _client(tmp_path)
    with c:
        theirs = _create(c, "key-b", {"templateID": "tenanta"})
        missing = _create(c, "key-b", {"templateID": "nosuchtpl"})
        assert theirs.status_code == 404 and not backend.created
        assert _answer(theirs, "tenanta") == _answer(missing, "nosuchtpl")
        assert _create(c, "key-d", {"templateID": "tenanta"}).status_code == 404  # the default tenant too
        ok = _create(c, "key-a", {"templateID": "tenanta"})
        assert ok.status_code == 201, ok.text
        assert str(data) in backend.created[0]
        c.delete(f"/sandboxes/{ok.json()['sandboxID']}", headers={"X-API-Key": "key-a"})


def test_public_templates_and_the_default_owner(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    g, p = tmp_path / "g.yaml", tmp_path / "p.yaml"
    g.write_text(GRANTING.format(data=data))
    p.write_text(PLAIN)
    assert tpls.add(g, name="granting", home=tmp_path).tenant == "default"  # grants: the default tenant's
    assert tpls.add(p, name="plain", home=tmp_path).public  # grants nothing: public
    assert tpls.add(g, name="shared", home=tmp_path, public=True).public
    with pytest.raises(Exception, match="not both"):
        tpls.add(g, name="x", home=tmp_path, tenant="a", public=True)
    c, _ = _client(tmp_path)
    with c:
        assert _create(c, "key-b", {"templateID": "granting"}).status_code == 404
        for key in ("key-a", "key-b"):
            for name in ("plain", "shared", "base"):
                r = _create(c, key, {"templateID": name})
                assert r.status_code == 201, (key, name, r.text)


def test_templates_from_before_tenants_public_only_if_they_grant_nothing(tmp_path):
    """The migration: a template's .json without tenant/public (what `template add` wrote
    before) is public when it grants nothing; otherwise no tenant may use it until `template
    set` assigns it. Nothing is rewritten or lost on the way."""
    data = tmp_path / "data"
    data.mkdir()
    d = tpls.templates_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "old-grant.yaml").write_text(GRANTING.format(data=data))
    (d / "old-grant.json").write_text(json.dumps({"ports": [8080], "source": "/somewhere/a.yaml"}))
    (d / "old-plain.yaml").write_text(PLAIN)
    (d / "old-plain.json").write_text(json.dumps({"ports": [], "source": "/somewhere/p.yaml"}))
    (d / "old-nometa.yaml").write_text(GRANTING.format(data=data))  # no .json at all
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    c, backend = _client(tmp_path)
    with c:
        for key in ("key-a", "key-b", "key-d"):
            assert _create(c, key, {"templateID": "old-grant"}).status_code == 404
            assert _create(c, key, {"templateID": "old-nometa"}).status_code == 404
        assert _create(c, "key-b", {"templateID": "old-plain"}).status_code == 201
        assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # read, not rewritten
        t = tpls.assign("old-grant", tmp_path, tenant="a")
        assert t.tenant == "a" and t.ports == (8080,) and t.source == "/somewhere/a.yaml"  # kept
        assert _create(c, "key-b", {"templateID": "old-grant"}).status_code == 404
        assert _create(c, "key-a", {"templateID": "old-grant"}).status_code == 201
    rows = {t.name: t for t in tpls.ls(tmp_path)}
    assert rows["base"].public and rows["old-plain"].public and rows["old-nometa"].tenant is None
    assert not rows["old-nometa"].public


def test_template_cli_add_set_ls(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from agentvm.cli.template_cmds import template

    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path))
    data = tmp_path / "data"
    data.mkdir()
    f = tmp_path / "a.yaml"
    f.write_text(GRANTING.format(data=data))
    r = CliRunner().invoke(template, ["add", str(f), "--name", "ta", "--tenant", "a"])
    assert r.exit_code == 0 and "tenant a" in r.output, r.output
    r = CliRunner().invoke(template, ["set", "ta", "--public"])
    assert r.exit_code == 0 and "public" in r.output, r.output
    r = CliRunner().invoke(template, ["set", "ta"])
    assert r.exit_code != 0
    rows = {x["name"]: x for x in json.loads(CliRunner().invoke(template, ["ls", "--json"]).output)}
    assert rows["ta"]["public"] is True and rows["base"]["public"] is True


# -- 9. create's body types -------------------------------------------------------------------

BAD_BODIES = [
    {"metadata": [1]}, {"metadata": "x"}, {"metadata": {"a": 1}}, {"envVars": [["A", "b"]]}, {"envVars": {"A": None}},
    {"network": "x"}, {"network": [1]}, {"network": {"allowOut": [{"x": 1}]}}, {"network": {"allowOut": "a.com"}},
    {"network": {"denyOut": [1]}}, {"network": {"denyOut": {"a": 1}}}, {"timeout": True}, {"timeout": False},
    {"timeout": "30"}, {"timeout": 1.5}, {"timeout": None}, {"timeout": [30]}, {"timeout": 1e308},
    {"templateID": 5}, {"templateID": ["base"]}, {"templateID": {"a": 1}}, {"autoPause": "yes"},
    {"autoPause": 1}, {"allow_internet_access": "false"}, {"secure": []},
]


def test_wrong_types_in_create_are_400_never_500(tmp_path):
    c, backend = _client(tmp_path)
    with c:
        for body in BAD_BODIES:
            r = _create(c, "key-a", body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            doc = r.json()
            assert doc["code"] == 400 and isinstance(doc["message"], str), doc
        assert not backend.created  # nothing was made, in particular no 1 s sandbox from timeout: true
        sid = _create(c, "key-a", {}).json()["sandboxID"]
        h = {"X-API-Key": "key-a"}
        for t in (True, "5", 2.5, None, [1]):
            assert c.post(f"/sandboxes/{sid}/timeout", json={"timeout": t}, headers=h).status_code == 400
        assert c.post(f"/sandboxes/{sid}/refreshes", json={"duration": True}, headers=h).status_code == 400


def test_create_body_type_fuzz(tmp_path):
    """Random values of every JSON type in every field create reads: 201, 400, 403 or 404,
    never a 500 (the server's own exceptions would answer 500)."""
    rnd = random.Random(20261128)
    leaves = [None, True, False, 0, -1, 7, 1.5, "", "x", "base", "a.com", "0.0.0.0/0", [], {}, [1], ["a.com"],
              {"a": "b"}, {"a": 1}, [{"x": 1}], 10 ** 30]
    fields = ["templateID", "timeout", "metadata", "envVars", "network", "autoPause", "allow_internet_access",
              "secure", "volumeMounts", "mcp"]
    c, _ = _client(tmp_path, {"key-a": "a"})
    with c:
        for _ in range(300):
            body = {f: rnd.choice(leaves) for f in rnd.sample(fields, rnd.randint(1, 4))}
            if rnd.random() < 0.3:
                body["network"] = {k: rnd.choice(leaves) for k in rnd.sample(["allowOut", "denyOut"], rnd.randint(1, 2))}
            r = _create(c, "key-a", body)
            assert r.status_code in (201, 400, 403, 404), (body, r.status_code, r.text)
            assert r.status_code == 201 or r.json()["code"] == r.status_code
            if r.status_code == 201:
                c.delete(f"/sandboxes/{r.json()['sandboxID']}", headers={"X-API-Key": "key-a"})


# -- 2. watch state: a digest per path, a per-tenant budget -------------------------------------

class Ctx:
    def __init__(self, box):
        self.request_headers = {"e2b-sandbox-id": box.id, "x-access-token": box.token}


def _entries(n: int, size: int = 0) -> list[Entry]:
    return [Entry(name=f"{i:06d}", path=f"/tmp/d/{i:06d}", type="file", size=size, mode=0o644, permissions="-rw-r--r--",
                  owner="u", group="g", mtime=1.0) for i in range(n)]


def test_watchers_hold_a_digest_per_path_within_the_tenants_budget(tmp_path, monkeypatch):
    async def go():
        backend = Fake()
        app = e2bapp.make_app(backend, {"key-a": "a"}, home=tmp_path)
        svc = app.service
        boxes = [await svc.create("a", {}) for _ in range(2)]
        fs = envd.FilesystemService(svc)
        backend.entries = _entries(1000)
        cost = 1000 * (len("/tmp/d/000000") + envd.ENTRY_COST)
        monkeypatch.setattr(envd, "WATCH_BUDGET", 3 * cost)
        wid = (await fs.create_watcher(fpb.CreateWatcherRequest(path="/tmp/d"), Ctx(boxes[0]))).watcher_id
        w = boxes[0].watchers[wid]
        assert all(isinstance(v, int) for v in w["snap"].values())  # no Entry, no tuple of fields kept
        assert boxes[0].held[wid] == cost
        await fs.create_watcher(fpb.CreateWatcherRequest(path="/tmp/d"), Ctx(boxes[1]))
        stream = fs.watch_dir(fpb.WatchDirRequest(path="/tmp/d"), Ctx(boxes[1]))
        await stream.__anext__()  # the third snapshot: the budget is full now
        with pytest.raises(ConnectError) as ei:  # in another sandbox of the same tenant: refused
            await fs.create_watcher(fpb.CreateWatcherRequest(path="/tmp/d"), Ctx(boxes[0]))
        assert ei.value.code == Code.RESOURCE_EXHAUSTED and "MiB" in ei.value.message
        await stream.aclose()
        assert sum(sum(b.held.values()) for b in boxes) == 2 * cost  # the stream's share given back
        # a watcher whose directory grows past the budget is dropped with the error
        backend.entries = _entries(2500, size=1)
        with pytest.raises(ConnectError) as ei:
            await fs.get_watcher_events(fpb.GetWatcherEventsRequest(watcher_id=wid), Ctx(boxes[0]))
        assert ei.value.code == Code.RESOURCE_EXHAUSTED and wid not in boxes[0].watchers and wid not in boxes[0].held
        # events still come from digests: a write (size change) and a create
        backend.entries = _entries(10)
        wid2 = (await fs.create_watcher(fpb.CreateWatcherRequest(path="/tmp/d"), Ctx(boxes[0]))).watcher_id
        backend.entries = _entries(10)[:9] + _entries(11, size=5)[9:]
        got = (await fs.get_watcher_events(fpb.GetWatcherEventsRequest(watcher_id=wid2), Ctx(boxes[0]))).events
        assert sorted((e.name, e.type) for e in got) == [("000009", fpb.EventType.WRITE),
                                                          ("000010", fpb.EventType.CREATE)]
        await fs.remove_watcher(fpb.RemoveWatcherRequest(watcher_id=wid2), Ctx(boxes[0]))
        assert wid2 not in boxes[0].held
        await svc.close()

    asyncio.run(go())


# -- 3. the listener guard: a real uvicorn on loopback ------------------------------------------

def _serve(limit: int, head_timeout: float):
    import uvicorn

    from agentvm.e2b.listener import guarded_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    proto = guarded_protocol(limit=limit, head_timeout=head_timeout)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=proto, lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    t = threading.Thread(target=server.run, kwargs={"sockets": [s]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    return server, t, port, proto


def _get(port: int, timeout: float = 5.0) -> bytes:
    c = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := c.recv(4096):
            out += chunk
        return out
    finally:
        c.close()


def _open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_the_listener_caps_connections_and_times_out_heads():
    server, t, port, proto = _serve(limit=20, head_timeout=1.5)
    try:
        held = []
        for _ in range(60):  # three times the cap, each with half a request head
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        time.sleep(0.3)
        assert sum(_open(s) for s in held) <= 20  # never more than the cap at once
        assert b" 200 " in _get(port)  # a whole request still gets in (it takes a half-open one's place)
        assert proto.stats["evicted"] >= 40
        time.sleep(2.0)
        assert sum(_open(s) for s in held) == 0  # no whole head within the deadline: aborted
        assert proto.stats["timed_out"] >= 1
        # a trickled head (a byte at a time) meets the same deadline as a silent one
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0 and _open(s):
            s.setblocking(True)
            try:
                s.sendall(b"a")
            except OSError:
                break
            time.sleep(0.2)
        assert not _open(s) and time.monotonic() - t0 < 3.0
        for s in held:
            s.close()
        assert b" 200 " in _get(port)
    finally:
        server.should_exit = True
        t.join(10)


def test_connections_inside_a_request_are_not_evicted_and_the_rest_is_refused():
    import uvicorn

    from agentvm.e2b.listener import guarded_protocol

    release = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while not release.is_set():  # a long request (a tenant following a process's output)
            await asyncio.sleep(0.05)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    proto = guarded_protocol(limit=4, head_timeout=30)
    s0 = socket.socket()
    s0.bind(("127.0.0.1", 0))
    port = s0.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=proto, lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    th = threading.Thread(target=server.run, kwargs={"sockets": [s0]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    try:
        busy = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            busy.append(s)
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        assert not _open(extra) and proto.stats["refused"] >= 1
        assert all(_open(s) for s in busy)
        release.set()
        for s in busy:
            s.setblocking(True)
            s.settimeout(5)
            assert b" 200 " in s.recv(4096)
            s.close()
    finally:
        release.set()
        server.should_exit = True
        th.join(10)


def test_a_kept_sandbox_of_another_tenants_template_is_kept_and_reported(tmp_path):
    """A sandbox tenant B made from tenant A's template before templates had owners survives
    a restart (nothing is removed behind the operator's back) but is put on the audit log."""
    from agentvm.e2b.app import E2BService
    from agentvm.e2b.backend import BoxInfo
    from agentvm.e2b.model import Box
    from agentvm.e2b.store import E2BStore

    data = tmp_path / "data"
    data.mkdir()
    f = tmp_path / "a.yaml"
    f.write_text(GRANTING.format(data=data))
    tpls.add(f, name="tenanta", home=tmp_path, tenant="a")

    class Back:
        async def info(self, name):
            return BoxInfo(name, "running")

    now = time.time()
    st = E2BStore(tmp_path / "e2b" / "sandboxes.db")
    st.save(Box("i" + "b" * 20, "b", "tenanta", "e2b-ib", {}, {}, now, now + 600, "tok-b"))
    st.save(Box("i" + "c" * 20, "a", "tenanta", "e2b-ic", {}, {}, now, now + 600, "tok-c"))
    st.close()
    records = []
    svc = E2BService(Back(), {"key-a": "a"}, home=tmp_path, store=E2BStore(tmp_path / "e2b" / "sandboxes.db"),
                     audit=lambda kind, **d: records.append((kind, d)))
    asyncio.run(svc.load())
    assert set(svc.boxes) == {"i" + "b" * 20, "i" + "c" * 20}
    assert [(k, d["tenant"], d["template"]) for k, d in records] == [("e2b.template-not-owned", "b", "tenanta")]
    svc.store.close()
