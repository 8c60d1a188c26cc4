"""Suspend of a gVisor sandbox that holds connections to its gate (issue 37).

runsc (Debian's 2022 build) cannot save a host socket, and every egress connection of a gVisor
sandbox is one (the gofer connects the bridge to the gate's unix socket and hands the Sentry
the descriptor): a checkpoint taken while one is open takes the sandbox down. A suspend must
never lose the sandbox, so it quiesces the gate endpoint (no new connection served, idle
keep-alive ones closed, requests under way given a bounded time to finish), pauses the
sandbox, counts the host sockets the Sentry holds, and checkpoints only when there are none;
otherwise it refuses (``sandbox.suspend-busy``, saying what is open) and the sandbox keeps
running - its counter goes on, the connection still works.

Real runsc, a real upstream on 127.0.0.1, real clients inside the sandbox."""

from __future__ import annotations

import http.server
import json
import subprocess
import textwrap
import threading
import time

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import av, daemon_up
from tests.integration.test_suspend import _probe, _row, needs_gvisor

pytestmark = [pytest.mark.integration, needs_root, needs_gvisor]


class Upstream:
    """HTTP/1.1 keep-alive upstream on 127.0.0.1: /fast answers at once, /slow/N after N s."""

    def __init__(self):
        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.startswith("/slow/"):
                    time.sleep(float(self.path.rsplit("/", 1)[1]))
                b = f"ok {self.path}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


# a counter served on the sandbox's own loopback (_probe), and, on request (a file in the
# workspace), a keep-alive connection to the gate held open, closed, or a slow request made
AGENT = r"""
import http.client, os, socket, threading, time
state = {"n": 0}
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8123)); srv.listen(8)
def serve():
    while True:
        c, _ = srv.accept(); c.sendall(f"{state['n']} 0 0\n".encode()); c.close()
threading.Thread(target=serve, daemon=True).start()
def out(msg):
    with open("/workspace/out", "a") as f:
        f.write(msg + "\n")
def work():
    conn = None
    while True:
        time.sleep(0.05)
        for cmd in sorted(os.listdir("/workspace/cmd")):
            os.unlink("/workspace/cmd/" + cmd)
            if cmd.endswith("hold"):
                conn = http.client.HTTPConnection("127.0.0.1", 3128, timeout=60)
                conn.request("GET", "http://up.test:PORT/fast")
                out("held " + conn.getresponse().read().decode().strip())
            elif cmd.endswith("reuse"):
                try:
                    conn.request("GET", "http://up.test:PORT/fast")
                    out("reused " + conn.getresponse().read().decode().strip())
                except Exception as e:
                    out("reuse-failed " + type(e).__name__)
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", 3128, timeout=60)
                    conn.request("GET", "http://up.test:PORT/fast")
                    out("reconnected " + conn.getresponse().read().decode().strip())
            elif cmd.endswith("close"):
                conn.close(); conn = None
                out("closed")
            elif "slow" in cmd:
                secs = cmd.split("-")[-1]
                def slow(secs=secs):
                    c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=60)
                    c.request("GET", f"http://up.test:PORT/slow/{secs}", headers={"Connection": "close"})
                    body = c.getresponse().read().decode().strip()
                    c.close()
                    out("slow-done " + body)
                threading.Thread(target=slow, daemon=True).start()
                out("slow-sent " + secs)
os.makedirs("/workspace/cmd", exist_ok=True)
threading.Thread(target=work, daemon=True).start()
while True:
    state["n"] += 1
    time.sleep(0.1)
"""


