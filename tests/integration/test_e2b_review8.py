"""Review 8 (findings 1 and 2) on a real daemon serving the E2B API (`agentvm up --e2b-listen`),
real bubblewrap sandboxes, the real gate and a real upstream on loopback:

* 1: a tenant's envd Connect request nested 30,000 levels deep killed the root daemon (SIGSEGV in
  protobuf's native JSON parser). Now it is answered ``invalid_argument`` and the daemon, its
  E2B API and its own API go on answering.
* 2: a tenant listed ``allowOut: ["*.x.test", "a.x.test"]`` and a request its template holds for a
  human (``action: ask``) reached the upstream with no approval. Now, whatever the order, the
  request is held (pending in ``agentvm approvals list``) and the upstream never sees it, while
  a host the template plainly allows is still reached (the setup works).
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2b.conftest import run_code, served_by_daemon
from tests.helpers import agentvm_cmd, needs_root

pytestmark = [pytest.mark.integration, needs_root]


class _Upstream(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):  # noqa: N802
        _Upstream.seen.append(f"{self.headers.get('Host')}{self.path}")
        body = b"UPSTREAM-REACHED " + self.path.encode() + b"\n"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def upstream():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def server(avm_home, upstream):
    tpl = Path(avm_home) / "tplask.yaml"
    tpl.write_text(f"""\
apiVersion: agentvm/v1
kind: Agent
metadata: {{name: tplask}}
spec:
  riskTier: L3
  lifecycle: persistent
  command: [/bin/sleep, infinity]
  egress:
    hosts: {{a.x.test: 127.0.0.1, b.x.test: 127.0.0.1}}
    allow:
      - {{host: a.x.test, ports: [{upstream}], action: ask}}   # a human approves every request
      - {{host: "*.x.test", ports: [{upstream}]}}
""")
    with served_by_daemon(avm_home) as s:
        r = subprocess.run(agentvm_cmd() + ["template", "add", str(tpl), "--name", "tplask", "--tenant", "default"],
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr.decode()
        yield s


def _api(server):
    env = server["env"]
    return env["E2B_API_URL"], {"X-API-Key": env["E2B_API_KEY"]}


def test_deep_connect_json_is_refused_and_the_daemon_lives(server):
    url, h = _api(server)
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base"}, headers=h, timeout=120)
    assert r.status_code == 201, r.text
    sb = r.json()
    envd = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"],
            "Connect-Protocol-Version": "1"}
    deep = b"[" * 30000 + b"]" * 30000
    try:
        for path in ("/filesystem.Filesystem/Stat", "/process.Process/List", "/process.Process/SendSignal"):
            r = httpx.post(f"{url}{path}", content=deep, timeout=60,
                           headers={**envd, "Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (path, r.status_code, r.text[:200])
        # a streaming method: the error is in the end-of-stream envelope
        env = b"\0" + len(deep).to_bytes(4, "big") + deep
        r = httpx.post(f"{url}/process.Process/Start", content=env, timeout=60,
                       headers={**envd, "Content-Type": "application/connect+json"})
        assert b"invalid_argument" in r.content, r.content[:300]
        # the daemon is alive: its E2B API and its own API answer
        assert httpx.get(f"{url}/v2/sandboxes", headers=h, timeout=30).status_code == 200
        ps = subprocess.run(agentvm_cmd() + ["ps", "--json"], capture_output=True, timeout=60)
        assert ps.returncode == 0 and f"e2b-{sb['sandboxID']}" in ps.stdout.decode()
        r = httpx.post(f"{url}/filesystem.Filesystem/Stat", json={"path": "/"}, timeout=60,
                       headers={**envd, "Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["entry"]["type"] in ("FILE_TYPE_DIRECTORY", "directory"), r.text
    finally:
        httpx.delete(f"{url}/sandboxes/{sb['sandboxID']}", headers=h, timeout=60)


def _pending() -> str:
    r = subprocess.run(agentvm_cmd() + ["approvals", "list"], capture_output=True, timeout=60)
    return r.stdout.decode() + r.stderr.decode()


@pytest.mark.parametrize("allow_out", [["*.x.test", "a.x.test"], ["*.x.test"], ["b.x.test", "*.x.test", "a.x.test"]])
def test_allow_out_order_cannot_skip_the_templates_approval(server, upstream, allow_out):
    import time

    tag = "-".join(h.replace("*", "w") for h in allow_out)
    r = run_code(server, f"""
        import json, time
        from e2b import Sandbox
        s = Sandbox.create(template="tplask", network={{"allow_out": {allow_out!r}}})
        c = s.commands.run("curl -sS --max-time 6 http://b.x.test:{upstream}/plain-{tag}; echo rc=$?", timeout=60)
        # held for a human: left waiting in the background while the test looks at the approvals
        s.commands.run("curl -sS --max-time 60 http://a.x.test:{upstream}/needs-approval-{tag} >/tmp/a.out 2>&1",
                       background=True)
        time.sleep(2)
        print(json.dumps({{"id": s.sandbox_id, "b": c.stdout + c.stderr}}))
        """, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    url, h = _api(server)
    try:
        # the setup works: the host the template plainly allows is reached
        assert f"UPSTREAM-REACHED /plain-{tag}" in out["b"], out
        # the asked-for one is held for a human (pending), never reached
        deadline = time.monotonic() + 20
        while f"needs-approval-{tag}" not in _pending() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"needs-approval-{tag}" in _pending() and "a.x.test" in _pending(), _pending()
        assert not any(f"/needs-approval-{tag}" in x for x in _Upstream.seen), _Upstream.seen
    finally:
        httpx.delete(f"{url}/sandboxes/{out['id']}", headers=h, timeout=60)
    assert not any(f"/needs-approval-{tag}" in x for x in _Upstream.seen), _Upstream.seen
