"""sandbox.get_host(port) for real: a tornado HTTP + WebSocket echo server started inside a real
bubblewrap sandbox on its own loopback, reached through the E2B API with the real e2b SDK,
httpx, curl and the websockets client; and the attacks: no token, a wrong token, another
tenant's key or sandbox, a port the template does not list, a port only the host listens on."""

from __future__ import annotations

import http.server
import json
import secrets
import socket
import subprocess
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2b.conftest import _av, run_example
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

SERVER = textwrap.dedent("""
    import sys, tornado.ioloop, tornado.web, tornado.websocket
    SEEN = []
    class H(tornado.web.RequestHandler):
        def get(self):
            SEEN.append(self.request.path)
            h = self.request.headers
            self.write({"port": int(sys.argv[1]), "path": self.request.path, "query": self.request.query,
                        "host": self.request.host, "seen": len(SEEN),
                        "leaked": [k for k in ("X-Access-Token", "E2b-Traffic-Access-Token", "X-Api-Key") if k in h]})
        def post(self):
            SEEN.append(self.request.path)
            self.set_header("Content-Type", "application/octet-stream")
            self.write(self.request.body[::-1])
    class W(tornado.websocket.WebSocketHandler):
        def check_origin(self, origin): return True
        def select_subprotocol(self, subprotocols): return subprotocols[0] if subprotocols else None
        def on_message(self, m): self.write_message(m, binary=isinstance(m, bytes))
    for port in sys.argv[1:]:
        tornado.web.Application([(r"/ws", W), (r"/.*", H)]).listen(int(port), address="127.0.0.1")
    print("listening", sys.argv[1:], flush=True)
    tornado.ioloop.IOLoop.current().start()
""")

TEMPLATE = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {name: web}
spec:
  command: [/bin/sleep, infinity]
  limits: {disk: 64M, memory: 512M, pids: 256}
"""


CREATE = textwrap.dedent("""
    import json, os
    from e2b import Sandbox
    server = open(os.environ["SRV"]).read()
    out = {}
    for who, kw in (("sb", {}), ("other", {"api_key": os.environ["OTHER_KEY"]})):
        box = Sandbox.create(template="web", **kw)
        box.files.write("/workspace/srv.py", server)
        box.commands.run("python3 /workspace/srv.py 8080 8081", background=True)
        out[who] = {"id": box.sandbox_id, "token": box._envd_access_token, "traffic": box.traffic_access_token,
                    "hosts": {p: box.get_host(p) for p in (8080, 8081, 8082)}}
    print(json.dumps(out))
""")


class Box:
    """What the SDK gave for one sandbox (the SDK runs in a subprocess: tests/e2b shadows `e2b` here)."""

    def __init__(self, doc):
        self.sandbox_id, self._envd_access_token, self.traffic_access_token = doc["id"], doc["token"], doc["traffic"]
        self._hosts = {int(k): v for k, v in doc["hosts"].items()}

    def get_host(self, port: int) -> str:
        return self._hosts[port]


@pytest.fixture(scope="module")
def web(e2b_server):
    """A sandbox of template `web` (ports 8080, 8082) with the server listening on 8080 and 8081
    inside, made with the real SDK; and a second tenant's sandbox of the same template."""
    tag = secrets.token_hex(4)
    tpl, srv, script = (Path(f"/tmp/e2bhelper-web-{tag}.{ext}") for ext in ("yaml", "srv.py", "create.py"))
    tpl.write_text(TEMPLATE)
    srv.write_text(SERVER)
    script.write_text(CREATE)
    try:
        _av("template", "add", str(tpl), "--name", "web", "--port", "8080", "--port", "8082")
        other_key = _av("e2b", "key", "--tenant", "other").stdout.decode().strip()
        r = run_example(e2b_server, script, extra_env={"SRV": str(srv), "OTHER_KEY": other_key})
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        for p in (tpl, srv, script):
            p.unlink()
    env = e2b_server["env"]
    sb, other = Box(doc["sb"]), Box(doc["other"])
    try:
        yield {"sb": sb, "other": other, "other_key": other_key, "env": env, "server": e2b_server}
    finally:
        for box, key in ((sb, env["E2B_API_KEY"]), (other, other_key)):
            httpx.delete(f"{env['E2B_API_URL']}/sandboxes/{box.sandbox_id}", headers={"X-API-Key": key}, timeout=60)


