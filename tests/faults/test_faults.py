"""Faults caused for real on this machine: a stopped daemon, a full disk under AGENTVM_HOME, a
damaged audit chain, a refusal that happens behind the daemon. Each asserts that nothing
hangs, nothing the operator was told is saved is lost, and the error names the problem with
the exit code docs/cli.md gives."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root, release_workspaces

pytestmark = [pytest.mark.integration, needs_root]


def _env(home: Path, **extra) -> dict:
    return {**os.environ, "AGENTVM_HOME": str(home), "AGENTVM_UID_BASE": os.environ["AGENTVM_UID_BASE"], **extra}


def _av(home: Path, *args: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(agentvm_cmd() + list(args), capture_output=True, env=_env(home, **env), timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def home(avm_home):
    """A home of its own (its own daemon socket and audit chain), sharing the session's uid range."""
    h = Path(f"/tmp/agentvm-fault-{secrets.token_hex(3)}")
    h.mkdir(mode=0o711)
    yield h
    _av(h, "down", timeout=60)
    release_workspaces(h)
    subprocess.run(["umount", "-l", str(h)], capture_output=True)
    subprocess.run(["rm", "-rf", str(h)])


def _agent(tmp_path: Path, name: str, body: str) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n{body}")
    return f


def test_a_workspace_that_does_not_fit_is_refused_not_overcommitted(home, tmp_path):
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0711", "tmpfs", str(home)], check=True)
    f = _agent(tmp_path, "big", "  command: [/bin/true]\n  limits: {disk: 200M}\n")
    # every backend refuses it (the default: the pool where it runs, else images): nothing left behind
    for backend in ("auto", "image"):
        r = _av(home, "run", "-f", str(f), "--json", AGENTVM_NO_DAEMON="1", AGENTVM_WORKSPACE_BACKEND=backend)
        assert r.returncode == 125, (backend, r.stdout, r.stderr)
        res = last_json(r.stdout)
        assert "needs 200M" in res["message"] and "free" in res["message"] and "overcommit" in res["message"], res
        assert not list((home / "workspaces").glob("*.img*")), ("no half-made image or pool left", backend)
    # an image (one per agent) is reserved in full on the host when it is made
    f = _agent(tmp_path, "small", "  command: [/bin/sh, -c, 'head -c 8000000 /dev/zero > /workspace/f && sync && sleep 3']\n"
                                  "  limits: {disk: 16M}\n")
    r = _av(home, "run", "-f", str(f), AGENTVM_WORKSPACE_BACKEND="image")
    assert r.returncode == 0, r.stderr
    assert (home / "workspaces" / "small.img").stat().st_blocks * 512 >= 16 * 1024**2, "the image is allocated"


def test_a_dirty_workspace_is_checked_and_the_repair_said(home, tmp_path):
    """An image workspace (ext4, e2fsck before mount); the pool's btrfs has no such check."""
    img_only = {"AGENTVM_WORKSPACE_BACKEND": "image"}
    f = _agent(tmp_path, "dirty", "  command: [/bin/sh, -c, 'echo kept > /workspace/f']\n  limits: {disk: 16M}\n")
    assert _av(home, "run", "-f", str(f), **img_only).returncode == 0
    img = home / "workspaces" / "dirty.img"
    # mark the filesystem as having errors (what a disk-full emergency_ro leaves behind)
    subprocess.run(["debugfs", "-w", "-R", "ssv state 2", str(img)], check=True, capture_output=True)
    f2 = _agent(tmp_path, "dirty", "  command: [/bin/cat, /workspace/f]\n  limits: {disk: 16M}\n")
    r = _av(home, "run", "-f", str(f2), **img_only)
    assert r.returncode == 0 and r.stdout == b"kept\n", (r.stdout, r.stderr)
    assert b"e2fsck repaired it" in r.stderr, r.stderr
    recs = [json.loads(x) for x in _av(home, "audit", "show", "--json").stdout.splitlines()]
    assert any("notes" in x["data"] for x in recs if x["kind"] == "run.started"), recs


def test_a_stopped_daemon_times_out_clearly_and_the_request_is_not_replayed(home, tmp_path):
    assert _av(home, "up").returncode == 0
    pid = int((home / "run" / "daemon.pid").read_text()) if (home / "run" / "daemon.pid").exists() else None
    if pid is None:
        pytest.fail("the daemon wrote no pid file")
    f = _agent(tmp_path, "late", "  lifecycle: persistent\n  command: [/bin/sleep, '60']\n")
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        r = _av(home, "create", "-f", str(f), AGENTVM_CLIENT_TIMEOUT="2")
        took = time.monotonic() - t
        assert r.returncode == 125 and b"did not answer within 2s" in r.stderr, r.stderr
        assert took < 30
        r = _av(home, "ps", AGENTVM_CLIENT_TIMEOUT="2")
        assert r.returncode == 125 and b"daemon.timeout" in r.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1.0)
    ps = _av(home, "ps", "--json")
    assert ps.returncode == 0 and b"late" not in ps.stdout, ps.stdout
    kinds = [json.loads(x)["kind"] for x in _av(home, "audit", "show", "--json").stdout.splitlines()]
    assert "operator.request-dropped" in kinds and "lifecycle.created" not in kinds, kinds


