"""Snapshots with memory and memory forks (issue 37), on real runsc.

gVisor: `agentvm snapshot NAME --memory` checkpoints the sandbox (its workspace read while it
is paused, at the same instant), keeps the image root-only in the snapshot (its digest part
of the snapshot's id) and resumes the agent, which runs on. `agentvm fork SNAPSHOT NEW` restores
that image (runsc restore) into a new sandbox: a Python process's counter continues in the
child from where the snapshot was taken, while the parent runs on independently (a change to
the parent's memory is not in the child). The child's credentials are fresh: a new exec gets a
new placeholder that works, while the placeholder the restored memory holds (the parent's) is
refused by the child's gate as a leak and never reaches the upstream. A memory image edited
after the snapshot is refused (``checkpoint.tampered``) and leaves no child behind.
bubblewrap: `--memory` is refused (``snapshot.memory-unsupported``: the reason, the
alternative), the agent untouched."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import av, daemon_up
from tests.integration.test_snapshot import REAL, KeyRecorder
from tests.integration.test_suspend import needs_gvisor

pytestmark = [pytest.mark.integration, needs_root]

# a counter in memory (bumped by a command on its loopback server: the parent's memory changed
# after the fork), the credential placeholder it read at start kept in memory, and a request
# made with it on demand
AGENT = r"""
import os, socket, sys, threading, time
state = {"n": 0, "key": os.environ.get("K", "")}
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8123)); srv.listen(8)
def serve():
    while True:
        c, _ = srv.accept()
        cmd = c.recv(100).decode().strip()
        if cmd == "bump":
            state["n"] += 100000
        if cmd == "use":
            sys.argv = ["probe", state["key"]]
            import io, contextlib
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    exec(open("/opt/probe/probe.py").read(), {"__name__": "__main__"})
            except Exception as e:
                buf.write("error " + type(e).__name__)
            c.sendall(buf.getvalue().encode())
        else:
            c.sendall(f"{state['n']} {state['key'] or '-'}\n".encode())
        c.close()
threading.Thread(target=serve, daemon=True).start()
with open("/workspace/started", "a") as f:
    f.write("x\n")
while True:
    state["n"] += 1
    time.sleep(0.1)
"""

ASK = ("import socket, sys; s = socket.create_connection(('127.0.0.1', 8123), timeout=30); "
       "s.sendall((sys.argv[1] + '\\n').encode()); print(s.recv(4096).decode().strip())")


def _ask(name: str, cmd: str = "get") -> str:
    for _ in range(50):
        r = av("exec", name, "--", "python3", "-c", ASK, cmd, check=False)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.decode().strip()
        time.sleep(0.2)
    raise AssertionError(f"{name}'s server never answered: {r.stdout!r} {r.stderr!r}")


def _count(name: str) -> tuple[int, str]:
    n, key = _ask(name).split()
    return int(n), key


def _row(name: str) -> dict:
    return next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == name)


def _records(kind: str) -> list[dict]:
    out = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines() if x.strip()]
    return [r for r in out if r["kind"] == kind]


def _agent_file(tmp_path: Path, name: str, substrate: str, extra: str = "") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          lifecycle: persistent
          substrate: {substrate}
          command: ["python3", "-c", {json.dumps(AGENT)}]
          limits: {{disk: 16M}}
        """) + extra)
    return p