def _get(web, host: str, path: str = "/", headers: dict | None = None, method: str = "GET", **kw) -> httpx.Response:
    """A request to the adapter's address with `Host: host` - what DNS for *.localhost gives."""
    api = web["env"]["E2B_API_URL"]
    return httpx.request(method, api + path, headers={"Host": host, **(headers or {})}, timeout=60, **kw)


def _api_port(web) -> int:
    return int(web["env"]["E2B_API_URL"].rsplit(":", 1)[1])


def test_get_host_names_the_port_and_sandbox_under_the_served_domain(web):
    sb = web["sb"]
    assert sb.get_host(8080) == f"8080-{sb.sandbox_id}.localhost:{_api_port(web)}"
    assert web["env"]["E2B_DOMAIN"] == f"localhost:{_api_port(web)}"
    assert sb.traffic_access_token and sb.traffic_access_token != sb._envd_access_token


def test_http_by_host_name_with_each_credential_the_sdk_has(web):
    sb = web["sb"]
    host = sb.get_host(8080)
    for cred in ({"E2B-Traffic-Access-Token": sb.traffic_access_token},
                 {"X-Access-Token": sb._envd_access_token},
                 {"X-API-Key": web["env"]["E2B_API_KEY"]}):
        r = _get(web, host, "/hello/there?x=1&y=2", cred)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["port"] == 8080 and doc["path"] == "/hello/there" and doc["query"] == "x=1&y=2"
        assert doc["host"] == host  # the Host the client sent, as E2B forwards it
        assert doc["leaked"] == []  # no token reaches the sandbox


def test_http_by_header_route_as_the_sdks_send_it(web):
    sb = web["sb"]
    api = web["env"]["E2B_SANDBOX_URL"]
    r = httpx.get(api + "/x", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080",
                                       "X-Access-Token": sb._envd_access_token}, timeout=60)
    assert r.status_code == 200 and r.json()["path"] == "/x", r.text


def test_a_large_post_body_and_answer_are_relayed_exactly(web):
    sb = web["sb"]
    body = secrets.token_bytes(3 << 20)
    r = _get(web, sb.get_host(8080), "/upload", {"X-Access-Token": sb._envd_access_token}, method="POST", content=body)
    assert r.status_code == 200 and r.content == body[::-1]
    # chunked (no Content-Length) too
    r = _get(web, sb.get_host(8080), "/upload", {"X-Access-Token": sb._envd_access_token}, method="POST",
             content=iter([body[:1000], body[1000:]]))
    assert r.status_code == 200 and r.content == body[::-1]


