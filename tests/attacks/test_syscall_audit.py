"""Syscall audit against the real sandbox (bubblewrap): escape probes are refused exactly as
by the plain deny list AND recorded; a dead supervisor leaves them refused; the selftest's
audit checks fail when the notify filter is dropped; onEscapeProbe stop/pause act on the
real sandbox."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import pytest

from _attacklib import dump, needs_root

pytestmark = [pytest.mark.attack, needs_root]

THREE = r"""
unshare -U true; echo "unshare_cli $?"
python3 - <<'EOF'
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
print("mount", r, errno.errorcode.get(ctypes.get_errno()))
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    print("raw_socket OK")
except OSError as e:
    print("raw_socket", errno.errorcode.get(e.errno))
EOF
"""


def _records(home: Path, sandbox_id: str) -> list[dict]:
    p = home / "logs" / f"{sandbox_id}.syscalls.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def test_three_probes_three_records_same_errnos_as_the_plain_deny_list(sh_json, avm_home):
    r, res = sh_json(THREE)
    assert r.returncode == 0, dump(r)
    plain, plain_res = sh_json(THREE, "--degrade", "syscall-audit")
    assert plain.returncode == 0, dump(plain)
    # the agent sees exactly what the silent deny list gives it
    body = lambda out: [ln for ln in out.splitlines() if not ln.startswith("{")]  # noqa: E731 - minus --json's line
    assert body(r.stdout) == body(plain.stdout) and len(body(r.stdout)) == 3
    assert "unshare_cli 1" in r.stdout and "mount -1 EPERM" in r.stdout and "raw_socket EPERM" in r.stdout, r.stdout
    assert "unshare: unshare failed: Operation not permitted" in r.stderr
    recs = _records(avm_home, res["sandbox_id"])
    denied = [x for x in recs if x["kind"] == "syscall.denied"]
    assert [(x["syscall"], x["rule"], x["errno"]) for x in denied] == [
        ("unshare", "seccomp:namespaces", "EPERM"), ("mount", "seccomp:mount", "EPERM"),
        ("socket", "seccomp:socket-raw", "EPERM")], recs
    assert denied[0]["argv"] == ["unshare", "-U", "true"] and denied[0]["exe"].endswith("/unshare")
    assert denied[0]["args"] == {"flags": "CLONE_NEWUSER"}
    assert denied[1]["argv"][0] == "python3" and denied[1]["args"] == {"flags": "0"}
    assert denied[2]["args"]["domain"] == "AF_INET" and denied[2]["args"]["type"].startswith("SOCK_RAW")
    assert all(x["verified"] is True and x["pid"] > 1 and x["sandbox"] == res["sandbox_id"] for x in denied)
    # the degraded run recorded nothing (and said it was degraded)
    assert _records(avm_home, plain_res["sandbox_id"]) == [] and plain_res["degraded"] == ["syscall-audit"]


# ---------------------------------------------------------------- in-process (the supervisor is ours)


@pytest.fixture
def env():
    from agentvm.selftest.framework import Env

    e = Env()
    try:
        yield e
    finally:
        e.close()


LOOP = r"""
import ctypes, errno, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
ns = os.stat("/proc/self/ns/user").st_ino
def probe():
    out = []
    r = libc.unshare(0x10000000); out.append("OK" if r == 0 else errno.errorcode.get(ctypes.get_errno()))
    r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None); out.append("OK" if r == 0 else errno.errorcode.get(ctypes.get_errno()))
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, 1).close(); out.append("OK")
    except OSError as e:
        out.append(errno.errorcode.get(e.errno))
    return out
after = 0
deadline = time.time() + 40
while time.time() < deadline:
    res = probe()
    print("probe", *res, flush=True)
    if "ENOSYS" in res:
        after += 1
        if after >= 5:
            break
    time.sleep(0.02)
