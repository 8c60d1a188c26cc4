"""Suspend and resume through the daemon (issue 37), on the real substrates.

gVisor: a Python process holding a counter in memory, a socket server on the sandbox's own
loopback and a file open for append is checkpointed; the host then holds no process, cgroup,
run dir or gate endpoint of it; after resume the counter continues, the server answers (probed
from inside, by exec) and the file's position is where it was. bubblewrap: suspend is refused
(``backend.suspend-unsupported``) and the sandbox keeps running; pause/unpause go through the
daemon. A tampered checkpoint is refused at resume."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import av, daemon_up

pytestmark = [pytest.mark.integration, needs_root]


def _gvisor_unavailable() -> str | None:
    from tests.contract.conftest import skip_reason

    return skip_reason("gvisor")


needs_gvisor = pytest.mark.skipif(_gvisor_unavailable() is not None, reason=str(_gvisor_unavailable()))

STATEFUL = r"""
import socket, threading, time
state = {"n": 0}
log = open("/workspace/log", "a")
tmp = open("/tmp/private", "w")
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8123))
srv.listen(8)
def serve():
    while True:
        c, _ = srv.accept()
        c.sendall(f"{state['n']} {log.tell()} {tmp.tell()}\n".encode())
        c.close()
threading.Thread(target=serve, daemon=True).start()
while True:
    state["n"] += 1
    log.write(f"{state['n']}\n"); log.flush()
    tmp.write("x"); tmp.flush()
    time.sleep(0.1)
"""

PROBE = ("import socket; s = socket.create_connection(('127.0.0.1', 8123), timeout=5); "
         "print(s.recv(100).decode().strip())")


def _agent(tmp_path: Path, name: str, substrate: str, command: list[str]) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          lifecycle: persistent
          substrate: {substrate}
          command: {json.dumps(command)}
          limits: {{disk: 16M}}
        """))
    return p


def _probe(name: str) -> tuple[int, int, int]:
    import time

    for _ in range(50):
        r = av("exec", name, "--", "python3", "-c", PROBE, check=False)
        if r.returncode == 0 and r.stdout.strip():
            n, pos, tpos = (int(x) for x in r.stdout.split())
            return n, pos, tpos
        time.sleep(0.2)
    raise AssertionError(f"the server in {name} never answered: {r.stdout!r} {r.stderr!r}")


def _row(name: str) -> dict:
    return next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == name)


def _procs_mentioning(text: str) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                if text.encode() in Path(f"/proc/{e}/cmdline").read_bytes():
                    out.append(int(e))
            except OSError:
                pass
    return out


def _audit(home: Path, kind: str) -> list[dict]:
    lines = av("audit", "show", "--json").stdout.decode().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r["kind"] == kind]


@needs_gvisor
def test_gvisor_suspend_frees_everything_and_resume_continues(avm_home, tmp_path):
    name = "susp-g"
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent(tmp_path, name, "gvisor", ["python3", "-c", STATEFUL])), "--start")
        try:
            n1, pos1, t1 = _probe(name)
            sid = _row(name)["sandbox_id"]
            r = av("suspend", name)
            assert b"suspended" in r.stdout, r.stdout
            row = _row(name)
            assert row["state"] == "suspended"
            # nothing of the sandbox is left on the host: no process, no run dir (its gate
            # socket was there), no cgroup
            assert _procs_mentioning(sid) == [], "a process of the suspended sandbox is left"
            assert not (home / "run" / "sandboxes" / sid).exists()
            assert not any(sid in str(p) for p in Path("/sys/fs/cgroup").glob("*/agentvm*/*"))
            ckpt = home / "checkpoints" / name
            assert ckpt.is_dir() and oct(os.stat(ckpt).st_mode & 0o777) == "0o700"
            rec = _audit(home, "lifecycle.suspended")[-1]["data"]
            assert len(rec["binding"]) == 64 and rec["sandbox_id"] == sid
            # the counter stops while suspended (nothing runs)
            r = av("resume", name)
            assert b"running" in r.stdout, r.stdout + r.stderr
            n2, pos2, t2 = _probe(name)
            assert n2 >= n1, f"the counter went back: {n1} -> {n2}"
            assert n2 < n1 + 200, f"the counter restarted or ran while suspended: {n1} -> {n2}"
            # the file's positions are right: the workspace log's is its size after n2 lines,
            # the private /tmp file's grew by one byte a tick (its content was in the checkpoint)
            assert pos2 == sum(len(f"{i}\n") for i in range(1, n2 + 1)), (n1, pos1, t1, n2, pos2, t2,
                                                                            av("exec", name, "--", "cat", "/workspace/log").stdout)
            assert t2 == n2, (n2, t2)
            assert _audit(home, "lifecycle.resumed"), "the resume is on the audit chain"
            assert not ckpt.exists() or not any(ckpt.iterdir()), "a spent checkpoint is dropped"
        finally:
            av("rm", name, check=False)