def _agent(tmp_path, name, port):
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          lifecycle: persistent
          substrate: gvisor
          command: ["python3", "-c", {json.dumps(AGENT.replace("PORT", str(port)))}]
          limits: {{disk: 16M}}
          egress:
            hosts: {{up.test: 127.0.0.1}}
            allow: [{{host: up.test, ports: [{port}]}}]
        """))
    return p


_seq = [0]


def _cmd(name: str, cmd: str, expect: str, timeout: float = 30.0) -> str:
    """Ask the agent to do ``cmd``; wait for a line of its output starting with ``expect``."""
    _seq[0] += 1
    av("exec", name, "--", "touch", f"/workspace/cmd/{_seq[0]:03d}-{cmd}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = av("exec", name, "--", "cat", "/workspace/out", check=False)
        lines = r.stdout.decode().splitlines() if r.returncode == 0 else []
        hit = [ln for ln in lines if ln.startswith(expect)]
        if hit:
            return hit[-1]
        time.sleep(0.3)
    raise AssertionError(f"{name} never wrote {expect!r}: {av('exec', name, '--', 'cat', '/workspace/out', check=False).stdout!r}")


def _out(name: str) -> list[str]:
    return av("exec", name, "--", "cat", "/workspace/out").stdout.decode().splitlines()


def test_suspend_refuses_a_held_keepalive_connection_and_keeps_the_sandbox(avm_home, tmp_path):
    up = Upstream()
    name = "sg-keep"
    with daemon_up(avm_home):
        av("create", "-f", str(_agent(tmp_path, name, up.port)), "--start")
        try:
            _probe(name)
            sid = _row(name)["sandbox_id"]
            _cmd(name, "hold", "held ok")
            # the client holds its keep-alive connection: the suspend waits (bounded) for it to be
            # closed - the daemon's own gate closes it on its side, a gate worker's leaves it open
            # - but the agent still holds its end (open, or half-open): refused
            r = av("suspend", name, check=False)
            err = r.stderr.decode()
            assert r.returncode != 0 and "sandbox.suspend-busy" in err, (r.returncode, err)
            assert "1 connection(s) to its gate" in err and "keeps running" in err, err
            assert "half-open" in err or "idle keep-alive" in err, err
            # never lost: the same sandbox runs on, its counter moving, and it can reach the gate
            row = _row(name)
            assert row["state"] == "running" and row["sandbox_id"] == sid, row
            n1 = _probe(name)[0]
            time.sleep(0.5)
            assert _probe(name)[0] > n1, "the counter stopped: the sandbox is not running"
            line = _cmd(name, "reuse", "re")  # the old connection was closed by the gate: it reconnects
            assert line.endswith("ok /fast"), line
            # the agent closes its connection: now the suspend goes through, and resume continues
            _cmd(name, "close", "closed")
            r = av("suspend", name)
            assert _row(name)["state"] == "suspended", r.stdout
            av("resume", name)
            n2 = _probe(name)[0]
            assert n2 >= n1, (n1, n2)
            _cmd(name, "hold", "held ok")  # egress works after resume
            _cmd(name, "close", "closed")
        finally:
            av("rm", name, check=False)
            up.close()


def test_suspend_drains_a_request_under_way_then_checkpoints(avm_home, tmp_path):
    up = Upstream()
    name = "sg-drain"
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent(tmp_path, name, up.port)), "--start")
        try:
            _probe(name)
            _cmd(name, "slow-3", "slow-sent")
            time.sleep(0.5)  # the request is at the upstream now
            t0 = time.monotonic()
            r = av("suspend", name)
            took = time.monotonic() - t0
            assert _row(name)["state"] == "suspended", r.stdout
            assert took >= 1.5, f"suspended in {took:.1f}s: it did not wait for the request under way"
            av("resume", name)
            # the request finished before the checkpoint: its answer reached the agent
            assert any(ln == "slow-done ok /slow/3" for ln in _out(name)), _out(name)
            recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines() if x.strip()]
            assert any(x["kind"] == "lifecycle.suspended" and x.get("sandbox") == name for x in recs)
        finally:
            av("rm", name, check=False)
            up.close()


def test_suspend_refuses_a_request_longer_than_the_drain(avm_home, tmp_path, monkeypatch):
    up = Upstream()
    name = "sg-slow"
    monkeypatch.setenv("AGENTVM_SUSPEND_DRAIN", "0")  # (the daemon's: requests under way are not waited for)
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent(tmp_path, name, up.port)), "--start")
        try:
            sid = _row(name)["sandbox_id"]
            _probe(name)
            _cmd(name, "slow-3", "slow-sent")
            r = av("suspend", name, check=False)
            err = r.stderr.decode()
            assert r.returncode != 0 and "sandbox.suspend-busy" in err, err
            assert "1 open (a request under way" in err or "request(s) under way" in err, err
            row = _row(name)
            assert row["state"] == "running" and row["sandbox_id"] == sid, row
            # the request is answered (the agent's client gets its end), and new ones are served
            _cmd(name, "noop", "slow-done", timeout=30)  # (a command the agent ignores: waits for the answer)
            _cmd(name, "hold", "held ok")
            _cmd(name, "close", "closed")
            recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines() if x.strip()]
            assert not any(x["kind"] == "lifecycle.suspended" and x.get("sandbox") == name for x in recs)
            assert any(x["kind"] == "lifecycle.suspend-refused" and x.get("sandbox") == name for x in recs), err
        finally:
            av("rm", name, check=False)
            up.close()
