"""Resource exhaustion and persistence: fork bombs, memory, CPU, daemons that try to outlive
the sandbox, filling the workspace, and flooding stdout."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest

from _attacklib import describe_pids, dump, last_json, needs_root, real_uid_processes

pytestmark = [pytest.mark.attack, needs_root]


def _assert_nothing_left(res: dict, r=None) -> None:
    uid = res["host_uid"]
    assert isinstance(uid, int) and uid >= int(os.environ["AGENTVM_UID_BASE"]), res
    left = real_uid_processes(uid)
    assert not left, f"processes of the sandbox uid {uid} survived the run: {describe_pids(left)}" + (dump(r) if r else "")
    assert res["teardown_verified"] is True and res["teardown"]["verified"] is True, res


FORK_BOMB = r"""
import os, time, errno
def bomb():
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.005)
if os.fork() == 0:
    bomb()
print("bombing", flush=True)
time.sleep(2.5)
procs = len([p for p in os.listdir("/proc") if p.isdigit()])
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    print("watchdog_fork OK")
except OSError as e:
    print("watchdog_fork", errno.errorcode[e.errno])
print("procs", procs, flush=True)
"""


def test_fork_bomb_is_contained(avm_home):
    p = subprocess.Popen(
        [sys.executable, "-m", "agentvm", "run", "--json", "--timeout", "20s", "--", "/usr/bin/python3", "-c", FORK_BOMB],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    try:
        first = p.stdout.readline()
        assert first.strip() == b"bombing", first + p.stderr.read1(4000)
        time.sleep(1.0)
        # the host stays responsive while the bomb runs
        for _ in range(5):
            assert subprocess.run(["true"], timeout=10).returncode == 0
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    stdout = (first + out).decode(errors="replace")
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, err.decode(errors="replace"))
    res = last_json(stdout)
    procs = int(next(ln.split()[1] for ln in stdout.splitlines() if ln.startswith("procs ")))
    assert procs <= 256, f"{procs} processes inside: the pids limit did not hold" + dump(r)
    assert "watchdog_fork EAGAIN" in stdout, "fork still worked at the height of the bomb" + dump(r)
    assert subprocess.run(["true"]).returncode == 0
    _assert_nothing_left(res, r)
    # the run's outcome must surface that the process limit stopped the agent
    assert res["pids_limit_hit"] or res["exit_code"] != 0, (
        "fork bomb contained but the result reports a clean run (pids_limit_hit false, exit 0)" + dump(r)
    )
    assert "pids" in res["limits_hit"] or res["exit_code"] != 0, res


MEMORY_BOMB = r"""
import sys
chunks = []
for i in range(128):
    chunks.append(bytearray(1 << 20))  # touched (zero-filled) memory
    if i % 16 == 0:
        print("allocated", i + 1, "MiB", flush=True)
print("SURVIVED 128 MiB", flush=True)
"""


def test_memory_bomb_is_oom_killed(avm_json):
    r, res = avm_json("run", "--memory", "64M", "--", "/usr/bin/python3", "-c", MEMORY_BOMB)
    assert "SURVIVED" not in r.stdout, "allocated 2x the memory limit" + dump(r)
    assert r.returncode == 137 and res["exit_code"] == 137, dump(r)
    assert res["oom_killed"] is True and "memory" in res["limits_hit"], res
    _assert_nothing_left(res, r)


CPU_SPIN = r"""
import os
for _ in range(os.cpu_count() * 2 - 1):
    if os.fork() == 0:
        break
print("spinning", os.getpid(), flush=True)
while True:
    pass
"""


def test_cpu_spin_is_killed_at_timeout(avm_json):
    r, res = avm_json("run", "--timeout", "2s", "--", "/usr/bin/python3", "-c", CPU_SPIN, timeout=60)
    assert "spinning" in r.stdout, dump(r)
    assert r.returncode == 124 and res["exit_code"] == 124, dump(r)
    assert res["timed_out"] is True and "timeout" in res["limits_hit"], res
    _assert_nothing_left(res, r)


DAEMONS = r"""
set -u
M="$1"
setsid nohup sleep 300 >/dev/null 2>&1 &
nohup sh -c 'trap "" HUP TERM; exec sleep 301' >/dev/null 2>&1 &
/usr/bin/python3 - "$M" <<'EOF'
import os, sys, time, signal
# classic double-fork daemon: new session, parent exits, grandchild ignores everything
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: /proc/<pid> owned by root
        os.chdir("/")
        fd = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        sys.argv[0] = "daemon-" + sys.argv[1]
        while True:
            time.sleep(1)
    os._exit(0)
