"""agentvm.gate.confine: the plan (pure data) and each step on the real kernel, in child
processes (a confinement cannot be undone: never in the test's own process)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentvm.gate import confine
from agentvm.gate.confine import ConfineError

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the identity and mount steps need root")


def test_plan_never_root_and_never_the_daemons_state(tmp_path):
    with pytest.raises(ConfineError) as e:
        confine.plan(0, 0, state_dir=tmp_path / "gate", log_dir=tmp_path / "logs")
    assert e.value.step == "validate"
    p = confine.plan(3_000_000, 3_000_000, state_dir=tmp_path / "gate", log_dir=tmp_path / "logs")
    home = tmp_path.resolve()
    inside = [x for x in p.readonly if Path(x) == home or home in Path(x).parents or Path(x) in home.parents]
    assert not inside, inside
    assert p.logs == (str(home / "logs"),) and p.private == (str(home / "gate" / "ca" / "leaves"),)
    assert "/etc/shadow" not in p.readonly and "/etc" not in p.readonly and "/root" not in p.readonly
    assert "execve" in p.kill and "execve" not in p.allow and "ptrace" in p.kill and "unshare" in p.kill
    # a home inside a directory the worker must read (the interpreter's) would be in its view: refused
    with pytest.raises(ConfineError, match="state"):
        confine.plan(3_000_000, 3_000_000, state_dir=Path(sys.base_prefix) / "agentvm" / "gate",
                     log_dir=Path("/nonexistent"))


def test_gate_uids_are_per_slot_and_never_low(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTVM_GATE_UID_BASE", "5000000")
    assert [confine.gate_uid(tmp_path, i) for i in (0, 1, 1023)] == [5000000, 5000001, 5001023]
    with pytest.raises(ConfineError):
        confine.gate_uid(tmp_path, 1024)
    monkeypatch.setenv("AGENTVM_GATE_UID_BASE", "1000")
    with pytest.raises(ConfineError, match="65536"):
        confine.gate_uid(tmp_path, 0)
    monkeypatch.delenv("AGENTVM_GATE_UID_BASE")
    monkeypatch.setenv("AGENTVM_UID_BASE", "7000000")
    from agentvm.identity import AGENT_RANGE

    # the top of the installation's agent range (agents are allocated from its bottom)
    assert confine.gate_uid(tmp_path, 2) == 7000000 + AGENT_RANGE - confine.MAX_GATE_UIDS + 2


def _child(code: str, *, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)


PRELUDE = """
import os, sys, ctypes
from pathlib import Path
from agentvm.gate import confine
home = Path(sys.argv[1]) if len(sys.argv) > 1 else Path({home!r})
p = confine.plan(3_999_000, 3_999_000, state_dir=home / "gate", log_dir=home / "logs")
"""


def test_seccomp_kills_the_forbidden_and_refuses_the_unknown(tmp_path):
    (tmp_path / "logs").mkdir()
    r = _child(PRELUDE.format(home=str(tmp_path)) + """
confine.seccomp_filter(p.kill, p.allow).load()
libc = ctypes.CDLL(None, use_errno=True)
print("getpid", os.getpid() > 0, flush=True)
rc = libc.sethostname(b"x", 1)  # neither allowed nor killed: EPERM
print("sethostname", rc, ctypes.get_errno(), flush=True)
os.execv("/bin/true", ["true"])
print("survived", flush=True)
""")
    assert r.returncode == -31, (r.returncode, r.stdout, r.stderr)
    assert "getpid True" in r.stdout and "sethostname -1 1" in r.stdout and "survived" not in r.stdout


@pytest.mark.parametrize("how", ["os.fork()", "libc.syscall(57)", "libc.syscall(58)", "libc.syscall(56, 17, 0, 0, 0, 0)"])
def test_a_new_process_is_killed_threads_still_start(tmp_path, how):
    """A worker only ever starts threads: a process it made could outlive it as its slot's uid
    and meet the next agent's worker there (security review: it read the next agent's decision
    log). fork, vfork and clone without CLONE_THREAD (17: SIGCHLD, as fork does) kill it."""
    (tmp_path / "logs").mkdir()
    r = _child(PRELUDE.format(home=str(tmp_path)) + f"""
