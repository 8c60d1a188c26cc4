"""Security review 2026-11-28, findings 2, 3 and 4, attacked on the real daemon (bubblewrap
sandboxes, the pinned `e2b` SDK, a real unprivileged local account); the adapter-level tests
are in test_review_fixes_unit.py.

* 3: a local non-root process holding far more half-sent requests than the cap: the daemon's
  descriptors stay bounded, its owner's API and an authenticated E2B call still answer, and the
  held connections are aborted at the head deadline;
* 4: tenant B's key cannot create from tenant A's template (the same 404 as a missing one);
  tenant A's can, and sees the granted folder;
* 2: an agent-filled directory (400 000 hard links): files.list and watch_dir refuse it with
  a clear error, the daemon's API answers meanwhile and its memory does not follow the
  directory; a normal directory lists and watches as before.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.e2b.conftest import _av, run_code
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

FLOOD = """\
import socket, sys, time
port, n, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
socks = []
for i in range(n):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\\r\\nHost: x\\r\\n")  # never the final CRLF
        socks.append(s)
    except OSError as e:
        print("connect-error", i, e, flush=True)
        break
print("open", len(socks), flush=True)
time.sleep(hold)
alive = 0
for s in socks:
    s.setblocking(False)
    try:
        if s.recv(1) != b"":
            alive += 1
    except BlockingIOError:
        alive += 1
    except OSError:
        pass
print("alive", alive, flush=True)
"""


def _server_pid(server) -> int:
    if server.get("proc") is not None:
        return server["proc"].pid
    return int((Path(server["home"]) / "run" / "daemon.pid").read_text().split()[0])


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _e2b_get(port: int, key: str, path: str = "/sandboxes", timeout: float = 15) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path, headers={"X-API-Key": key})
        return c.getresponse().status
    finally:
        c.close()


def _as_nobody():
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def test_a_local_users_half_open_connections_do_not_take_the_daemons_fds(e2b_server):
    from agentvm.e2b.listener import HEAD_TIMEOUT, MAX_CONNECTIONS

    port, key = e2b_server["port"], e2b_server["env"]["E2B_API_KEY"]
    pid = _server_pid(e2b_server)
    base = _fds(pid)
    script = Path(f"/tmp/e2bsec-flood-{secrets.token_hex(4)}.py")
    script.write_text(FLOOD)
    script.chmod(0o644)
    n = 3 * MAX_CONNECTIONS
    hold = HEAD_TIMEOUT + 6
    p = subprocess.Popen(["/usr/bin/python3", str(script), str(port), str(n), str(hold)], stdout=subprocess.PIPE,
                         text=True, preexec_fn=_as_nobody)
    try:
        lines = []
        while not lines or lines[-1][:1] != ["open"]:
            line = p.stdout.readline()
            assert line, lines
            lines.append(line.split())
        opened = int(lines[-1][1])
        assert opened >= 2 * MAX_CONNECTIONS, lines  # accepted (past the cap: evicted or closed, never blocked)
        peak = _fds(pid)
        # the owner's unix-socket API answers, and so does a tenant with a whole request
        r = subprocess.run([sys.executable, "-m", "agentvm", "ps", "--json"], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert _e2b_get(port, key) == 200
        peak = max(peak, _fds(pid))
        # the peer opened 2-3x the cap: the daemon holds at most the cap of them
        assert peak - base <= MAX_CONNECTIONS + 32, (base, peak)
        out, _ = p.communicate(timeout=hold + 60)
        alive = int(out.split()[-1])
        assert alive == 0, f"{alive} half-sent requests still held after {hold}s (the head deadline is {HEAD_TIMEOUT}s)"
        assert _fds(pid) - base <= 32
        assert _e2b_get(port, key) == 200
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        script.unlink()


def test_tenant_bs_key_cannot_create_from_tenant_as_template(e2b_server, tmp_path):
    port = e2b_server["port"]
    data = Path(f"/tmp/e2bsec-tenanta-{secrets.token_hex(4)}")
    data.mkdir()
    try:
        (data / "secret.txt").write_text("tenant A private report\n")
        data.chmod(0o755)
        (data / "secret.txt").chmod(0o644)
        tpl = tmp_path / "tpla.yaml"
        tpl.write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Agent
            metadata: {{name: tenanta}}
            spec:
              lifecycle: persistent
              command: [/bin/sleep, infinity]
              limits: {{disk: 64M, memory: 256M, pids: 64}}
              mounts:
                - {{host: {data}, path: /data}}
            """))
        out = _av("template", "add", str(tpl), "--name", "tenanta", "--tenant", "ta").stdout.decode()
        assert "tenant ta" in out
        key_a = _av("e2b", "key", "--tenant", "ta").stdout.decode().strip()
        key_b = _av("e2b", "key", "--tenant", "tb").stdout.decode().strip()

        def create(key, template):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/sandboxes", body=json.dumps({"templateID": template, "timeout": 120}),
                      headers={"X-API-Key": key, "Content-Type": "application/json"})
            r = c.getresponse()
            doc = json.loads(r.read())
            c.close()
            return r.status, doc

        st, doc = create(key_b, "tenanta")
        st2, doc2 = create(key_b, "nosuchtpl")
        assert st == st2 == 404
        assert doc["message"].replace("'tenanta'", "N") == doc2["message"].replace("'nosuchtpl'", "N")
        # tenant A's own key: the sandbox sees the granted folder (the same template works)
        r = run_code(e2b_server, """
            from e2b import Sandbox
            sb = Sandbox.create(template="tenanta", timeout=120)
            try:
                print("read:", sb.commands.run("cat /data/secret.txt").stdout.strip())
            finally:
                sb.kill()
            """, extra_env={"E2B_API_KEY": key_a})
        assert r.returncode == 0, r.stderr
        assert "read: tenant A private report" in r.stdout
    finally:
        subprocess.run(["rm", "-rf", str(data)])
        for f in ("tenanta.yaml", "tenanta.json"):
            (Path(e2b_server["home"]) / "templates" / f).unlink(missing_ok=True)