def test_a_refusal_through_the_daemon_is_the_embedded_refusal(home, grant_dir):
    assert _av(home, "up").returncode == 0
    embedded = _av(home, "run", "--mount", "/etc:/e:ro", "--", "true", AGENTVM_NO_DAEMON="1")
    via = _av(home, "run", "--mount", "/etc:/e:ro", "--", "true")
    assert embedded.returncode == via.returncode == 77, (embedded.stderr, via.stderr)
    assert embedded.stderr == via.stderr, (embedded.stderr, via.stderr)
    assert b"hint:" in via.stderr
    j = _av(home, "run", "--json", "--mount", "/etc:/e:ro", "--", "true")
    assert last_json(j.stdout)["error"] == "policy.grant-forbidden" and j.returncode == 77


def test_the_daemon_refuses_a_broken_audit_chain_unless_told(home):
    assert _av(home, "run", "--", "true", AGENTVM_NO_DAEMON="1").returncode == 0
    db = home / "audit" / "audit.db"
    c = sqlite3.connect(str(db))
    c.execute("UPDATE audit SET data = '{\"forged\": 1}' WHERE seq = 1")
    c.commit()
    c.close()
    v = _av(home, "audit", "verify")  # no daemon: read-only, from the file
    assert v.returncode == 77 and b"record 1 was modified" in v.stderr, (v.stdout, v.stderr)
    r = _av(home, "up", timeout=60)
    assert r.returncode == 78 and b"audit.broken-chain" in r.stderr and b"--accept-broken-chain" in r.stderr, r.stderr
    r = _av(home, "up", "--accept-broken-chain", timeout=60)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in _av(home, "audit", "show", "--json").stdout.splitlines()]
    acc = [x for x in recs if x["kind"] == "daemon.accepted-broken-chain"]
    assert acc and "record 1" in acc[0]["data"]["problem"], recs[-3:]


def test_garbage_databases_are_named_not_tracebacks(home):
    (home / "audit").mkdir(parents=True)
    (home / "audit" / "audit.db").write_bytes(os.urandom(4096))
    for args in (("audit", "verify"), ("audit", "show"), ("up",)):
        r = _av(home, *args, timeout=60)
        assert r.returncode == 78, (args, r.stdout, r.stderr)
        assert b"Traceback" not in r.stderr and b"not a readable audit chain" in r.stderr, (args, r.stderr)


def test_an_emptied_state_database_is_refused_not_recreated(home, tmp_path):
    f = _agent(tmp_path, "keeper", "  command: [/bin/sh, -c, 'echo mine > /workspace/f']\n  limits: {disk: 16M}\n")
    assert _av(home, "run", "-f", str(f), AGENTVM_NO_DAEMON="1").returncode == 0
    (home / "state.db").write_bytes(b"")
    for p in home.glob("state.db-*"):
        p.unlink()
    r = _av(home, "run", "-f", str(f), "--json", AGENTVM_NO_DAEMON="1")
    assert r.returncode == 78 and last_json(r.stdout)["error"] == "state.lost", (r.stdout, r.stderr)
    assert (home / "state.db").stat().st_size == 0, "nothing was recreated"


def test_the_operator_can_stop_remove_and_shut_down_on_a_full_disk(home, tmp_path):
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0711", "tmpfs", str(home)], check=True)
    f = _agent(tmp_path, "filler", "  lifecycle: persistent\n  command: [/bin/sleep, '300']\n  limits: {disk: 16M}\n")
    assert _av(home, "up").returncode == 0
    assert _av(home, "create", "-f", str(f), "--start").returncode == 0
    subprocess.run(["dd", "if=/dev/zero", f"of={home}/fill", "bs=1M"], capture_output=True)  # until ENOSPC
    assert os.statvfs(home).f_bavail == 0
    for args in (("stop", "filler"), ("rm", "filler")):
        r = _av(home, *args, timeout=60)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    assert _av(home, "ps", "--json").stdout.strip() in (b"", b"[]"), "removed"
    assert _av(home, "down", timeout=60).returncode == 0
    (home / "fill").unlink()
    kinds = [json.loads(x)["kind"] for x in _av(home, "audit", "show", "--json").stdout.splitlines()]
    assert "lifecycle.stopped" in kinds and "lifecycle.removed" in kinds and "daemon.stopped" in kinds, kinds
    assert _av(home, "audit", "verify").returncode == 0
    assert not list((home / "run" / "sandboxes").iterdir()), "the sandbox was torn down"


