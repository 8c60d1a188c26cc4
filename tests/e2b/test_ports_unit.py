"""The port proxy's routing, refusals and relaying over a fake backend whose "sandbox loopback"
is a real tornado server on this host's loopback (the real netns path: test_ports.py)."""

from __future__ import annotations

import shutil
import socket

import pytest

from agentvm.e2b import ports
from agentvm.e2b import templates as tpls


def test_route_of_header_and_host_forms():
    r = ports.route_of
    assert r({"e2b-sandbox-id": "iabc", "e2b-sandbox-port": "49999"}) == ("iabc", 49999)
    assert r({"e2b-sandbox-id": "iabc", "e2b-sandbox-port": "49983"}) is None  # envd's own traffic
    assert r({"e2b-sandbox-id": "iabc"}) is None
    assert r({"e2b-sandbox-id": "iabc", "e2b-sandbox-port": "80x"}) == ("iabc", -1)  # refused later, never envd
    assert r({"host": "8080-iabc.localhost:49983"}) == ("iabc", 8080)
    assert r({"host": "49983-iabc.localhost:49983"}) is None
    assert r({"host": "127.0.0.1:49983"}) is None
    assert r({"host": "localhost"}) is None
    assert r({"host": "8080-i/../x.localhost"}) is None


def test_allowed_ports_never_include_envd():
    assert ports.allowed_ports([8080, 49983, 0, 70000, 3000, 8080]) == (3000, 8080)


@pytest.mark.parametrize("sid", ["", "../x", "a/b", ".hidden", "x" * 200])
def test_no_namespace_is_opened_for_a_malformed_sandbox_id(sid):
    with pytest.raises(ports.PortUnreachable, match="not a sandbox id"):
        ports.open_sandbox_netns(sid)


def test_no_namespace_is_opened_without_the_sandboxs_cgroup():
    with pytest.raises(ports.PortUnreachable, match="no cgroup"):
        ports.open_sandbox_netns("no-such-sandbox-" + "0" * 8)


def test_a_persistent_templates_command_is_its_start_command():
    import yaml

    persistent = tpls.Template("srv", "apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: srv}\n"
                                      "spec:\n  lifecycle: persistent\n  command: [python3, /srv.py]\n")
    task = tpls.Template("task", "apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: task}\n"
                                 "spec:\n  lifecycle: ephemeral\n  command: [python3, /task.py]\n")
    s1 = yaml.safe_load(tpls.sandbox_spec(persistent, "e2b-x", tpls.CreateOptions()))["spec"]
    s2 = yaml.safe_load(tpls.sandbox_spec(task, "e2b-y", tpls.CreateOptions()))["spec"]
    assert s1["command"] == ["python3", "/srv.py"] and s1["lifecycle"] == "persistent"
    assert s2["command"] == ["/bin/sleep", "infinity"] and s2["lifecycle"] == "persistent"


# -- the proxy over a fake backend -------------------------------------------------------------