@needs_gvisor
def test_tampered_checkpoint_is_refused(avm_home, tmp_path):
    name = "susp-t"
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent(tmp_path, name, "gvisor", ["python3", "-c", STATEFUL])), "--start")
        try:
            _probe(name)
            av("suspend", name)
            img = next((home / "checkpoints" / name).rglob("checkpoint.img"))
            with open(img, "r+b") as f:  # one byte flipped deep in the image
                f.seek(os.path.getsize(img) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 1]))
            r = av("resume", name, check=False)
            assert r.returncode != 0 and b"checkpoint.tampered" in r.stderr + r.stdout, r.stderr
            assert _row(name)["state"] == "suspended", "a refused resume starts nothing"
            assert _audit(home, "lifecycle.resume-refused")
            av("stop", name)  # drops the checkpoint
            assert not (home / "checkpoints" / name).exists()
        finally:
            av("rm", name, check=False)


def test_bwrap_suspend_refused_pause_works(avm_home, tmp_path):
    name = "susp-b"
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent(tmp_path, name, "bwrap", ["/bin/sh", "-c",
                                                                 "i=0; while :; do i=$((i+1)); echo $i > /workspace/c; sleep 0.05; done"])),
           "--start")
        try:
            import time

            time.sleep(0.5)
            r = av("suspend", name, check=False)
            err = r.stderr.decode()
            assert r.returncode != 0 and "backend.suspend-unsupported" in err, err
            assert "agentvm pause" in err and "gvisor" in err, err
            assert _row(name)["state"] == "running", "a refused suspend leaves it running"
            assert not (home / "checkpoints" / name).exists()
            av("pause", name)
            assert _row(name)["state"] == "paused"
            a = av("exec", name, "--", "cat", "/workspace/c", check=False)  # exec wakes it (issue 37 item 2)
            c1 = int(a.stdout) if a.returncode == 0 else None
            if _row(name)["state"] == "paused":
                av("unpause", name)
            assert _row(name)["state"] == "running"
            time.sleep(0.3)
            c2 = int(av("exec", name, "--", "cat", "/workspace/c").stdout)
            assert c1 is None or c2 > c1
            av("pause", name)
            av("stop", name)  # a paused sandbox is thawed first, then stopped
            assert _row(name)["state"] == "stopped"
            assert not list((home / "run" / "sandboxes").iterdir()), "teardown left a run dir"
        finally:
            av("rm", name, check=False)


@needs_gvisor
def test_idle_suspend_then_exec_resumes_transparently_across_a_daemon_restart(avm_home, tmp_path):
    """lifecycle.idle suspends a quiet gVisor worker; the daemon goes down and up again (the
    checkpoint and its binding outlive it); an exec then resumes it transparently - the caller
    waits, the counter continues, the chain says the exec woke it."""
    import time

    name = "susp-idle"
    p = _agent(tmp_path, name, "gvisor", ["python3", "-c", STATEFUL])
    p.write_text(p.read_text().replace("lifecycle: persistent",
                                       "lifecycle: {kind: persistent, idle: {after: 2, action: suspend}}"))
    with daemon_up(avm_home) as home:
        av("create", "-f", str(p), "--start")
        try:
            n1, _, _ = _probe(name)
            deadline = time.monotonic() + 30
            while _row(name)["state"] != "suspended" and time.monotonic() < deadline:
                time.sleep(0.3)
            assert _row(name)["state"] == "suspended"
            idle = _audit(home, "lifecycle.idle")
            assert idle and idle[-1]["data"]["action"] == "suspend"
        finally:
            pass
    with daemon_up(avm_home) as home:
        try:
            assert _row(name)["state"] == "suspended", "a suspended agent stays suspended across `down`/`up`"
            n2, pos2, _ = _probe(name)  # the exec resumes it
            assert n1 <= n2 < n1 + 200, (n1, n2)
            assert pos2 == sum(len(f"{i}\n") for i in range(1, n2 + 1))
            req = _audit(home, "lifecycle.resume-requested")
            assert req and req[-1]["data"].get("woken_by") == "exec"
        finally:
            av("rm", name, check=False)