def test_exec_works_with_over_a_thousand_connections_open(home, tmp_path):
    """Descriptor numbers above 1024 (select()'s ceiling): the daemon holds 1,100 idle client
    connections, and an exec's output and exit status still come back whole."""
    import socket

    assert _av(home, "up").returncode == 0
    f = _agent(tmp_path, "busy", "  lifecycle: persistent\n  command: [/bin/sleep, '300']\n")
    assert _av(home, "create", "-f", str(f), "--start").returncode == 0
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    conns = []
    try:
        for _ in range(1100):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(home / "run" / "agentvm.sock"))
            conns.append(s)
        time.sleep(1.0)
        r = _av(home, "exec", "busy", "--", "/bin/sh", "-c", "seq 1 20000; exit 7", timeout=60)
        assert r.returncode == 7, r.stderr
        assert r.stdout.splitlines()[-1] == b"20000" and len(r.stdout.splitlines()) == 20000
    finally:
        for s in conns:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_every_refused_run_is_on_the_chain_embedded_or_through_the_daemon(home, tmp_path):
    # refused while the policy is built (the tier's ceiling), before the lifecycle's preflight
    f = _agent(tmp_path, "low-tier", "  riskTier: L0\n  command: [/bin/true]\n")
    r = _av(home, "run", "-f", str(f), "--allow", "example.org", "--json", AGENTVM_NO_DAEMON="1")
    assert r.returncode == 77 and last_json(r.stdout)["error"] == "policy.denied", (r.stdout, r.stderr)
    assert _av(home, "up").returncode == 0
    r = _av(home, "run", "-f", str(f), "--allow", "example.org", "--json")
    assert r.returncode == 77 and last_json(r.stdout)["error"] == "policy.denied", (r.stdout, r.stderr)
    runs = [json.loads(x) for x in _av(home, "runs", "--json").stdout.splitlines()]
    refused = [x for x in runs if x.get("refused") == "policy.denied"]
    assert [x["agent"] for x in refused] == ["low-tier", "low-tier"], runs
    assert b"refused: policy.denied" in _av(home, "runs").stdout


def test_up_refuses_a_lost_identity_database(home, tmp_path):
    # a named run made state.db (which host uid each agent owns); losing it must not let the
    # daemon start and fail every named start later, or start over silently
    f = _agent(tmp_path, "owner", "  command: [/bin/true]\n  limits: {disk: 16M}\n")
    assert _av(home, "run", "-f", str(f), AGENTVM_NO_DAEMON="1").returncode == 0
    (home / "state.db").unlink()
    for p in home.glob("state.db-*"):
        p.unlink()
    r = _av(home, "up")
    assert r.returncode == 78 and b"state.lost" in r.stderr, (r.stdout, r.stderr)
    assert not (home / "run" / "agentvm.sock").exists() and not (home / "state.db").exists()


def test_down_then_up_brings_back_a_running_worker_unless_no_resume(home, tmp_path):
    f = _agent(tmp_path, "resumer", "  lifecycle: persistent\n  command: [/bin/sleep, '300']\n  limits: {disk: 16M}\n")
    assert _av(home, "up").returncode == 0
    assert _av(home, "create", "-f", str(f), "--start").returncode == 0
    assert _av(home, "down").returncode == 0
    assert _av(home, "up").returncode == 0

    def state():
        return next(r for r in json.loads(_av(home, "ps", "--json").stdout) if r["name"] == "resumer")["state"]

    deadline = time.monotonic() + 20
    while state() != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state() == "running"
    assert _av(home, "down").returncode == 0
    assert _av(home, "up", "--no-resume").returncode == 0
    time.sleep(0.5)
    assert state() == "stopped"
    _av(home, "rm", "resumer")


def test_cp_copies_folders_both_ways_and_never_a_link(home, tmp_path):
    # `agentvm cp DIR NAME:PATH` died with an IsADirectoryError traceback (exit 125)
    f = _agent(tmp_path, "cpdir", "  lifecycle: persistent\n  command: [/bin/sleep, '300']\n  limits: {disk: 16M}\n")
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "README").write_text("hi\n")
    os.symlink("/etc/passwd", src / "link")  # left out (named), never followed
    assert _av(home, "up").returncode == 0
    assert _av(home, "create", "-f", str(f), "--start").returncode == 0
    r = _av(home, "cp", str(src), "cpdir:in")
    assert r.returncode == 0 and b"2 files, 1 folders" in r.stdout and b"link" in r.stdout, (r.stdout, r.stderr)
    r = _av(home, "exec", "cpdir", "--", "/bin/sh", "-c", "cd /workspace/in && find . | sort && cat pkg/mod.py")
    assert r.stdout.decode().split() == [".", "./README", "./pkg", "./pkg/mod.py", "x", "=", "1"], r.stdout
    # the agent plants a link to a host file in the folder: the copy out leaves it out
    assert _av(home, "exec", "cpdir", "--", "ln", "-s", "/etc/shadow", "/workspace/in/pkg/evil").returncode == 0
    out = tmp_path / "back"
    out.mkdir()
    r = _av(home, "cp", "cpdir:in", str(out))
    assert r.returncode == 0, r.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["in", "in/README", "in/pkg", "in/pkg/mod.py"]
    assert (out / "in/pkg/mod.py").read_text() == "x = 1\n"
    assert b"Traceback" not in r.stderr
    _av(home, "rm", "cpdir")