print("userns_same", os.stat("/proc/self/ns/user").st_ino == ns)
# with agent-vm's listener gone, a listener of the agent's own (which would answer its own
# USER_NOTIF rules with CONTINUE) is still refused: the filter's seccomp-listener rule
import struct
allow = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7fc00000))
prog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", 1, ctypes.addressof(allow)))
libc.syscall.restype = ctypes.c_long
r = libc.syscall(ctypes.c_long(317), ctypes.c_long(1), ctypes.c_long(8), ctypes.c_long(ctypes.addressof(prog)))
print("own_listener", "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno()))
"""


def test_killing_the_supervisor_mid_run_leaves_every_probe_refused(env):
    """The supervisor's listeners are dropped while the agent is probing (what the kernel sees
    when the supervisor dies): every later probe is still refused - ENOSYS, the kernel's own
    answer without a listener - never served, and no namespace appears."""
    from agentvm import sysaudit

    logs = env.paths.home / "logs"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(o=env.sandbox(LOOP, lang="python", egress=False, timeout=60)))
    t.start()
    def recorded() -> int:
        return sum(len(p.read_text().splitlines()) for p in logs.glob("*.syscalls.jsonl"))

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and recorded() < 3:
        time.sleep(0.02)
    assert recorded() >= 3, "the supervisor recorded the first round of probes"
    assert sysaudit.supervisor().drop_all(stop_sandboxes=False), "the supervisor let go of its listeners"
    t.join(90)
    o = box["o"]
    probes = [ln.split()[1:] for ln in o.stdout.splitlines() if ln.startswith("probe ")]
    assert probes and probes[0] == ["EPERM", "EPERM", "EPERM"], o.out
    assert all(set(p) <= {"EPERM", "ENOSYS"} for p in probes), "never served: " + o.out
    assert probes[-5:] == [["ENOSYS"] * 3] * 5, "after the supervisor went away: refused with ENOSYS"
    assert "userns_same True" in o.stdout
    assert "own_listener EBUSY" in o.stdout, "no listener of the agent's own after the supervisor went: " + o.out


def test_the_supervisor_letting_go_stops_the_sandbox_first(env):
    """drop_all (the supervisor letting go of its listeners while it lives) kills the sandbox
    rather than leave it running with notify rules and no listener."""
    from agentvm import sysaudit

    logs = env.paths.home / "logs"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(o=env.sandbox(LOOP, lang="python", egress=False, timeout=60)))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(len(p.read_text().splitlines()) for p in logs.glob("*.syscalls.jsonl")) < 3:
        time.sleep(0.02)
    assert sysaudit.supervisor().drop_all(15), "the supervisor let go of its listeners"
    t.join(90)
    o = box["o"]
    assert "userns_same" not in o.stdout, "the sandbox ran on after its listener was dropped: " + o.out
    assert not any("ENOSYS" in ln for ln in o.stdout.splitlines()), o.out
    sysaudit.supervisor().flush()
    recs = [json.loads(l) for p in logs.glob("*.syscalls.jsonl") for l in p.read_text().splitlines()]
    assert [r["action"] for r in recs if r["kind"] == "syscall.audit-released"] == ["stopped"], recs


class _NoAudit:
    """The weakening ``no-syscall-audit``: the same filter, denying silently (the sandbox is
    compiled as with ``--degrade syscall-audit``)."""


def _weakened_backend(monkeypatch, **overrides):
    from agentvm.selftest import weaken

    base = weaken.WeakenedBackend

    class Backend(base):
        def compile(self, policy, ctx):
            if "no-syscall-audit" in self.weaken.split("+"):
                ctx = dataclasses.replace(ctx, degraded=tuple(sorted(set(ctx.degraded) | {"syscall-audit"})))
            return super().compile(policy, ctx)

        def required_primitives(self, policy):
            req = super().required_primitives(policy)
            if "no-syscall-audit" in self.weaken.split("+"):
                req = tuple(r for r in req if r != "syscall-audit")
            return req

        def _sysaudit(self, plan, state):
            audit = super()._sysaudit(plan, state)
            for k, v in overrides.items():
                setattr(audit, k, v)
            return audit

    monkeypatch.setattr(weaken, "WeakenedBackend", Backend)


@pytest.mark.parametrize("case_id", ["proc.escape-probes-audited", "proc.unshare-cli-audited"])
def test_selftest_audit_cases_contained_and_fail_without_the_notify_filter(monkeypatch, case_id):
    from agentvm.selftest.framework import REGISTRY, Env, all_cases, run_cases

    all_cases()
    c = REGISTRY[case_id]
    _weakened_backend(monkeypatch)
    for weaken, want in (("none", "contained"), ("no-syscall-audit", "escaped")):
        e = Env(weaken=weaken)
        try:
            [res] = run_cases([c], e)
        finally:
            e.close()
        assert res["status"] == want, (weaken, res)
        if want == "escaped":
            assert "not recorded" in res["evidence"] or "no record" in res["evidence"], res


@pytest.mark.parametrize("action", ["stop", "pause"])
def test_on_escape_probe_acts_on_the_real_sandbox(monkeypatch, action):
    """An agent that keeps probing: ``stop`` kills the sandbox, ``pause`` freezes it (its
    clock stops; the run ends at its timeout). Either way the probing does not go on."""
    from agentvm.selftest.framework import Env

    _weakened_backend(monkeypatch, on_probe=action)
    e = Env()
    try:
        script = ("import ctypes,time\nl=ctypes.CDLL(None)\nfor i in range(200):\n"
                  "    l.unshare(0x10000000 >> (i % 2))\n    print('probe', i, flush=True)\n    time.sleep(0.01)\n"
                  "print('finished')\n")
        o = e.sandbox(script, lang="python", egress=False, timeout=8)
        from agentvm import sysaudit

        sysaudit.supervisor().flush()
        recs = [json.loads(l) for p in (e.paths.home / "logs").glob("*.syscalls.jsonl")
                for l in p.read_text().splitlines()]
    finally:
        e.close()
    assert "finished" not in o.stdout, "the probing agent was not let run to its end"
    acted = [r for r in recs if r["kind"] == f"syscall.probe-{'stopped' if action == 'stop' else 'paused'}"]
    assert len(acted) == 1 and acted[0]["ok"] is True and acted[0]["alert"] is True, recs
    probes = [ln for ln in o.stdout.splitlines() if ln.startswith("probe ")]
    assert len(probes) < 50, f"{len(probes)} probes ran after the threshold of {3}"
    if action == "pause":
        assert o.result.get("timed_out") or o.exit_code == 124, o.result


def test_an_exec_into_a_running_sandbox_is_audited_too(avm_home):
    """`exec` (the daemon's way in) loads the same notify filter in its own init: its probes are
    refused with EPERM and recorded under the sandbox, next to the first process's."""
    from agentvm import sysaudit
    from tests.contract.conftest import Substrate

    sub = Substrate("bwrap", avm_home)
    try:
        lc, s = sub.start(["/bin/sh", "-c", "unshare -n true; sleep 60"])
        try:
            es, out = sub.exec(s, ["/bin/sh", "-c", "unshare -U true; echo rc=$?; cat /proc/self/status | grep ^Seccomp"],
                               timeout=30)
            assert es.exit_code == 0 and "rc=1" in out and "Operation not permitted" in out, (es, out)
        finally:
            lc.stop(s, 1.0)
            lc.teardown(s)
        sysaudit.supervisor().flush()
        recs = _records(avm_home, s.handle.sandbox_id)
        got = sorted((r["argv"][:2], r["args"]["flags"], r["errno"]) for r in recs if r["kind"] == "syscall.denied")
        assert got == [(["unshare", "-U"], "CLONE_NEWUSER", "EPERM"), (["unshare", "-n"], "CLONE_NEWNET", "EPERM")], recs
    finally:
        sub.close()


# the one seccomp case whose refusal is not a notification: a non-native ABI call (i386
# int 0x80) hits the filter's bad-arch action, which kills the process (SIGSYS) - the kernel
# reports it by the process's death, the supervisor never sees it (docs/syscall-audit.md)
NOT_NOTIFIED = {"proc.int80-32bit-abi": "non-native ABI: killed by the bad-arch action, not notified",
                # seccomp(NEW_LISTENER) is refused by an ERRNO in the BPF (it must outrank any
                # USER_NOTIF); its flood is of socket() calls, recorded, but the refusal the case
                # is about is not a notification
                "proc.own-seccomp-listener": "seccomp-listener: an errno in the BPF, never notified"}


def _seccomp_cases():
    from agentvm.selftest.framework import all_cases

    return [c for c in all_cases() if "no-seccomp" in c.weakened_by.split("+") and c.id not in NOT_NOTIFIED]


def _denied_records(home: Path) -> int:
    n = 0
    for p in (home / "logs").glob("*.syscalls.jsonl"):
        n += sum(1 for l in p.read_text().splitlines() if '"syscall.denied"' in l)
    return n


@pytest.mark.parametrize("weaken", ["none", "no-syscall-audit"])
def test_every_selftest_case_attempting_a_denied_syscall_leaves_a_record(monkeypatch, weaken):
    """Each selftest case that attacks the seccomp deny list (weakened_by no-seccomp) is still
    contained AND its refused calls left syscall records; without the notify filter the same
    cases stay contained but leave none - so this check fails when the audit is dropped."""
    from agentvm import sysaudit
    from agentvm.selftest.framework import Env, run_cases

    _weakened_backend(monkeypatch)
    cases = _seccomp_cases()
    assert len(cases) >= 10
    e = Env(weaken=weaken)
    unrecorded, results = [], []
    try:
        for c in cases:
            before = _denied_records(e.paths.home)
            [res] = run_cases([c], e)
            sysaudit.supervisor().flush()
            results.append(res)
            if _denied_records(e.paths.home) == before:
                unrecorded.append(c.id)
    finally:
        e.close()
    assert all(r["status"] == "contained" for r in results), [(r["id"], r["status"], r["evidence"]) for r in results
                                                              if r["status"] != "contained"]
    if weaken == "none":
        assert unrecorded == [], f"refused without a record: {unrecorded}"
    else:
        assert sorted(unrecorded) == sorted(c.id for c in cases), "without the notify filter nothing is recorded"


FLOODER = r"""
import ctypes, errno, json, threading, time
libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
stop = time.monotonic() + %(secs)s
got, counts = set(), []
def flood(base):
    i = 0
    while time.monotonic() < stop:  # distinct calls (a new protocol each: no folding)
        r = libc.syscall(ctypes.c_long(41), ctypes.c_long(16), ctypes.c_long(3), ctypes.c_long(1000 + base + i))
        got.add("OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
        i += 1
    counts.append(i)
ts = [threading.Thread(target=flood, args=(k * 10_000_000,)) for k in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print("FLOOD " + json.dumps({"calls": sum(counts), "got": sorted(got)}), flush=True)
"""

PROMPT = r"""
import ctypes, errno, time
libc = ctypes.CDLL(None, use_errno=True)
t = time.monotonic(); r = libc.unshare(0x10000000); e = ctypes.get_errno()
print("PROMPT", r, errno.errorcode.get(e, "?"), round(time.monotonic() - t, 3), flush=True)
"""


def _cpu_seconds(tid: int) -> float:
    f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_flooding_sandbox_is_throttled_alone_and_its_records_are_capped(env):
    """A sandbox making as many distinct denied calls as it can (4 threads) on the answering
    thread every sandbox shares: each of its calls is still refused (EPERM: answered, never
    the listener-less ENOSYS), but past its budget its listener waits for the next second, so
    the answering thread's CPU stays a fraction of one core; another sandbox's denied call is
    answered at once meanwhile; and the flooder's records are capped per minute, the rest
    counted in one summary record."""
    from agentvm import sysaudit

    sup = sysaudit.supervisor()
    logs = env.paths.home / "logs"
    box: dict = {}
    flooder = threading.Thread(target=lambda: box.update(a=env.sandbox(FLOODER % {"secs": 12}, lang="python",
                                                                       egress=False, timeout=90)))
    flooder.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(p.stat().st_size > 10_000 for p in logs.glob("*.syscalls.jsonl")):
            time.sleep(0.05)
        assert any(p.stat().st_size > 10_000 for p in logs.glob("*.syscalls.jsonl")), "the flood was recorded"
        tid = sup._answer.native_id
        c0, t0 = _cpu_seconds(tid), time.monotonic()
        box["b"] = env.sandbox(PROMPT, lang="python", egress=False, timeout=60)  # meanwhile, another sandbox
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        share = (_cpu_seconds(tid) - c0) / (time.monotonic() - t0)
        print(f"answering thread: {share:.1%} of a core while flooded")
        flood_alive = flooder.is_alive()
    finally:
        flooder.join(120)
    a, b = box["a"], box["b"]
    assert flood_alive, "the window was measured while the flood ran"
    [line] = [ln for ln in a.stdout.splitlines() if ln.startswith("FLOOD ")]
    fl = json.loads(line[6:])
    assert fl["got"] == ["EPERM"], f"every flooded call refused with its errno: {fl}"
    assert share < 0.2, f"the answering thread spent {share:.0%} of a core on one flooding sandbox"
    [prompt] = [ln.split() for ln in b.stdout.splitlines() if ln.startswith("PROMPT ")]
    assert prompt[1:3] == ["-1", "EPERM"] and float(prompt[3]) < 2.0, b.out
    # records: at most RECORDS_PER_MIN a minute, every other call counted in a summary
    deadline = time.monotonic() + 15
    recs: list[dict] = []
    while time.monotonic() < deadline:
        sup.flush()
        recs = [json.loads(l) for p in logs.glob("*.syscalls.jsonl") for l in p.read_text().splitlines()]
        if any(r["kind"] == "syscall.audit-capped" for r in recs):
            break
        time.sleep(0.2)
    mine = [r for r in recs if r.get("syscall") == "socket" or r["kind"] == "syscall.audit-capped"]
    denied = [r for r in mine if r["kind"] == "syscall.denied"]
    capped = [r for r in mine if r["kind"] == "syscall.audit-capped"]
    assert capped, "one summary record for what the cap left unrecorded"
    assert len(denied) + len([r for r in mine if r["kind"] == "syscall.audit-flood"]) <= sysaudit.RECORDS_PER_MIN, \
        len(denied)
    assert len(denied) + sum(r["suppressed"] for r in capped) == fl["calls"], (len(denied), capped, fl)
    assert [r for r in recs if r.get("syscall") == "unshare"], "the other sandbox's call was recorded"


def test_the_helper_holding_the_listener_is_not_dumpable(tmp_path):
    """Between loading the notify filter and handing its listener over, ``agentvm-helper init``
    holds the fd that answers the sandbox's syscalls; with allow_ptrace, no Landlock and Yama 0
    another process of the agent (same uid) could take it (pidfd_getfd). Held here in that
    window - the supervisor's socket is full, so the hand-over blocks - the helper must be
    non-dumpable: its /proc entries belong to root, not to its uid."""
    import shutil
    import socket
    import subprocess
    import sys

    from agentvm import native
    from agentvm import seccomp as sc

    d = Path(f"/tmp/agentvm-test-dumpable-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    try:
        helper = d / "agentvm-helper"
        shutil.copy(native.helper_path(tmp_path / "libexec"), helper)
        os.chmod(helper, 0o755)
        sup_end, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:  # fill the helper's direction: its sendmsg of the listener blocks
            while True:
                theirs.send(b"x" * 4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        sfd = sc.filter_fd(sc.SeccompOptions(notify=True, watch=sc.DEFAULT_WATCH))
        try:
            p = subprocess.Popen([str(helper), "init", "--no-landlock", "--seccomp-fd", str(sfd), "--sysaudit-fd",
                                  str(theirs.fileno()), "--", "/bin/true"],
                                 pass_fds=(sfd, theirs.fileno()), user=65534, group=65534, extra_groups=[],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        finally:
            os.close(sfd)
            theirs.close()
        try:
            deadline = time.monotonic() + 30
            where = ""
            while time.monotonic() < deadline and p.poll() is None:
                try:
                    where = Path(f"/proc/{p.pid}/syscall").read_text().split()[0]
                except (OSError, IndexError):
                    where = ""
                if where == "46":  # sendmsg (x86_64): blocked handing the listener over
                    break
                time.sleep(0.01)
            assert where == "46", (where, p.poll(), p.stderr.read() if p.poll() is not None else b"")
            holds = [os.readlink(f"/proc/{p.pid}/fd/{n}") for n in os.listdir(f"/proc/{p.pid}/fd")]
            assert "anon_inode:seccomp notify" in holds, holds
            assert os.stat(f"/proc/{p.pid}/fd").st_uid == 0, "the helper holding the listener is dumpable"
        finally:
            p.kill()
            p.wait(10)
            sup_end.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