import threading
confine.seccomp_filter(p.kill, p.allow).load()
libc = ctypes.CDLL(None, use_errno=True)
t = threading.Thread(target=lambda: print("thread ran", flush=True)); t.start(); t.join()
{how}
print("survived", flush=True)
""")
    assert r.returncode == -31, (r.returncode, r.stdout, r.stderr)
    assert "thread ran" in r.stdout and "survived" not in r.stdout


def test_landlock_reads_only_the_plans_directories(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.jsonl").write_text("")
    (tmp_path / "secret").write_text("secret\n")
    r = _child(PRELUDE.format(home=str(tmp_path)) + f"""
rep = confine.confine(p, skip=("mount-namespace", "identity", "seccomp"))
print("steps", rep.steps, flush=True)
import json  # (an import after Landlock: the interpreter's directories are readable)
for path in [{str(tmp_path / "secret")!r}, "/etc/passwd", {str(tmp_path / "logs" / "mine.jsonl")!r}]:
    try:
        open(path, "a" if path.endswith(".jsonl") else "r").close()
        print("open", path, "ok", flush=True)
    except OSError as e:
        print("open", path, "refused", e.errno, flush=True)
try:
    open({str(tmp_path / "logs" / "new.jsonl")!r}, "w")
    print("create ok")
except OSError as e:
    print("create refused", e.errno)
""")
    assert r.returncode == 0, r.stderr
    assert "'no-new-privs', 'landlock'" in r.stdout
    assert f"open {tmp_path / 'secret'} refused 13" in r.stdout and "open /etc/passwd refused 13" in r.stdout
    assert f"open {tmp_path / 'logs' / 'mine.jsonl'} ok" in r.stdout, r.stdout
    assert "create refused 13" in r.stdout, "a confined worker creates no file in the log directory"


@ROOT_ONLY
def test_the_whole_confinement_as_a_worker_gets_it(tmp_path):
    os.chmod(tmp_path, 0o711)
    (tmp_path / "logs").mkdir(mode=0o711)
    (tmp_path / "state.db").write_text("state\n")
    r = _child(PRELUDE.format(home=str(tmp_path)) + f"""
rep = confine.confine(p)
print("steps", rep.steps, "abi", rep.landlock_abi, flush=True)
print("ids", os.getresuid(), os.getresgid(), os.getgroups(), confine.capabilities(), flush=True)
try:
    print("root", sorted(os.listdir("/")), flush=True)
except OSError as e:
    print("root unlisted", e.errno, flush=True)
for path in [{str(tmp_path / "state.db")!r}, "/root", "/proc/1/environ", "/etc/shadow"]:
    print("exists", path, os.path.exists(path), flush=True)
try:
    os.setuid(0)
except OSError as e:
    print("setuid", e)
""")
    assert r.returncode == -31, (r.returncode, r.stdout, r.stderr)  # (setuid is on the kill list)
    assert "steps ['mount-namespace', 'identity', 'no-new-privs', 'landlock', 'seccomp']" in r.stdout
    assert "ids (3999000, 3999000, 3999000) (3999000, 3999000, 3999000) [] (0, 0, 0)" in r.stdout
    assert "root unlisted 13" in r.stdout  # (Landlock: no listing of anything but what it reads)
    for path in (tmp_path / "state.db", "/proc/1/environ", "/etc/shadow"):
        assert f"exists {path} False" in r.stdout, r.stdout


def test_a_worker_that_cannot_confine_itself_does_not_serve(tmp_path):
    from agentvm.errors import AgentVMError
    from agentvm.gate.server import run
    from agentvm.gate.workers import WorkerPool

    pool = WorkerPool(1, tmp_path / "state", tmp_path / "logs", on_record=lambda r: None, on_event=lambda k, **d: None)
    assert pool.confine in ("full", "partial"), "confined by default"
    pool.confine_skip = ("no-such-step",)  # (the worker's confine() refuses it: validate)

    async def main():
        with pytest.raises(AgentVMError, match="did not start"):
            await asyncio.wait_for(pool.start(), 60)

    run(main())
    assert not pool.pids()


def test_a_process_with_another_thread_is_not_confined(tmp_path):
    """Landlock, no_new_privs and seccomp bind the calling thread: a thread already running
    would stay unconfined, so confine() refuses (a worker confines itself before any thread)."""
    (tmp_path / "logs").mkdir()
    r = _child(PRELUDE.format(home=str(tmp_path)) + """
import threading, time
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
try:
    confine.confine(p, skip=("mount-namespace", "identity"))
    print("confined")
except confine.ConfineError as e:
    print("refused", e.step, e)
""")
    assert "refused validate" in r.stdout and "threads" in r.stdout, (r.stdout, r.stderr)