def test_curl_reaches_it_by_name(web):
    """curl resolves *.localhost to loopback itself: get_host(port) works as a URL as it is."""
    sb = web["sb"]
    r = subprocess.run(["curl", "-sS", "-m", "30", "-H", f"E2B-Traffic-Access-Token: {sb.traffic_access_token}",
                        f"http://{sb.get_host(8080)}/by-name"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and '"path": "/by-name"' in r.stdout, r.stdout + r.stderr


def test_websocket_echo_text_and_binary_through_get_host(web):
    from websockets.sync.client import connect

    sb = web["sb"]
    sock = socket.create_connection(("127.0.0.1", _api_port(web)))
    with connect(f"ws://{sb.get_host(8080)}/ws", sock=sock, subprotocols=["chat.v1"],
                 additional_headers={"E2B-Traffic-Access-Token": sb.traffic_access_token}) as ws:
        assert ws.subprotocol == "chat.v1"
        for i in range(50):
            ws.send(f"message {i}")
            assert ws.recv(timeout=30) == f"message {i}"
        blob = secrets.token_bytes(200_000)
        ws.send(blob)
        assert ws.recv(timeout=30) == blob


def test_websocket_by_header_route(web):
    from websockets.sync.client import connect

    sb = web["sb"]
    url = web["env"]["E2B_SANDBOX_URL"].replace("http://", "ws://") + "/ws"
    with connect(url, additional_headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080",
                                          "X-Access-Token": sb._envd_access_token}) as ws:
        ws.send("hi")
        assert ws.recv(timeout=30) == "hi"


# -- attacks -------------------------------------------------------------------------------------

def test_unauthenticated_and_wrongly_authenticated_requests_are_answered_as_a_missing_sandbox(web):
    sb = web["sb"]
    host = sb.get_host(8080)
    before = _get(web, host, "/", {"X-Access-Token": sb._envd_access_token}).json()["seen"]
    nobody = "i" + "0" * 20
    missing = _get(web, f"8080-{nobody}.localhost", "/", {"X-Access-Token": "x"})
    assert missing.status_code == 502
    for bad in ({}, {"X-Access-Token": "wrong"}, {"E2B-Traffic-Access-Token": "wrong"}, {"X-API-Key": "e2b_wrong"},
                {"X-Access-Token": web["other"]._envd_access_token},  # another sandbox's token
                {"E2B-Traffic-Access-Token": web["other"].traffic_access_token},
                {"X-API-Key": web["other_key"]}):  # another tenant's key
        r = _get(web, host, "/", bad)
        assert r.status_code == 502, (bad, r.text)
        assert r.text == missing.text.replace(nobody, sb.sandbox_id), (bad, r.text)  # same answer, no existence leak
    # the server in the sandbox saw none of them
    after = _get(web, host, "/", {"X-Access-Token": sb._envd_access_token}).json()["seen"]
    assert after == before + 1


def test_another_tenants_sandbox_port_is_not_reachable_with_my_key_or_tokens(web):
    other = web["other"]
    for cred in ({"X-API-Key": web["env"]["E2B_API_KEY"]}, {"X-Access-Token": web["sb"]._envd_access_token},
                 {"E2B-Traffic-Access-Token": web["sb"].traffic_access_token}):
        r = _get(web, other.get_host(8080), "/", cred)
        assert r.status_code == 502 and "was not found" in r.text, r.text
    # its owner reaches it (the refusals above were not a broken sandbox)
    r = _get(web, other.get_host(8080), "/", {"X-API-Key": web["other_key"]})
    assert r.status_code == 200, r.text


def test_websocket_without_a_token_is_refused_before_reaching_the_sandbox(web):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    sb = web["sb"]
    for headers in ({}, {"X-API-Key": web["other_key"]}):
        sock = socket.create_connection(("127.0.0.1", _api_port(web)))
        with pytest.raises(InvalidStatus) as ei:
            connect(f"ws://{sb.get_host(8080)}/ws", sock=sock, additional_headers=headers, open_timeout=30)
        assert ei.value.response.status_code == 502


def test_a_port_the_template_does_not_list_is_refused_even_with_a_server_on_it(web):
    """8081 has the same server listening inside; the template lists 8080 and 8082 only."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    sb = web["sb"]
    r = _get(web, sb.get_host(8081), "/", {"X-Access-Token": sb._envd_access_token})
    assert r.status_code == 403, r.text
    assert "port 8081 is not open" in r.text and "template 'web'" in r.text and "--port 8081" in r.text
    assert "e2b.port-refused" in r.text
    r = httpx.get(web["env"]["E2B_SANDBOX_URL"] + "/", headers={
        "E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8081", "X-Access-Token": sb._envd_access_token})
    assert r.status_code == 403
    sock = socket.create_connection(("127.0.0.1", _api_port(web)))
    with pytest.raises(InvalidStatus) as ei:
        connect(f"ws://{sb.get_host(8081)}/ws", sock=sock,
                additional_headers={"X-Access-Token": sb._envd_access_token}, open_timeout=30)
    assert ei.value.response.status_code == 403


def test_the_port_is_the_sandboxs_loopback_not_the_hosts(web):
    """A server on the HOST's 127.0.0.1:8082 (a port the template lists, nothing on it in the
    sandbox): the proxy answers 502 and the host's server gets nothing."""
    hits = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    try:
        srv = http.server.HTTPServer(("127.0.0.1", 8082), H)
    except OSError:
        pytest.skip("127.0.0.1:8082 is busy on this host")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        sb = web["sb"]
        r = _get(web, sb.get_host(8082), "/host-only", {"X-Access-Token": sb._envd_access_token})
        assert r.status_code == 502, r.text
        assert "port 8082 is not open" in r.text and "e2b.port-unreachable" in r.text
        assert hits == []
        assert httpx.get("http://127.0.0.1:8082/check").status_code == 200 and hits == ["/check"]  # it was up
    finally:
        srv.shutdown()