time.sleep(0.2)
EOF
echo "started"
ps -eo pid,sid,args | grep -v ps
"""


def test_daemons_do_not_outlive_the_sandbox(avm_json):
    marker = f"agentvm-daemon-{secrets.token_hex(4)}"
    r, res = avm_json("run", "--", "/bin/sh", "-c", DAEMONS, "sh", marker)
    assert "started" in r.stdout and "sleep 300" in r.stdout, dump(r)  # control: they were running inside
    assert r.returncode == 0, dump(r)
    _assert_nothing_left(res, r)
    # also by command line, whatever the uid
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if marker.encode() in cmd:
            survivors.append(pid)
    assert not survivors, f"daemon survived: {survivors}"


def test_workspace_fill_gives_enospc(agentvm, agent_file, agent_name, avm_home):
    name = agent_name("filler")
    f = agent_file(name, disk="32M")
    code = r"""
import errno, os
n = 0
try:
    with open("/workspace/fill", "wb") as fh:
        while True:
            fh.write(b"\xa5" * (1 << 20)); fh.flush(); os.fsync(fh.fileno()); n += 1
            if n > 256: print("NO LIMIT"); break
except OSError as e:
    print("stopped", errno.errorcode[e.errno], n)
try:
    for i in range(10000):
        open(f"/workspace/small-{i}", "wb").write(b"x" * 4096)
    print("smallfiles OK")
except OSError as e:
    print("small", errno.errorcode[e.errno])
st = os.statvfs("/workspace"); print("free", st.f_bavail * st.f_frsize)
"""
    r = agentvm("run", "--json", "-f", f, "--", "/usr/bin/python3", "-c", code, timeout=120)
    out = r.stdout.decode()
    res = last_json(out)
    assert "NO LIMIT" not in out, dump(r)
    img = avm_home / "workspaces" / f"{name}.img"
    if img.exists():  # an image per agent: its own ext4 of the limit's size is full
        assert "stopped ENOSPC" in out, dump(r)
        assert "small ENOSPC" in out or "smallfiles OK" not in out, dump(r)
        st = img.stat()
        assert st.st_size <= 32 * 1024 * 1024, f"workspace image grew to {st.st_size}"
        assert st.st_blocks * 512 <= 33 * 1024 * 1024, f"workspace image uses {st.st_blocks * 512} bytes on the host"
    else:  # the pool (the default): its quota group stops it at the limit, EDQUOT
        from agentvm import workspace

        assert "stopped EDQUOT" in out, dump(r)
        assert "small EDQUOT" in out or "smallfiles OK" not in out, dump(r)
        with workspace.pool_open(avm_home / "workspaces", avm_home / "run") as pool:
            assert pool is not None and pool.path(name).is_dir(), list((avm_home / "workspaces").iterdir())
            pool.sync()
            e = pool.entry(name)
        assert e.limit == 32 * 1024 * 1024, e
        # what it holds on the host (its quota group's bytes, counted at commit) stays within the limit
        # (a few hundred KiB of metadata past it at most: docs/workspaces.md)
        assert e.used <= 33 * 1024 * 1024, f"the workspace holds {e.used} bytes"
        assert res["disk"]["limit_hit"] is True and "disk" in res["limits_hit"], res
    assert res["teardown_verified"] is True, res
    # the host's view: it is unmounted after the run
    assert str(avm_home / "run" / "ws" / name) not in open("/proc/self/mountinfo").read()


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for ln in fh:
                if ln.startswith("VmHWM:"):
                    return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_stdout_flood_does_not_exhaust_supervisor(avm_home):
    size = 1 << 30
    p = subprocess.Popen(
        [sys.executable, "-m", "agentvm", "run", "--json", "--", "/usr/bin/head", "-c", "1G", "/dev/zero"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    total, hwm, tail, chunks = 0, 0, b"", 0
    try:
        while True:
            buf = p.stdout.read1(1 << 20)
            if not buf:
                break
            total += len(buf)
            tail = (tail + buf)[-4096:]
            chunks += 1
            if chunks % 64 == 0:
                hwm = max(hwm, _vm_hwm(p.pid))
        hwm = max(hwm, _vm_hwm(p.pid))
        err = p.stderr.read()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    res = last_json(tail.split(b"\0")[-1])
    json_len = len(tail.split(b"\0")[-1])
    assert total - json_len == size, f"got {total - json_len} bytes of {size}; stderr={err[-2000:]!r}"
    assert p.returncode == 0 and res["exit_code"] == 0, (p.returncode, res, err[-2000:])
    assert 0 < hwm < 200 * 1024 * 1024, f"agentvm supervisor peak RSS {hwm / 1e6:.0f} MB"
    assert res["teardown_verified"] is True, res