@needs_gvisor
def test_memory_snapshot_fork_continues_with_fresh_credentials(avm_home, tmp_path):
    from tests.integration.gate_upstreams import make_test_ca

    d = Path(f"/tmp/agentvm-memsnap-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    ca, cert, key = make_test_ca(d / "ca")
    os.chmod(d / "ca", 0o755)
    up = KeyRecorder(cert, key)
    (d / "probe.py").write_text(textwrap.dedent(f"""\
        import sys, requests
        r = requests.get("https://api.test:{up.port}/x", headers={{"X-Api-Key": sys.argv[1]}}, timeout=20)
        print(r.status_code, r.headers.get("X-Agentvm-Denied"))
        """))
    extra = textwrap.indent(textwrap.dedent(f"""\
        riskTier: L3
        mounts: [{{host: {d}, path: /opt/probe}}]
        egress:
          hosts: {{api.test: 127.0.0.1}}
          upstreamCa: {ca}
          allow: [{{host: api.test, ports: [{up.port}]}}]
        credentials:
          - {{name: k, env: K, ref: "vault:m-key", hosts: [api.test], inject: {{header: X-Api-Key}}}}
        """), "  ")
    with daemon_up(avm_home) as home:
        av("secret", "set", "m-key", input=REAL.encode())
        av("create", "-f", str(_agent_file(tmp_path, "ms-p", "gvisor", extra)), "--start")
        try:
            time.sleep(3)
            n0, ph_parent = _count("ms-p")
            assert ph_parent and ph_parent != REAL
            # control: the parent's own placeholder works from its memory
            assert _ask("ms-p", "use").split()[0] == "200" and up.keys[-1] == REAL, up.keys
            sid0 = _row("ms-p")["sandbox_id"]
            out = av("snapshot", "ms-p", "--memory", "--tag", "m1").stdout.decode()
            assert "+ memory" in out, out
            snap = next(s for s in json.loads(av("snapshot", "ls", "--json").stdout) if s.get("tag") == "m1")
            assert snap["memory_digest"] and len(snap["memory_digest"]) == 64
            store = home / "snapshots" / snap["id"]
            mem = store / "memory"
            assert oct(os.stat(store).st_mode & 0o777) == "0o700" and oct(os.stat(mem).st_mode & 0o777) == "0o700"
            assert all(oct(os.stat(p).st_mode & 0o777) == "0o600" for p in mem.rglob("*") if p.is_file())
            # the parent runs on (resumed from its checkpoint: its counter continues, not restarted)
            row = _row("ms-p")
            assert row["state"] == "running" and row["sandbox_id"] != sid0, row
            n1, _ = _count("ms-p")
            assert n1 >= n0, (n0, n1)
            started = av("exec", "ms-p", "--", "cat", "/workspace/started").stdout
            assert started == b"x\n", f"the parent's process was started again: {started!r}"
            # resumed on the placeholders its processes hold: the one in its memory still swaps
            # (a resume that minted new ones sent this one out raw)
            assert _ask("ms-p", "use").split()[0] == "200" and up.keys[-1] == REAL, up.keys[-1:]
            # the parent's memory changes after the snapshot: not the child's business
            _ask("ms-p", "bump")
            # the fork: runsc restore of the image in a new sandbox
            av("fork", "ms-p:m1", "ms-c")
            c_row = _row("ms-c")
            assert c_row["state"] == "running"
            nc, ph_in_memory = _count("ms-c")
            assert n0 <= nc < 100000, f"the child's counter did not continue from the snapshot: {n0} -> {nc}"
            assert ph_in_memory == ph_parent, "the child's memory is the snapshot's"
            assert av("exec", "ms-c", "--", "cat", "/workspace/started").stdout == b"x\n"
            # independent: the parent's counter goes on from its own bumped value
            np_, _ = _count("ms-p")
            assert np_ >= 100000, np_
            time.sleep(0.5)
            nc2, _ = _count("ms-c")
            assert nc < nc2 < 100000, (nc, nc2)
            # fresh credentials: a new exec in the child gets a new placeholder, which works
            ph_child = av("exec", "ms-c", "--", "printenv", "K").stdout.decode().strip()
            assert ph_child and ph_child not in (ph_parent, REAL), (ph_child, ph_parent)
            r = av("exec", "ms-c", "--", "python3", "/opt/probe/probe.py", ph_child)
            assert r.stdout.split()[0] == b"200" and up.keys[-1] == REAL, (r.stdout, up.keys)
            # the parent's placeholder, used by the restored process from its memory: refused by
            # the child's gate as a leak, never sent upstream
            n = len(up.keys)
            ans = _ask("ms-c", "use").split()
            if ans[0] != "403" or not ans[1].startswith("credential:leak:k.parent"):
                import sqlite3

                db = sqlite3.connect(f"file:{home / 'daemon.db'}?mode=ro", uri=True)
                lineage = list(db.execute("SELECT * FROM lineage WHERE child='ms-c'"))
                db.close()
                extra_json = (store / "extra.json").read_text()
                log = (home / "daemon.log").read_text()[-3000:]
                raise AssertionError(f"{ans} {up.keys[n:]} parent={ph_parent} child={ph_child} lineage={lineage} "
                                     f"extra={extra_json} log={log}")
            assert up.keys[n:] == [], up.keys[n:]
            # the chain: a memory snapshot, a memory fork
            created = [r for r in _records("snapshot.created") if r["data"].get("snapshot") == snap["id"]]
            assert created and created[-1]["data"]["memory"] is True
            forked = _records("lifecycle.forked")[-1]["data"]
            assert forked["child"] == "ms-c" and forked["memory"] is True
            # a tampered memory image is refused, and no child is left
            img = max((p for p in mem.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            with open(img, "r+b") as f:
                f.seek(img.stat().st_size // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 1]))
            r = av("fork", snap["id"], "ms-x", check=False)
            assert r.returncode != 0 and b"checkpoint.tampered" in r.stderr, r.stderr
            assert "ms-x" not in [s["name"] for s in json.loads(av("ps", "--json").stdout)]
        finally:
            for n in ("ms-x", "ms-c", "ms-p"):
                av("rm", n, check=False)
            up.close()
            shutil.rmtree(d, ignore_errors=True)


def test_bwrap_memory_snapshot_refused(avm_home, tmp_path):
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent_file(tmp_path, "ms-b", "bwrap")), "--start")
        try:
            n0, _ = _count("ms-b")
            sid = _row("ms-b")["sandbox_id"]
            r = av("snapshot", "ms-b", "--memory", check=False)
            err = r.stderr.decode()
            assert r.returncode != 0 and "snapshot.memory-unsupported" in err, err
            assert "Landlock" in err and "agentvm snapshot ms-b" in err and "gvisor" in err, err
            row = _row("ms-b")
            assert row["state"] == "running" and row["sandbox_id"] == sid
            assert _count("ms-b")[0] >= n0
            assert not [s for s in json.loads(av("snapshot", "ls", "--json").stdout) if s["agent"] == "ms-b"]
            r = av("fork", "ms-b", "ms-bc", "--memory", check=False)
            assert r.returncode != 0 and b"snapshot.memory-unsupported" in r.stderr, r.stderr
            assert "ms-bc" not in [s["name"] for s in json.loads(av("ps", "--json").stdout)]
        finally:
            av("rm", "ms-bc", check=False)
            av("rm", "ms-b", check=False)