@pytest.fixture(scope="module")
def upstream():
    """test_ports.py's tornado HTTP + WebSocket echo server, run by Debian's python3 (which has
    tornado) on 127.0.0.1:<free port>: the fake sandbox's loopback."""
    import subprocess

    from tests.e2b.test_ports import SERVER

    if not shutil.which("/usr/bin/python3") or subprocess.run(["/usr/bin/python3", "-c", "import tornado"],
                                                              capture_output=True).returncode != 0:
        pytest.skip("Debian's python3-tornado is not installed (scripts/install.sh --test installs it)")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(["/usr/bin/python3", "-c", SERVER, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        assert b"listening" in proc.stdout.readline()
        yield {"port": port}
    finally:
        proc.kill()
        proc.wait()


class PortBackend:
    def __init__(self, real_port: int):
        self.real_port = real_port
        self.opened = []

    async def create(self, name, spec_text, ttl):
        pass

    async def kill(self, name):
        pass

    async def port_socket(self, name, port):
        self.opened.append((name, port))
        if port == 8081:
            raise ports.PortUnreachable("port 8081: Connection refused")
        s = socket.create_connection(("127.0.0.1", self.real_port))
        s.setblocking(False)
        return s


@pytest.fixture
def client(tmp_path, upstream):
    from starlette.testclient import TestClient

    from agentvm.e2b.app import make_app

    f = tmp_path / "web.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: web}\nspec:\n  command: [/bin/true]\n")
    tpls.add(f, name="web", ports=[8080, 8081], home=tmp_path)
    backend = PortBackend(upstream["port"])
    app = make_app(backend, {"key-a": "a", "key-b": "b"}, home=tmp_path, domain="localhost:49983")
    with TestClient(app) as c:
        c.backend = backend
        doc = c.post("/v2/sandboxes", json={"templateID": "web"}, headers={"X-API-Key": "key-a"}).json()
        c.box = doc
        yield c


def test_create_answers_the_domain_and_a_traffic_token(client):
    assert client.box["domain"] == "localhost:49983"
    assert client.box["trafficAccessToken"] and client.box["trafficAccessToken"] != client.box["envdAccessToken"]


def test_http_relayed_with_the_sandboxs_tokens_and_tokens_not_forwarded(client):
    sid = client.box["sandboxID"]
    for cred in ({"X-Access-Token": client.box["envdAccessToken"]},
                 {"E2B-Traffic-Access-Token": client.box["trafficAccessToken"]}, {"X-API-Key": "key-a"}):
        r = client.get("/a/b?c=d", headers={"Host": f"8080-{sid}.localhost:49983", **cred})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["path"] == "/a/b" and doc["query"] == "c=d" and doc["leaked"] == [], doc
    r = client.post("/up", content=b"abc" * 1000, headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080",
                                                         "X-Access-Token": client.box["envdAccessToken"]})
    assert r.status_code == 200 and r.content == b"cba" * 1000


def test_refusals_never_open_a_connection(client):
    sid = client.box["sandboxID"]
    host = f"8080-{sid}.localhost:49983"
    ghost = client.get("/", headers={"Host": "8080-ighost.localhost:49983", "X-Access-Token": "x"})
    for bad in ({}, {"X-Access-Token": "nope"}, {"X-API-Key": "key-b"}, {"E2B-Traffic-Access-Token": "nope"}):
        r = client.get("/", headers={"Host": host, **bad})
        assert r.status_code == 502 and r.text == ghost.text.replace("ighost", sid)
    r = client.get("/", headers={"Host": f"3000-{sid}.localhost:49983", "X-API-Key": "key-a"})
    assert r.status_code == 403 and "port 3000 is not open" in r.json()["message"]
    assert "template 'web'" in r.json()["message"] and "[e2b.port-refused]" in r.json()["message"]
    assert client.backend.opened == []


def test_a_port_nothing_listens_on_is_502_port_unreachable(client):
    sid = client.box["sandboxID"]
    r = client.get("/", headers={"Host": f"8081-{sid}.localhost:49983", "X-API-Key": "key-a"})
    assert r.status_code == 502 and "e2b.port-unreachable" in r.json()["message"]


def test_websocket_relayed_and_refused(client):
    from starlette.testclient import WebSocketDenialResponse

    sid = client.box["sandboxID"]
    with client.websocket_connect("/ws", headers={"Host": f"8080-{sid}.localhost:49983",
                                                  "X-Access-Token": client.box["envdAccessToken"]}) as ws:
        ws.send_text("hello")
        assert ws.receive_text() == "hello"
        ws.send_bytes(b"\x00\xff")
        assert ws.receive_bytes() == b"\x00\xff"
    with pytest.raises(WebSocketDenialResponse) as ei:
        with client.websocket_connect("/ws", headers={"Host": f"8080-{sid}.localhost:49983", "X-API-Key": "key-b"}):
            pass
    assert ei.value.status_code == 502
    with pytest.raises(WebSocketDenialResponse) as ei:
        with client.websocket_connect("/ws", headers={"Host": f"3000-{sid}.localhost:49983", "X-API-Key": "key-a"}):
            pass
    assert ei.value.status_code == 403