FILL = """
import json, os, sys, time
from e2b import Sandbox
sb = Sandbox.create(timeout=600)
out = {}
try:
    sb.files.write("/workspace/mk.py", '''
import os
os.makedirs("/tmp/d", exist_ok=True)
open("/tmp/d/a", "w").close()
for i in range(int(os.environ["N"])):
    os.link("/tmp/d/a", "/tmp/d/%06d" % i)
print("made")
''')
    r = sb.commands.run("N=400000 python3 /workspace/mk.py", timeout=300)
    out["made"] = r.stdout.strip()
    print("READY", flush=True)
    sys.stdin.readline()  # the test starts its probe
    t = time.monotonic()
    try:
        out["list"] = len(sb.files.list("/tmp/d", request_timeout=300))
    except Exception as e:
        out["list_error"] = "%s: %s" % (type(e).__name__, e)
    out["list_s"] = time.monotonic() - t
    try:
        h = sb.files.watch_dir("/tmp/d")
        h.stop()
        out["watch"] = "started"
    except Exception as e:
        out["watch_error"] = "%s: %s" % (type(e).__name__, e)
    # a normal directory: listed and watched as before
    sb.commands.run("mkdir -p /tmp/e && touch /tmp/e/1 /tmp/e/2")
    out["small"] = sorted(e.name for e in sb.files.list("/tmp/e"))
    h = sb.files.watch_dir("/tmp/e")
    sb.commands.run("touch /tmp/e/3")
    time.sleep(1.5)
    out["events"] = sorted({(ev.name, str(ev.type)) for ev in h.get_new_events()})
    h.stop()
finally:
    sb.kill()
print("RESULT", json.dumps(out), flush=True)
"""


def test_an_agent_filled_directory_is_refused_and_the_daemon_stays_responsive(e2b_server):
    import socket

    from agentvm.e2b.backend import MAX_LIST_ENTRIES

    home = Path(e2b_server["home"])
    pid = _server_pid(e2b_server)
    sock = str(home / "run" / "agentvm.sock")
    p = Path(f"/tmp/e2bsec-fill-{secrets.token_hex(4)}.py")
    p.write_text(FILL)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           **e2b_server["env"]}
    proc = subprocess.Popen([sys.executable, str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    lat: list[float] = []
    rss: list[int] = []
    stop = threading.Event()

    def probe():  # the daemon's own API (unix socket), as `agentvm` uses it
        while not stop.is_set():
            t = time.monotonic()
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(60)
            s.connect(sock)
            s.sendall(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(65536):
                pass
            s.close()
            lat.append(time.monotonic() - t)
            rss.append(_rss(pid))
            time.sleep(0.05)

    th = threading.Thread(target=probe, daemon=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line + proc.stdout.read()
        rss0 = _rss(pid)
        th.start()
        time.sleep(1)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.stdout.read()
        proc.wait(300)
    finally:
        stop.set()
        if th.is_alive():
            th.join(70)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        p.unlink()
    assert proc.returncode == 0, out
    res = json.loads(out.split("RESULT", 1)[1])
    print("list", res.get("list_error"), "in", round(res["list_s"], 2), "s; probe max %.2fs median %.3fs n=%d; "
          "RSS %d -> max %d MB" % (max(lat), sorted(lat)[len(lat) // 2], len(lat), rss0 >> 20, max(rss) >> 20))
    assert res["made"] == "made"
    assert "list" not in res and f"more than {MAX_LIST_ENTRIES} entries" in res["list_error"], res
    assert "RateLimit" not in res["list_error"]  # not a rate: the SDK must not suggest retrying
    assert "watch" not in res and f"more than {MAX_LIST_ENTRIES} entries" in res["watch_error"], res
    assert res["small"] == ["1", "2"]
    assert any(name == "3" for name, _ in res["events"]), res["events"]
    # the loop was not held by the listing (a 400 000-entry parse held it for seconds) ...
    assert max(lat) < 2.0, sorted(lat)[-5:]
    # ... and the daemon's memory did not follow the directory (it grew ~300 MB per listing)
    assert max(rss) - rss0 < 100 * 1024 * 1024, (rss0, max(rss))
