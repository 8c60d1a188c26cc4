"""Headless Chromium (Debian's package) inside the sandbox, driven over the DevTools protocol
from inside: a page served from the sandbox's own loopback, and a page fetched from a host
server through the egress gate. Chromium's own sandbox cannot start under agent-vm's (it
needs nested user namespaces, which agent-vm refuses): that is pinned here too."""

from __future__ import annotations

import http.server
import shutil
import textwrap
import threading

import pytest

from tests.helpers import needs_root

pytestmark = [
    pytest.mark.integration,
    needs_root,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed "
                       "(bash scripts/install.sh --test installs it)"),
]

DRIVER = textwrap.dedent("""
    import json, os, re, subprocess, sys, threading, time, urllib.request
    import http.server, socketserver
    import websocket  # Debian's python3-websocket

    # a page served from inside the sandbox, on its own loopback
    class H(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            body = b"<html><head><title>inside-page</title></head><body>hi</body></html>"
            self.send_response(200); self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    srv = socketserver.TCPServer(("127.0.0.1", 0), H); threading.Thread(target=srv.serve_forever, daemon=True).start()

    args = ["chromium", "--headless=new", "--disable-gpu", "--remote-debugging-port=0", "--user-data-dir=/tmp/chr",
            "--no-first-run", "--proxy-server=http://127.0.0.1:3128"]  # loopback bypasses the proxy
    if os.environ.get("WITH_CHROMIUM_SANDBOX") != "1":
        args.append("--no-sandbox")
    p = subprocess.Popen(args + ["about:blank"], stderr=subprocess.PIPE, text=True)
    port = None
    t0 = time.monotonic()
    lines = []
    while time.monotonic() - t0 < 60:
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"DevTools listening on ws://127.0.0.1:(\\d+)/", line)
        if m:
            port = int(m.group(1)); break
    if port is None:
        print("NO-DEVTOOLS", p.poll(), "".join(lines)[-1500:].replace("\\n", " | "), flush=True)
        p.kill(); sys.exit(3)
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    targets = json.load(urllib.request.urlopen("http://127.0.0.1:%d/json/list" % port))
    page = next(t for t in targets if t["type"] == "page")
    ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
    n = [0]
    def call(method, **params):
        n[0] += 1; ws.send(json.dumps({"id": n[0], "method": method, "params": params}))
        while True:
            msg = json.loads(ws.recv())
            if msg.get("id") == n[0]:
                return msg
    def title_of(url):
        call("Page.enable"); call("Page.navigate", url=url)
        for _ in range(100):
            r = call("Runtime.evaluate", expression="document.readyState + '|' + document.title")
            state, _, title = r["result"]["result"]["value"].partition("|")
            if state == "complete" and title:
                return title
            time.sleep(0.1)
        return "timeout:" + state
    print("INSIDE", title_of("http://127.0.0.1:%d/" % srv.server_address[1]), flush=True)
    print("GATED", title_of(os.environ["GATED_URL"]), flush=True)
    print("DENIED", title_of("http://denied.test:%s/" % os.environ["GATED_PORT"]), flush=True)
    ws.close(); p.terminate(); p.wait(20)
    print("CHROMIUM DONE", flush=True)
""")


@pytest.fixture
def host_page():
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = b"<html><head><title>through-the-gate</title></head><body>ok</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def _agent(tmp_path, port: int):
    f = tmp_path / "browser.yaml"
    f.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: browser-test}}
        spec:
          presets: [browser]
          riskTier: L2
          workspace: {{enabled: false}}
          limits: {{timeout: 3m}}
          egress:
            hosts: {{page.test: 127.0.0.1}}
            allow: [{{host: page.test, ports: [{port}]}}]
        """))
    return f


def test_headless_chromium_driven_over_devtools_inside_the_sandbox(agentvm, tmp_path, host_page):
    f = _agent(tmp_path, host_page)
    r = agentvm("run", "-f", str(f), "--env", f"GATED_URL=http://page.test:{host_page}/", "--env",
                f"GATED_PORT={host_page}", "--json", "--", "/usr/bin/python3", "-c", DRIVER, timeout=240)
    out = r.stdout.decode(errors="replace")
    assert "CHROMIUM DONE" in out, out[-3000:] + r.stderr.decode(errors="replace")[-3000:]
    assert "INSIDE inside-page" in out, out
    assert "GATED through-the-gate" in out, out
    # the gate's 403 page for a host no rule allows (the page title is Chromium's own for an error body)
    assert "DENIED through-the-gate" not in out
    from tests.helpers import last_json

    res = last_json(out)
    denied = {d["target"].split(":")[0]: d["rule"] for d in res["egress"]["denied"]}
    assert denied.get("denied.test") == "default-deny", res["egress"]  # the gate decided it, and says so
    assert "127.0.0.1" not in denied, res["egress"]  # the inside page never went to the gate


def test_chromium_own_sandbox_cannot_start_inside_agent_vm(agentvm, tmp_path, host_page):
    """Pinned, documented behaviour: without --no-sandbox, Chromium's sandbox needs a user
    namespace (or a setuid helper), which agent-vm refuses - so it does not come up."""
    f = _agent(tmp_path, host_page)
    r = agentvm("run", "-f", str(f), "--env", "WITH_CHROMIUM_SANDBOX=1", "--env", f"GATED_URL=http://page.test:{host_page}/",
                "--env", f"GATED_PORT={host_page}", "--", "/usr/bin/python3", "-c", DRIVER, timeout=240)
    out = r.stdout.decode(errors="replace")
    assert "NO-DEVTOOLS" in out and "CHROMIUM DONE" not in out, out[-3000:]
