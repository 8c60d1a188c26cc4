"""Snapshots, fork and restore through the daemon on the real substrate (issue 37): the
workspace captured content-addressed; restore rolls an agent back; fork starts a new agent from
it with its own sandbox (a new host uid) and fresh credential placeholders - the parent's
placeholder replayed from the child never becomes the real value; a tampered snapshot is
refused; parent and child are on the audit chain."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import agent, av, daemon_up

pytestmark = [pytest.mark.integration, needs_root]

REAL = "fake-real-snapshot-key-0123456789"


def _records(kind: str) -> list[dict]:
    out = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines() if x.strip()]
    return [r for r in out if r["kind"] == kind]


class KeyRecorder:
    """A TLS upstream on loopback that records the X-Api-Key each request arrived with (the
    gate scrubs the real value out of any echo, so only the upstream's side can tell)."""

    def __init__(self, cert, key) -> None:
        import http.server
        import ssl
        import threading

        self.keys: list[str | None] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.keys.append(self.headers.get("X-Api-Key"))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_snapshot_restore_fork_fresh_placeholders(avm_home, tmp_path):
    from tests.integration.gate_upstreams import make_test_ca

    d = Path(f"/tmp/agentvm-snaptest-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    ca, cert, key = make_test_ca(d / "ca")
    os.chmod(d / "ca", 0o755)
    up = KeyRecorder(cert, key)
    probe = textwrap.dedent(f"""\
        import os, sys, requests
        r = requests.get("https://api.test:{up.port}/x", headers={{"X-Api-Key": sys.argv[1]}})
        print(r.status_code, r.headers.get("X-Agentvm-Denied"))
        """)
    (d / "probe.py").write_text(probe)
    with daemon_up(avm_home) as home:
        av("secret", "set", "s-key", input=REAL.encode())
        f = agent(tmp_path, "sn-p", ["/bin/sh", "-c", "echo v1 > /workspace/state; mkdir -p /workspace/d; "
                                     "echo deep > /workspace/d/f; exec sleep 600"], extra=textwrap.dedent(f"""\
              riskTier: L3
              mounts: [{{host: {d}, path: /opt/probe}}]
              egress:
                hosts: {{api.test: 127.0.0.1}}
                upstreamCa: {ca}
                allow: [{{host: api.test, ports: [{up.port}]}}]
              credentials:
                - {{name: k, env: K, ref: "vault:s-key", hosts: [api.test], inject: {{header: X-Api-Key}}}}
            """).replace("\n", "\n  ").replace("  riskTier", "riskTier", 1))
        f.write_text(f.read_text().replace("riskTier", "  riskTier", 1))
        av("create", "-f", str(f), "--start")
        try:
            time.sleep(0.5)
            out = av("snapshot", "sn-p", "--tag", "t1").stdout.decode()
            sid = out.split()[0]
            snaps = json.loads(av("snapshot", "ls", "--json").stdout)
            snap = next(s for s in snaps if s["id"].startswith(sid))
            assert snap["agent"] == "sn-p" and snap["tag"] == "t1" and snap["files"] == 2
            assert snap["policy_digest"].startswith("sha256:") and snap["image"]
            store = home / "snapshots" / snap["id"]
            assert oct(os.stat(store).st_mode & 0o777) == "0o700"
            # roll back: change the workspace, restore t1
            av("exec", "sn-p", "--", "/bin/sh", "-c", "echo v2 > /workspace/state; echo junk > /workspace/new")
            av("restore", "sn-p", "t1")
            assert av("exec", "sn-p", "--", "cat", "/workspace/state").stdout == b"v1\n"
            assert av("exec", "sn-p", "--", "/bin/sh", "-c", "test -e /workspace/new || echo gone").stdout == b"gone\n"
            # fork: the workspace, a new sandbox, fresh placeholders
            ph_parent = av("exec", "sn-p", "--", "printenv", "K").stdout.decode().strip()
            av("fork", "sn-p:t1", "sn-c")
            assert av("exec", "sn-c", "--", "cat", "/workspace/d/f").stdout == b"deep\n"
            ph_child = av("exec", "sn-c", "--", "printenv", "K").stdout.decode().strip()
            assert ph_parent and ph_child and ph_parent != ph_child and REAL not in (ph_parent, ph_child)
            # control: the child's own placeholder becomes the real value upstream
            r = av("exec", "sn-c", "--", "python3", "/opt/probe/probe.py", ph_child)
            assert r.stdout.split()[0] == b"200" and up.keys[-1] == REAL, (r.stdout, up.keys)
            n = len(up.keys)
            # the parent's placeholder replayed from the child: refused by the child's gate as a
            # leak (the fork's gate knows its ancestors' placeholders, bound to no host), never
            # swapped for the real value, never sent upstream
            r = av("exec", "sn-c", "--", "python3", "/opt/probe/probe.py", ph_parent, check=False)
            assert up.keys[n:] == [], (up.keys[n:], r.stdout)
            assert r.stdout.split()[:2] == [b"403", b"credential:leak:k.parent"], r.stdout + r.stderr
            # and the child's own still works beside it (its credentials are its own)
            av("exec", "sn-c", "--", "python3", "/opt/probe/probe.py", ph_child)
            assert up.keys[-1] == REAL
            forked = _records("lifecycle.forked")
            assert forked and forked[-1]["data"]["parent"] == "sn-p" and forked[-1]["data"]["child"] == "sn-c"
            started = _records("lifecycle.running")
            p_uid = [r["data"]["uid"] for r in started if r.get("sandbox") == "sn-p"][-1]
            c_uid = [r["data"]["uid"] for r in started if r.get("sandbox") == "sn-c"][-1]
            assert p_uid is not None and p_uid != c_uid, "the fork runs as its own uid"
            # a tampered snapshot is refused
            tar = store / "workspace.tar"
            data = tar.read_bytes()
            tar.write_bytes(data.replace(b"v1\n", b"v9\n"))
            r = av("fork", snap["id"], "sn-x", check=False)
            assert r.returncode != 0 and b"checkpoint.tampered" in r.stderr, r.stderr
            r = av("restore", "sn-p", "t1", check=False)
            assert r.returncode != 0 and b"checkpoint.tampered" in r.stderr, r.stderr
            av("snapshot", "rm", snap["id"][:16])
            assert not store.exists()
        finally:
            for n in ("sn-c", "sn-p", "sn-x"):
                av("rm", n, check=False)
            up.close()
            shutil.rmtree(d, ignore_errors=True)


class _Page:
    """A plain HTTP server on loopback (what the agent is allowed, then denied, to reach)."""

    def __init__(self) -> None:
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "11")
                self.end_headers()
                self.wfile.write(b"secret-page")

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


PROBE = ("import urllib.request\ntry: print(urllib.request.urlopen('http://api.test:{port}/', timeout=10).read().decode())\n"
         "except Exception as e: print('refused', e)")
# forks until the pids limit stops it (children sleep, then exit): how many it got
FORKS = ("import os, time\nn = 0\nfor i in range(60):\n    try:\n        pid = os.fork()\n    except OSError:\n"
         "        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n    n += 1\nprint(n)")


def _policy(name: str) -> dict:
    return json.loads(av("policy", name, "show", "--json").stdout)


def test_fork_keeps_the_parents_live_restrictions(avm_home, tmp_path):
    """F2: a live deny and lowered limits on the parent hold for its fork (the child's row gets
    the parent's live changes): the child is refused the denied host and keeps pids 20; a fork
    of a snapshot taken under a narrower policy than the parent has now is refused, and leaves
    no agent behind."""
    page = _Page()
    probe = PROBE.format(port=page.port)
    with daemon_up(avm_home):
        f = agent(tmp_path, "fp-p", ["/bin/sh", "-c", "echo kept > /workspace/w; exec sleep 600"],
                  extra=(f"  egress:\n    hosts: {{api.test: 127.0.0.1}}\n"
                         f"    allow: [{{host: api.test, ports: [{page.port}]}}]\n"))
        av("create", "-f", str(f), "--start")
        try:
            assert av("exec", "fp-p", "--", "python3", "-c", probe).stdout.strip() == b"secret-page"
            av("policy", "fp-p", "deny", "api.test")
            av("policy", "fp-p", "limits", "--pids", "20")
            assert av("exec", "fp-p", "--", "python3", "-c", probe).stdout.startswith(b"refused")
            av("fork", "fp-p", "fp-c")
            assert av("exec", "fp-c", "--", "cat", "/workspace/w").stdout == b"kept\n"
            # the child: refused the denied host, by the gate (never reaching the page)
            out = av("exec", "fp-c", "--", "python3", "-c", probe).stdout
            assert out.startswith(b"refused") and b"secret-page" not in out, out
            pol = _policy("fp-c")
            assert pol["limits"]["pids"] == 20, pol["limits"]
            assert any("api.test" in json.dumps(r) for r in pol["rules"] if "deny" in json.dumps(r)), pol["rules"]
            # and the kernel holds it to pids 20 (its processes, not only its policy)
            n = int(av("exec", "fp-c", "--", "python3", "-c", FORKS).stdout)
            assert n < 20, f"the fork started {n} processes under a pids limit of 20"
            forked = _records("lifecycle.forked")[-1]["data"]
            assert forked["child"] == "fp-c" and forked["policy_patch"]["deny"] == ["api.test"], forked
            assert forked["policy_patch"]["limits"]["pids"] == 20, forked
            # a snapshot taken under the deny; then the parent's deny is lifted: a fork of that
            # snapshot would be wider than what the snapshot binds - refused, no child left
            av("snapshot", "fp-p", "--tag", "narrow")
            rid = next(r["id"] for r in _policy("fp-p")["rules"] if "api.test" in json.dumps(r)
                       and "deny" in json.dumps(r))
            av("policy", "fp-p", "remove", rid)
            r = av("fork", "fp-p:narrow", "fp-w", check=False)
            assert r.returncode != 0 and b"snapshot.policy-wider" in r.stderr, (r.stdout, r.stderr)
            names = [s["name"] for s in json.loads(av("ps", "--json").stdout)]
            assert "fp-w" not in names, names
            # the parent itself (the agent, not the old snapshot) still forks: its policy now
            av("fork", "fp-p", "fp-w")
            assert av("exec", "fp-w", "--", "python3", "-c", probe).stdout.strip() == b"secret-page"
        finally:
            for n in ("fp-w", "fp-c", "fp-p"):
                av("rm", n, check=False)
            page.close()
