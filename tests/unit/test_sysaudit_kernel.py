"""The syscall audit against the real kernel, without a sandbox: ``agentvm-helper init`` loads
the notify filter with a listener and hands it over; the supervisor answers; a killed
supervisor leaves the calls refused. (The real sandbox: tests/attacks/test_syscall_audit.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from agentvm import native
from agentvm import seccomp as sc
from agentvm import sysaudit

OPTS = sc.SeccompOptions(notify=True, watch=sc.DEFAULT_WATCH)

PROBE = textwrap.dedent("""
    import ctypes, errno, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def err(r):
        return "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    for i in range(int(sys.argv[1])):
        print("unshare", err(libc.unshare(0x10000000)), flush=True)
    print("memfd", err(libc.memfd_create(b"x", 0)), flush=True)
    print("userns", os.stat("/proc/self/ns/user").st_ino, flush=True)
""")


@pytest.fixture(scope="module")
def helper(tmp_path_factory):
    return str(native.helper_path(tmp_path_factory.mktemp("libexec")))


def _spawn(helper: str, child_end: int, n: int, **kw) -> subprocess.Popen:
    sfd = sc.filter_fd(OPTS)
    try:
        return subprocess.Popen(
            [helper, "init", "--no-landlock", "--seccomp-fd", str(sfd), "--sysaudit-fd", str(child_end), "--",
             sys.executable, "-c", PROBE, str(n)],
            pass_fds=(sfd, child_end), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    finally:
        os.close(sfd)
        os.close(child_end)


def _lines(out: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln.strip()]


def test_supervisor_answers_with_the_deny_lists_errno_and_records_once_per_repeat(helper):
    sup = sysaudit.supervisor()
    recs: list[dict] = []
    audit = sysaudit.SandboxAudit("kernel-test", sinks=[recs.append])
    mine, theirs = sysaudit.handoff_pair()
    p = _spawn(helper, theirs, 5)
    sup.attach(mine, audit, OPTS)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = _lines(out)
    assert [ln for ln in lines if ln[0] == "unshare"] == [["unshare", "EPERM"]] * 5, out
    assert ["memfd", "OK"] in lines, "a watched call is allowed (CONTINUE)"
    assert lines[-1][1] == str(os.stat("/proc/self/ns/user").st_ino), "no namespace was created"
    sup.flush()
    denied = [r for r in recs if r["kind"] == "syscall.denied"]
    assert len(denied) == 1, "five identical calls of one process: one record (the rest folded)"
    r = denied[0]
    assert (r["syscall"], r["rule"], r["errno"], r["args"]) == ("unshare", "seccomp:namespaces", "EPERM",
                                                               {"flags": "CLONE_NEWUSER"})
    assert r["verified"] is True
    assert r["argv"][1] == "-c" and r["argv"][-1] == "5", r["argv"]
    assert r["exe"] == os.path.realpath(sys.executable)
    assert audit.denied == 5 and audit.suppressed == 4
    watched = [r for r in recs if r["kind"] == "syscall.watched"]
    assert [w["syscall"] for w in watched] == ["memfd_create"] and watched[0]["errno"] is None


def test_helper_refuses_to_start_without_handing_the_listener_over(helper):
    """The supervisor's end closed before the handoff: init must not exec the command (its
    denials would be unrecorded); it fails its 'sysaudit' step."""
    mine, theirs = sysaudit.handoff_pair()
    mine.close()
    p = _spawn(helper, theirs, 1)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 125 and "sysaudit" in err and "unshare" not in out, (out, err)


FAKE_SUPERVISOR = textwrap.dedent("""
    import os, socket, sys, time
    s = socket.socket(fileno=int(sys.argv[1]))
    msg, anc, _, _ = s.recvmsg(1, socket.CMSG_SPACE(4))
    print("got", len(anc), flush=True)
    time.sleep(3600)   # holds the listener, never answers: a stuck supervisor
""")


def test_killed_supervisor_leaves_pending_and_later_calls_refused(helper):
    """A supervisor that holds the listener but never answers, then is SIGKILLed: the call it
    was holding and every later one fail (ENOSYS, the kernel's answer without a listener) -
    never succeed."""
    sup_end, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fake = subprocess.Popen([sys.executable, "-c", FAKE_SUPERVISOR, str(sup_end.fileno())],
                            pass_fds=(sup_end.fileno(),), stdout=subprocess.PIPE, text=True)
    sup_end.close()
    try:
        p = _spawn(helper, theirs.detach(), 3)
        assert fake.stdout.readline().split() == ["got", "1"]
        # the agent is now blocked in its first unshare, held by the stuck supervisor
        import pyseccomp

        nr = int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "unshare"))
        deadline = time.monotonic() + 30
        where = ""
        while time.monotonic() < deadline and p.poll() is None:
            try:
                where = open(f"/proc/{p.pid}/syscall").read().split()[0]
            except (OSError, IndexError):
                where = ""
            if where == str(nr):
                break
            time.sleep(0.01)
        assert where == str(nr), "the agent waits in unshare for the supervisor's answer"
        fake.send_signal(signal.SIGKILL)
        fake.wait(timeout=10)
        out, err = p.communicate(timeout=60)
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()
    assert p.returncode == 0, err
    lines = _lines(out)
    assert [ln for ln in lines if ln[0] == "unshare"] == [["unshare", "ENOSYS"]] * 3, out
    assert lines[-1][1] == str(os.stat("/proc/self/ns/user").st_ino), "no namespace was created"
    # a watched call is refused too once nobody watches (fail closed)
    assert ["memfd", "ENOSYS"] in lines