def test_envd_port_stays_the_envd_api(web):
    """E2b-Sandbox-Port: 49983 is the SDKs' own envd traffic: never proxied, served as before."""
    sb = web["sb"]
    r = httpx.get(web["env"]["E2B_SANDBOX_URL"] + "/health", headers={
        "E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": sb._envd_access_token})
    assert r.status_code == 204


def test_requests_are_logged_without_tokens(web):
    sb = web["sb"]
    _get(web, sb.get_host(8080), "/logged-path", {"X-Access-Token": sb._envd_access_token})
    _get(web, sb.get_host(8081), "/refused-path", {"X-Access-Token": sb._envd_access_token})
    from websockets.sync.client import connect

    with connect(f"ws://{sb.get_host(8080)}/ws", sock=socket.create_connection(("127.0.0.1", _api_port(web))),
                 additional_headers={"X-Access-Token": sb._envd_access_token}) as ws:
        ws.send("logged")
        assert ws.recv(timeout=30) == "logged"
    if web["server"].get("via") == "daemon":  # on the daemon's audit chain, the tenant as actor
        import json
        import subprocess

        from tests.helpers import agentvm_cmd

        log = subprocess.run(agentvm_cmd() + ["audit", "show", "--json"], capture_output=True, text=True).stdout
        recs = [json.loads(ln) for ln in log.splitlines() if ln.strip()]
        mine = [(r["kind"], r["data"]) for r in recs if r["sandbox"] == f"e2b-{sb.sandbox_id}"]
        assert all(r["actor"] == "e2b:default" for r in recs if r["sandbox"] == f"e2b-{sb.sandbox_id}"
                   and r["kind"].startswith("e2b.port"))
        assert any(k == "e2b.port" and d["path"] == "/logged-path" and d["status"] == 200 for k, d in mine), mine[-5:]
        assert any(k == "e2b.port.refused" and d["path"] == "/refused-path" for k, d in mine), mine[-5:]
        assert any(k == "e2b.port.websocket" for k, _ in mine)
    else:  # `agentvm e2b serve`'s log (stderr)
        log = Path(f"/tmp/e2bhelper-serve-{web['server']['port']}.log").read_text()
        mine = [ln for ln in log.splitlines() if f"e2b-{sb.sandbox_id}" in ln]
        assert any("e2b.port " in ln and "/logged-path" in ln and "'status': 200" in ln for ln in mine), mine[-5:]
        assert any("e2b.port.refused" in ln and "/refused-path" in ln for ln in mine), mine[-5:]
        assert any("e2b.port.websocket" in ln for ln in mine)
    for secret in (sb._envd_access_token, sb.traffic_access_token, web["env"]["E2B_API_KEY"], web["other_key"]):
        assert secret not in log
