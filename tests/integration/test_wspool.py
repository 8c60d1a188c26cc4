"""Issue 42 item 2: the workspace pool (agentvm.wspool) for real - one btrfs filesystem in one
loop-mounted image, a quota group per agent, real bubblewrap sandboxes writing into it.

- an agent that hits its limit gets EDQUOT inside while another agent writing at the same time
  is not affected;
- a subvolume an agent makes inside its workspace counts against its limit (no escape);
- the admission rule refuses with the numbers, and an operator's overcommit factor admits;
- with overcommit, a pool that runs out fails the writing agent (ENOSPC, not EDQUOT) and says so
  (the lease's disk state), never the other agent's saved data;
- a full host never takes an admitted agent's writes (the pool is reserved), and removing a
  workspace on a full host gives the space back and records it afterwards;
- data survives stop/start and the pool being unmounted; prune removes exactly the unused;
  removing every workspace leaves nothing (no image, no loop device, no mount, no quota group).
Every pool, loop device and mount made here is removed by the fixtures."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

M = 1 << 20


def _pool_ok() -> bool:
    try:
        from agentvm import wspool

        return wspool.supported()[0]
    except Exception:  # noqa: BLE001
        return False


needs_pool = pytest.mark.skipif(not _pool_ok(), reason="the workspace pool needs root, btrfs, mkfs.btrfs and kernel >= 6.7")


def _policy(name: str, command: list[str], disk: str = "16M", timeout: str = "60s"):
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    text = (f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
            f"  command: {json.dumps(command)}\n  limits: {{disk: {disk}, timeout: {timeout}}}\n")
    return compile_policy(load_agent_text(text, "<test>").spec)


def _py(src: str) -> list[str]:
    return ["/usr/bin/python3", "-c", src]


def _run(rt, policy, out: Path | None = None):
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if out is not None else subprocess.DEVNULL
    try:
        return rt.run(policy, tty=False, stdio=(subprocess.DEVNULL, fd, fd))
    finally:
        if out is not None:
            os.close(fd)


def _cleanup(home: Path) -> None:
    from agentvm import wspool

    ws = home / "run" / "ws"
    for d in ws.iterdir() if ws.is_dir() else ():
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
    wspool.Pool(home / "workspaces", home / "run").teardown()


def _loops_of(img: Path) -> list[str]:
    r = subprocess.run(["losetup", "-j", str(img)], capture_output=True, text=True)
    return [x for x in r.stdout.splitlines() if x.strip()]


def _read(rt, name: str, file: str) -> bytes:
    from agentvm import workspace

    with workspace.pool_open(rt.paths.workspaces, rt.paths.runtime) as pool:
        return (pool.path(name) / file).read_bytes()


def _idle(pool) -> None:
    """Not mounted, and its loop device gone (it detaches itself shortly after the unmount)."""
    assert not pool.mounted()
    deadline = time.monotonic() + 10
    while _loops_of(pool.img):
        assert time.monotonic() < deadline, _loops_of(pool.img)
        time.sleep(0.05)


@pytest.fixture
def rt(fresh_home, monkeypatch):
    from agentvm import workspace
    from agentvm.runtime import Runtime

    monkeypatch.setenv("AGENTVM_NO_DAEMON", "1")
    monkeypatch.delenv("AGENTVM_WORKSPACE_BACKEND", raising=False)
    monkeypatch.delenv("AGENTVM_WORKSPACE_POOL", raising=False)
    monkeypatch.delenv("AGENTVM_WORKSPACE_OVERCOMMIT", raising=False)
    workspace._cache_clear()
    r = Runtime()
    yield r
    _cleanup(fresh_home)


# a writer: 1 MiB at a time, each fsync'd, until an error or N MiB; prints JSON {"mib", "errno"}
WRITER = r"""
import errno, json, os, sys
path, n = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.dirname(path), exist_ok=True)
done, err = 0, None
block = bytes([done % 251 for done in range(1 << 20)])
try:
    with open(path, "wb") as f:
        for i in range(n):
            f.write(block); f.flush(); os.fsync(f.fileno()); done += 1
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps({"mib": done, "errno": err}), flush=True)
"""


def _writer(path: str, mib: int, pre: str = "") -> list[str]:
    return ["/bin/sh", "-c", f"{pre}exec /usr/bin/python3 -c '{WRITER}' {path} {mib}"]


def _result(out: Path) -> dict:
    return json.loads(out.read_text().strip().splitlines()[-1])


def _spec_file(tmp_path: Path, name: str, command: list[str], disk: str) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
                 f"  command: {json.dumps(command)}\n  limits: {{disk: {disk}, timeout: 60s}}\n")
    return f


@needs_pool
def test_quota_hit_in_one_agent_does_not_affect_another_writing_at_the_same_time(rt, tmp_path):
    from agentvm import wspool

    # b starts first and writes (each MiB fsync'd) across the time a fills its limit; separate
    # `agentvm run` processes, as two operators would start them
    b_f = _spec_file(tmp_path, "wsq-b", _writer("/workspace/data", 12, pre="sleep 0.5; "), "32M")
    a_f = _spec_file(tmp_path, "wsq-a", _writer("/workspace/fill", 200), "16M")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTVM_WORKSPACE_")}
    procs = {k: subprocess.Popen([sys.executable, "-m", "agentvm", "run", "-f", str(f)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, f in (("b", b_f), ("a", a_f))}
    outs = {k: p.communicate(timeout=120) for k, p in procs.items()}
    for k in ("a", "b"):  # each printed its writer's result (else: its run's error, shown)
        assert outs[k][0].strip(), (k, procs[k].returncode, outs[k][1])
    a, b = (json.loads(outs[k][0].strip().splitlines()[-1]) for k in ("a", "b"))
    assert a["errno"] == "EDQUOT" and 13 <= a["mib"] <= 16, (a, outs["a"][1])  # its own limit, inside
    assert b == {"mib": 12, "errno": None}, (b, outs["b"][1])  # untouched by a's
    assert procs["b"].returncode == 0, outs["b"][1]
    pool = wspool.Pool(rt.paths.workspaces, rt.paths.runtime)
    data = _read(rt, "wsq-b", "data")
    assert len(data) == 12 * M and data[11 * M: 11 * M + 251] == bytes(range(251))
    # and b still writes after a is full
    out = tmp_path / "o"
    assert _run(rt, _policy("wsq-b", _writer("/workspace/more", 4), disk="32M"), out).exit_code == 0
    assert _result(out) == {"mib": 4, "errno": None}


@needs_pool
def test_a_subvolume_made_inside_a_workspace_counts_against_its_limit(rt, tmp_path):
    from agentvm import workspace, wspool

    src = ("import fcntl, os\n"
           "b = bytearray(4096); b[8:11] = b'esc'\n"
           "fd = os.open('/workspace', os.O_RDONLY)\n"
           "fcntl.ioctl(fd, 0x5000940E, b)\n"  # BTRFS_IOC_SUBVOL_CREATE: allowed to the owner of the dir
           "print('made', flush=True)\n")
    out = tmp_path / "o"
    assert _run(rt, _policy("wsq-esc", _py(src)), out).exit_code == 0 and "made" in out.read_text()
    r = _run(rt, _policy("wsq-esc", _writer("/workspace/esc/f", 64)), out)
    res = _result(out)
    assert res["errno"] == "EDQUOT" and res["mib"] <= 16, res
    assert r.teardown["verified"]
    pool = wspool.Pool(rt.paths.workspaces, rt.paths.runtime)
    assert workspace.remove_workspace(rt.paths.workspaces, "wsq-esc", runtime=rt.paths.runtime) > 8 * M
    assert not pool.exists()
    _idle(pool)


@needs_pool
def test_subvolumes_made_below_path_max_and_nested_do_not_keep_a_workspace_from_being_removed(rt, tmp_path):
    """An agent that hides subvolumes where a path walk cannot reach (2,200 folders deep: past
    PATH_MAX) and nests one in another: removing its workspace removes them all (found by id in
    the filesystem's root tree, deleted by id), and its quota group and space go with it
    (found by a security review: `rm` failed with 'Directory not empty' and the space stayed)."""
    from agentvm import workspace, wspool

    src = ("import fcntl, os\n"
           "def subvol(dfd, name):\n"
           "    b = bytearray(4096); b[8:8 + len(name)] = name\n"
           "    fcntl.ioctl(dfd, 0x5000940E, b)\n"  # BTRFS_IOC_SUBVOL_CREATE
           "fd = os.open('/workspace', os.O_RDONLY)\n"
           "for i in range(2200):\n"  # fd-relative: the path is 4,400 bytes, past PATH_MAX
           "    os.mkdir('d', dir_fd=fd); nfd = os.open('d', os.O_RDONLY, dir_fd=fd); os.close(fd); fd = nfd\n"
           "subvol(fd, b'deep')\n"
           "inner = os.open('deep', os.O_RDONLY, dir_fd=fd)\n"
           "subvol(inner, b'deeper')\n"
           "subvol(os.open('/workspace', os.O_RDONLY), b'top')\n"
           "with open(os.open('deeper/f', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=inner), 'wb') as f:\n"
           "    f.write(os.urandom(4 << 20))\n"
           "print('made', flush=True)\n")
    out = tmp_path / "o"
    r = _run(rt, _policy("wsq-deep", _py(src), disk="32M"), out)
    assert r.exit_code == 0 and "made" in out.read_text(), out.read_text()
    pool = wspool.Pool(rt.paths.workspaces, rt.paths.runtime)
    with workspace.pool_open(rt.paths.workspaces, rt.paths.runtime) as p:
        assert len(p._nested("wsq-deep")) == 3  # deep, deeper (inside deep) and top
    assert workspace.remove_workspace(rt.paths.workspaces, "wsq-deep", runtime=rt.paths.runtime) >= 4 * M
    assert not pool.exists()
    _idle(pool)


@needs_pool
def test_admission_refuses_with_the_numbers_and_overcommit_admits(rt, monkeypatch):
    from agentvm import workspace, wspool
    from agentvm.errors import PolicyDenied

    monkeypatch.setenv("AGENTVM_WORKSPACE_POOL", "256M")
    ws, run = rt.paths.workspaces, rt.paths.runtime
    a = workspace.acquire(ws, run, "wsq-run", uid=3_999_000, gid=3_999_000, size=160 * M, enforce_quota=True)
    try:
        assert a.kind == "pool"
        with pytest.raises(PolicyDenied) as ei:
            workspace.acquire(ws, run, "wsq-next", uid=3_999_001, gid=3_999_001, size=160 * M, enforce_quota=True)
        e = ei.value
        assert e.code == "workspace.overcommit" and e.exit_code == 125 and e.status == 507
        msg = e.message
        for part in ("'wsq-next' (it needs 160M)", "2 running agent(s)", "may still write 320.0M",
                     "overcommit factor 1", "needs 336.0M free", "capped at 256.0M by AGENTVM_WORKSPACE_POOL"):
            assert part in msg, (part, msg)
        assert "AGENTVM_WORKSPACE_OVERCOMMIT" in e.hint
        assert not (wspool.Pool(ws, run).path("wsq-next")).exists(), "a refused start makes nothing"
        # the operator allows overcommit: admitted
        monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", "2")
        b = workspace.acquire(ws, run, "wsq-next", uid=3_999_001, gid=3_999_001, size=160 * M, enforce_quota=True)
        b.release()
        monkeypatch.delenv("AGENTVM_WORKSPACE_OVERCOMMIT")
    finally:
        a.release()
    # stopped agents count for what they hold only: with the first stopped, the second fits
    b = workspace.acquire(ws, run, "wsq-next", uid=3_999_001, gid=3_999_001, size=160 * M, enforce_quota=True)
    b.release()


@needs_pool
def test_with_overcommit_a_full_pool_fails_the_writer_and_says_so_never_the_saved_data(rt, monkeypatch):
    from agentvm import workspace, wspool

    monkeypatch.setenv("AGENTVM_WORKSPACE_POOL", "256M")
    monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", "4")
    ws, run = rt.paths.workspaces, rt.paths.runtime
    uid = 3_999_010
    a = workspace.acquire(ws, run, "wsq-one", uid=uid, gid=uid, size=300 * M, enforce_quota=True)
    b = workspace.acquire(ws, run, "wsq-two", uid=uid + 1, gid=uid + 1, size=300 * M, enforce_quota=True)
    try:
        def write(lease, u, name, mib):
            r = subprocess.run(["setpriv", f"--reuid={u}", f"--regid={u}", "--clear-groups", sys.executable, "-c",
                                WRITER, str(lease.host_dir / name), str(mib)], capture_output=True, text=True)
            return json.loads(r.stdout.strip().splitlines()[-1])

        assert write(b, uid + 1, "saved", 20) == {"mib": 20, "errno": None}
        res = write(a, uid, "fill", 300)
        assert res["errno"] == "ENOSPC" and res["mib"] < 256, res  # the pool, not its own limit
        st = a.disk_state()
        assert st["pool_full"] is True and st["limit_hit"] is False and st["used"] < st["limit"], st
        data = (b.host_dir / "saved").read_bytes()
        assert len(data) == 20 * M and data[:251] == bytes(range(251)), "the other agent's saved data is whole"
    finally:
        a.release()
        b.release()
    assert a.disk["pool_full"] is True, ("kept on the lease for the run's report", a.disk, st)
    _idle(wspool.Pool(ws, run))


@needs_pool
def test_a_pool_run_out_under_overcommit_is_in_the_writers_run_report_and_audit(rt, monkeypatch, tmp_path):
    """Real sandboxes through the lifecycle: the agent whose writes hit a full pool gets ENOSPC,
    its RunResult names ``workspace-pool-full``, the run report says so with the numbers, and its
    ``run.exited`` record carries the disk; the other agent's saved data is whole, and its own
    run (under its limit, pool not full) names no disk limit."""
    from agentvm import runreport
    from agentvm.audit import AuditLog

    monkeypatch.setenv("AGENTVM_WORKSPACE_POOL", "256M")
    monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", "4")
    out_b, out_a = tmp_path / "b.out", tmp_path / "a.out"
    rb = _run(rt, _policy("wsr-keeper", _writer("/workspace/saved", 20), disk="300M"), out_b)
    assert _result(out_b) == {"mib": 20, "errno": None}
    assert rb.exit_code == 0 and rb.disk and not rb.disk["pool_full"] and not rb.disk["limit_hit"], rb.disk
    assert rb.limits_hit == [], rb.limits_hit
    ra = _run(rt, _policy("wsr-filler", _writer("/workspace/fill", 300), disk="300M"), out_a)
    res = _result(out_a)
    assert res["errno"] == "ENOSPC" and res["mib"] < 256, res  # the pool ran out, not its own limit
    assert "workspace-pool-full" in ra.limits_hit and "disk" not in ra.limits_hit, (ra.limits_hit, ra.disk)
    assert ra.disk["used"] < ra.disk["limit"] == 300 * M, ra.disk
    text = runreport.render(ra.to_dict())
    assert "the workspace pool is full:" in text and "failed with ENOSPC" in text, text
    assert " of 256.0M used" in text, text
    assert "workspace pool" not in runreport.render(rb.to_dict())
    recs = AuditLog(rt.paths.audit_dir / "audit.db").records(kinds=("run.exited",))
    by = {r.data.get("agent"): r.data for r in recs}
    assert by["wsr-filler"]["disk"]["pool_full"] is True, by["wsr-filler"]
    assert "workspace-pool-full" in by["wsr-filler"]["limits_hit"], by["wsr-filler"]
    assert by["wsr-keeper"]["disk"]["pool_full"] is False and by["wsr-keeper"]["limits_hit"] == [], by["wsr-keeper"]
    data = _read(rt, "wsr-keeper", "saved")
    assert len(data) == 20 * M and data[:251] == bytes(range(251)), "the other agent's saved data is whole"


@needs_pool
def test_an_agent_at_its_own_limit_is_named_disk_in_its_run_report(rt, tmp_path):
    from agentvm import runreport

    out = tmp_path / "o.out"
    r = _run(rt, _policy("wsr-limit", _writer("/workspace/big", 40), disk="16M"), out)
    assert _result(out)["errno"] == "EDQUOT", _result(out)
    assert r.limits_hit == ["disk"], (r.limits_hit, r.disk)
    text = runreport.render(r.to_dict())
    assert "disk limit (16.0M) was hit" in text and "EDQUOT" in text, text


@needs_pool
def test_data_survives_stop_start_and_the_pool_being_unmounted(rt, tmp_path):
    from agentvm import workspace, wspool
    from agentvm.runtime import gc_stale

    out = tmp_path / "o"
    assert _run(rt, _policy("wsq-keep", ["/bin/sh", "-c", "echo kept > /workspace/f; sync"]), out).exit_code == 0
    pool = wspool.Pool(rt.paths.workspaces, rt.paths.runtime)
    _idle(pool)  # its last user gone: no mount, no loop device (as after a reboot)
    # a pool its user left mounted (it died before letting go): the runtime's sweep unmounts it
    src = ("import os, sys; from pathlib import Path; from agentvm import workspace; "
           "cm = workspace.pool_open(Path(sys.argv[1]), Path(sys.argv[2])); cm.__enter__(); os._exit(0)")
    subprocess.run([sys.executable, "-c", src, str(rt.paths.workspaces), str(rt.paths.runtime)], check=True)
    assert pool.mounted()
    gc_stale(rt.paths)
    _idle(pool)
    assert _run(rt, _policy("wsq-keep", ["/bin/cat", "/workspace/f"]), out).exit_code == 0
    assert out.read_text().strip() == "kept"
    # while a sandbox runs, the sweep leaves the pool alone
    t = threading.Thread(target=_run, args=(rt, _policy("wsq-keep", ["/bin/sh", "-c", "touch /workspace/up; sleep 3"])))
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not (pool.path("wsq-keep") / "up").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gc_stale(rt.paths)
        assert pool.mounted()
    finally:
        t.join()


@needs_pool
def test_prune_removes_exactly_the_unused_and_the_last_removal_leaves_nothing(rt):
    from agentvm import workspace, wspool

    ws, run = rt.paths.workspaces, rt.paths.runtime
    names = ["wsq-old1", "wsq-old2", "wsq-new", "wsq-owned", "wsq-busy"]
    for i, n in enumerate(names):
        workspace.acquire(ws, run, n, uid=3_999_020 + i, gid=3_999_020 + i, size=16 * M, enforce_quota=True).release()
    pool = wspool.Pool(ws, run)
    old = time.time() - 10 * 86400
    with workspace.pool_open(ws, run) as opened:
        for n in ("wsq-old1", "wsq-old2", "wsq-owned", "wsq-busy"):
            os.utime(opened.path(n), (old, old))
    busy = workspace.lock_agent(ws, "wsq-busy", "test", "test")
    try:
        gone = workspace.prune(ws, 7 * 86400, runtime=run, owners={"wsq-owned"})
    finally:
        os.close(busy)
    assert sorted(n for n, _ in gone) == ["wsq-old1", "wsq-old2"]
    assert sorted(w.name for w in workspace.list_workspaces(ws, runtime=run, owners=set())) == [
        "wsq-busy", "wsq-new", "wsq-owned"]
    for n in ("wsq-busy", "wsq-new", "wsq-owned"):
        workspace.remove_workspace(ws, n, runtime=run)
    assert sorted(os.listdir(ws)) == [], os.listdir(ws)
    _idle(pool)
    assert not pool.exists()


@needs_pool
def test_an_explicit_image_backend_and_an_existing_image_keep_images(rt, monkeypatch):
    from agentvm import workspace, wspool

    ws, run = rt.paths.workspaces, rt.paths.runtime
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", "image")
    assert workspace.backend()[0] == "image"
    lease = workspace.acquire(ws, run, "wsq-img", uid=3_999_030, gid=3_999_030, size=16 * M, enforce_quota=True)
    (lease.host_dir / "f").write_text("x")
    lease.release()
    monkeypatch.delenv("AGENTVM_WORKSPACE_BACKEND")
    assert workspace.backend()[0] == "pool"
    lease = workspace.acquire(ws, run, "wsq-img", uid=3_999_030, gid=3_999_030, size=16 * M, enforce_quota=True)
    try:
        assert lease.kind == "image" and (lease.host_dir / "f").read_text() == "x", "its data was not moved"
    finally:
        lease.release()
    assert not wspool.Pool(ws, run).exists()
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", "bogus")
    ok, why = workspace.quota_supported()
    assert not ok and "bogus" in why
    workspace.remove_workspace(ws, "wsq-img", runtime=run)


# ------------------------------------------------------------------ a full host


@pytest.fixture
def small_home(avm_home):
    home = Path(f"/tmp/agentvm-wsqfull-{secrets.token_hex(3)}")
    home.mkdir(mode=0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m,mode=0711", "tmpfs", str(home)], check=True)
    yield home
    _cleanup(home)
    subprocess.run(["umount", "-l", str(home)], capture_output=True)
    shutil.rmtree(home, ignore_errors=True)


def _env(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTVM_WORKSPACE_")}
    return {**env, "AGENTVM_HOME": str(home), "AGENTVM_NO_DAEMON": "1", **extra}


def _av(home: Path, *args, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentvm", *args], env=_env(home, **extra), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


@needs_pool
def test_a_full_host_never_takes_an_admitted_agents_writes(small_home, tmp_path):
    home = small_home
    f = tmp_path / "a.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: wsq-host}\nspec:\n"
                 f"  command: {json.dumps(_writer('/workspace/data', 24, pre='touch /workspace/ready; while [ ! -e /workspace/go ]; do sleep 0.05; done; '))}\n"
                 "  limits: {disk: 32M, timeout: 60s}\n")
    proc = subprocess.Popen([sys.executable, "-m", "agentvm", "run", "-f", str(f)], env=_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ws = home / "run" / "ws" / ".pool" / "wsq-host"
        deadline = time.monotonic() + 30
        while not (ws / "ready").exists():  # the sandbox runs (its start is on the audit chain)
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        subprocess.run(["dd", "if=/dev/zero", f"of={home}/fill", "bs=1M"], capture_output=True)  # until ENOSPC
        assert os.statvfs(home).f_bavail == 0
        (ws / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the agent's every fsync'd write landed (agent-vm itself may then fail to record the run's
    # end on the full disk: state.disk-full, exit 75 - its own failure, said as one)
    assert json.loads(out.strip().splitlines()[-1]) == {"mib": 24, "errno": None}, (out, err)
    assert proc.returncode == 0 or (proc.returncode == 75 and "state.disk-full" in err), err
    from agentvm import workspace

    with workspace.pool_open(home / "workspaces", home / "run") as pool:
        data = (pool.path("wsq-host") / "data").read_bytes()
    assert len(data) == 24 * M and data[23 * M: 23 * M + 251] == bytes(range(251))
    # a new start on a (nearly) full host is refused with the numbers, not admitted into nothing:
    # 40 MiB given back, enough for agent-vm's state, less than the host's reserve for it
    fill = home / "fill"
    os.truncate(fill, fill.stat().st_size - 40 * M)
    g = tmp_path / "b.yaml"
    g.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: wsq-late}\nspec:\n  command: [/bin/true]\n"
                 "  limits: {disk: 300M}\n")
    r = _av(home, "run", "-f", str(g), "--json")  # (the pool exists: an agent was admitted into it)
    import re

    assert r.returncode == 125 and json.loads(r.stdout)["error"] == "workspace.overcommit", (r.stdout, r.stderr)
    msg = json.loads(r.stdout)["message"]
    assert "can grow by 0B" in msg and re.search(r"host: (3\d|40)\.\dM free, 64\.0M of it kept", msg), msg


@needs_pool
def test_workspace_rm_on_a_full_host_gives_the_pool_back_and_records_after(small_home, tmp_path):
    home = small_home
    f = tmp_path / "a.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: wsq-full}\nspec:\n"
                 "  command: [/bin/sh, -c, 'echo data > /workspace/f']\n  limits: {disk: 16M}\n")
    assert _av(home, "run", "-f", str(f)).returncode == 0
    reserved = (home / "workspaces" / ".pool.img").stat().st_blocks * 512
    assert reserved >= 64 * M
    subprocess.run(["dd", "if=/dev/zero", f"of={home}/fill", "bs=1M"], capture_output=True)
    assert os.statvfs(home).f_bavail == 0
    r = _av(home, "workspace", "rm", "wsq-full")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(home / "workspaces")) == [], "the empty pool went too"
    assert os.statvfs(home).f_bavail * os.statvfs(home).f_frsize >= reserved - M
    recs = [json.loads(x) for x in _av(home, "audit", "show", "--json").stdout.splitlines()]
    rm = [x for x in recs if x["kind"] == "workspace.removed"]
    assert len(rm) == 1 and rm[0]["data"]["backend"] == "pool" and "disk was full" in rm[0]["data"]["recorded"], rm
    assert _av(home, "audit", "verify").returncode == 0


@needs_pool
def test_a_persistent_agents_workspace_survives_stop_start_and_a_daemon_restart(fresh_home, tmp_path, monkeypatch):
    """Through the daemon: written, stopped, the daemon restarted, started again - the data is
    there; `agentvm rm` then removes it and the (empty) pool with it."""
    monkeypatch.delenv("AGENTVM_NO_DAEMON", raising=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTVM_WORKSPACE_")}

    def av(*args, timeout=120):
        return subprocess.run([sys.executable, "-m", "agentvm", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    f = tmp_path / "p.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: wsq-daemon}\nspec:\n  lifecycle: persistent\n"
                 "  command: [/bin/sh, -c, 'echo started >> /workspace/log; exec sleep 300']\n  limits: {disk: 16M}\n")
    assert av("up").returncode == 0
    try:
        assert av("create", "-f", str(f), "--start").returncode == 0
        r = av("exec", "wsq-daemon", "--", "/bin/sh", "-c", "echo saved > /workspace/data; sync")
        assert r.returncode == 0, r.stderr
        assert av("stop", "wsq-daemon").returncode == 0
        assert av("down", timeout=60).returncode == 0
        pool = __import__("agentvm.wspool", fromlist=["Pool"]).Pool(fresh_home / "workspaces", fresh_home / "run")
        _idle(pool)  # nothing runs: nothing mounted
        assert av("up").returncode == 0
        assert av("start", "wsq-daemon").returncode == 0
        r = av("exec", "wsq-daemon", "--", "/bin/sh", "-c", "cat /workspace/data /workspace/log")
        assert r.returncode == 0 and r.stdout.split() == ["saved", "started", "started"], (r.stdout, r.stderr)
        assert av("stop", "wsq-daemon").returncode == 0
        r = av("rm", "wsq-daemon")
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(fresh_home / "workspaces")) == []
        _idle(pool)
    finally:
        av("down", timeout=60)


@needs_pool
def test_the_daemon_holds_the_pool_mounted_and_metrics_show_it(fresh_home, tmp_path, monkeypatch):
    """While the daemon runs the pool stays mounted between runs (its own hold: no mount and
    unmount per start); /metrics has the pool's gauges; the last rm removes the pool even so,
    the next start makes it (and the daemon holds it again), and `down` unmounts it."""
    from prometheus_client.parser import text_string_to_metric_families

    from agentvm import wspool

    monkeypatch.delenv("AGENTVM_NO_DAEMON", raising=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTVM_WORKSPACE_")}

    def av(*args, timeout=120):
        return subprocess.run([sys.executable, "-m", "agentvm", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def metrics() -> dict:
        r = subprocess.run(["curl", "-s", "--max-time", "20", "--unix-socket", str(fresh_home / "run" / "agentvm.sock"),
                            "http://d/metrics"], capture_output=True, text=True, timeout=30)
        fams = {f.name: f for f in text_string_to_metric_families(r.stdout)}
        return {sm.labels["kind"]: sm.value for sm in fams["agentvm_workspace_pool_bytes"].samples}

    pool = wspool.Pool(fresh_home / "workspaces", fresh_home / "run")
    f = tmp_path / "p.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: wsq-held}\nspec:\n  lifecycle: persistent\n"
                 "  command: [/bin/sh, -c, 'echo x > /workspace/f; exec sleep 300']\n  limits: {disk: 24M}\n")
    assert av("up").returncode == 0
    try:
        assert av("create", "-f", str(f), "--start").returncode == 0
        assert av("stop", "wsq-held").returncode == 0
        assert pool.mounted(), "nothing runs, and the daemon still holds the pool mounted"
        m = metrics()
        assert m["committed"] == 24 * M, m
        assert m["reserved"] >= m["size"] >= 48 * M and 0 < m["free"] < m["size"], m
        assert av("start", "wsq-held").returncode == 0
        assert av("stop", "wsq-held").returncode == 0
        assert pool.mounted()
        # a run through the daemon that hits its own limit: the thin client's report says so
        g = _spec_file(tmp_path, "wsq-over", _writer("/workspace/big", 40), "16M")
        r = av("run", "-f", str(g))
        assert "EDQUOT" in r.stdout and "the workspace's disk limit (16.0M) was hit" in r.stderr, (r.stdout, r.stderr)
        assert av("workspace", "rm", "wsq-over").returncode == 0  # (run -f leaves a workspace, no agent)
        r = av("rm", "wsq-held")
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(fresh_home / "workspaces")) == [], "the last rm removed the pool, held or not"
        _idle(pool)
        assert av("create", "-f", str(f), "--start").returncode == 0  # a new pool: the daemon takes it
        assert av("stop", "wsq-held").returncode == 0
        assert pool.mounted()
        assert av("down", timeout=60).returncode == 0
        _idle(pool)  # the daemon gone: unmounted, its loop device detached, the data kept
        assert pool.exists()
        assert av("up").returncode == 0
        assert av("rm", "wsq-held").returncode == 0
        assert not pool.exists()
    finally:
        av("down", timeout=60)


@needs_pool
def test_a_first_start_the_host_cannot_hold_is_refused_and_leaves_no_pool(avm_home):
    from agentvm import workspace
    from agentvm.errors import PolicyDenied

    home = Path(f"/tmp/agentvm-wsqref-{secrets.token_hex(3)}")
    home.mkdir(mode=0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=0711", "tmpfs", str(home)], check=True)
    try:
        with pytest.raises(PolicyDenied) as ei:
            workspace.acquire(home / "workspaces", home / "run", "wsq-x", uid=3_999_050, gid=3_999_050,
                              size=16 * M, enforce_quota=True)
        assert ei.value.code == "workspace.overcommit" and "no pool yet" in ei.value.message
        assert sorted(os.listdir(home / "workspaces")) == ["wsq-x.lock"]  # the agent's own lock, as always
    finally:
        _cleanup(home)
        subprocess.run(["umount", "-l", str(home)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
