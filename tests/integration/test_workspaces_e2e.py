"""Issue 42 end to end: named agents created, started, stopped and removed leave nothing under
``<home>/workspaces`` (no image, no pool, no loop device, no mount); anonymous runs never make
a workspace; a kept one stays until ``agentvm workspace rm``; a workspace in use is never
removed. Real sandboxes, the default backend (the btrfs pool where it runs) and the ext4 image
backend (AGENTVM_WORKSPACE_BACKEND=image), 16M workspaces, the embedded path (no daemon). The
200-agent test takes about a minute here per backend."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

N_AGENTS = int(os.environ.get("AGENTVM_TEST_WS_AGENTS", "200"))


def _spec(name: str, extra: str = "", command: str = '["/bin/sh", "-c", "echo data > /workspace/f"]') -> str:
    return (f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n  command: {command}\n"
            f"  limits: {{disk: 16M, timeout: 60s}}\n{extra}")


def _policy(text: str):
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    return compile_policy(load_agent_text(text, "<test>").spec)


def _run(rt, policy):
    """Start the agent's sandbox and let it stop (its command ends); its workspace is made,
    mounted, written and released as for `agentvm run -f`."""
    res = rt.run(policy, tty=False, stdio=(subprocess.DEVNULL, subprocess.DEVNULL, subprocess.DEVNULL))
    assert res.exit_code == 0 and res.teardown["verified"], res
    return res


def _cli(*args) -> int:
    from agentvm.cli.app import cli_main

    return cli_main(list(args))


def _backends() -> list:
    from agentvm import wspool

    ok, why = wspool.supported()
    return [pytest.param("pool", marks=pytest.mark.skipif(not ok, reason=f"no workspace pool here: {why}")), "image"]


@pytest.fixture(params=_backends())
def rt(request, fresh_home, monkeypatch):
    from agentvm import workspace, wspool
    from agentvm.runtime import Runtime

    monkeypatch.setenv("AGENTVM_NO_DAEMON", "1")
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", request.param)
    getattr(workspace, "_cache_clear", lambda: None)()  # (absent before issue 42)
    r = Runtime()
    r.backend_name = request.param
    yield r
    # whatever happened, leave no image, pool, loop device or mount behind on this machine
    for d in (r.paths.runtime / "ws").glob("*") if (r.paths.runtime / "ws").is_dir() else ():
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
    wspool.Pool(r.paths.workspaces, r.paths.runtime).teardown()
    shutil.rmtree(r.paths.workspaces, ignore_errors=True)


def _exists(rt, name: str) -> bool:
    """The workspace is there (an image, or a subvolume of the pool)."""
    from agentvm import workspace

    if rt.backend_name == "image":
        return (rt.paths.workspaces / f"{name}.img").exists()
    return name in {w.name for w in workspace.list_workspaces(rt.paths.workspaces, runtime=rt.paths.runtime)}


def _held(rt) -> int:
    """Bytes the workspaces hold on the host now."""
    ws = rt.paths.workspaces
    return sum(p.stat().st_blocks * 512 for p in ws.glob("*.img")) + sum(
        p.stat().st_blocks * 512 for p in ws.glob(".pool.img"))


def _loops(rt) -> list[str]:
    r = subprocess.run(["losetup", "-a"], capture_output=True, text=True)
    return [x for x in r.stdout.splitlines() if str(rt.paths.home) in x]


def test_200_named_agents_created_started_stopped_removed_leave_nothing(rt, capsys):
    ws_dir = rt.paths.workspaces
    names = [f"wsl-{i:03d}" for i in range(N_AGENTS)]
    t0 = time.monotonic()
    peak = 0
    batch = min(50, N_AGENTS)
    for start in range(0, N_AGENTS, batch):
        group = names[start: start + batch]
        for name in group:
            _run(rt, _policy(_spec(name)))  # create (its agent file), start, stop
        assert all(_exists(rt, n) for n in group)
        # a batch is on the disk now: images fully reserved, the pool thin (what they hold)
        peak = max(peak, _held(rt))
        for name in group:
            assert _cli("rm", name) == 0  # no daemon: removes what the embedded runs left
    took = time.monotonic() - t0
    assert sorted(os.listdir(ws_dir)) == [], os.listdir(ws_dir)[:10]
    assert not _loops(rt), _loops(rt)
    assert not [m for m in open("/proc/self/mountinfo") if str(rt.paths.home) in m]
    if rt.backend_name == "image":
        assert peak >= batch * 16 * (1 << 20)  # the batch was really there, reserved
    else:
        assert 0 < peak < batch * 16 * (1 << 20), peak  # thin: far less than the batch's limits
    # and it all came back: nothing under the home holds blocks, and no loop device keeps a
    # deleted image allocated (the host's free space itself moves with the other sessions here)
    held = sum(p.stat().st_blocks * 512 for p in rt.paths.home.rglob("*") if p.is_file() and p.suffix == ".img")
    assert held == 0, held
    print(f"\n{rt.backend_name}: {N_AGENTS} named agents created/started/stopped/removed in {took:.1f}s "
          f"({N_AGENTS / took:.1f}/s), peak {peak >> 20} MiB held for a batch of {batch}")


def test_anonymous_and_workspaceless_runs_leave_nothing(rt):
    from agentvm.policy import Policy

    ws_dir = rt.paths.workspaces
    for _ in range(3):  # `agentvm run -- CMD`: a tmpfs workspace that dies with the sandbox
        _run(rt, Policy(name="run", command=("/bin/sh", "-c", "echo x > /workspace/f")))
    assert sorted(os.listdir(ws_dir)) == []
    # an agent file that declares no durable workspace: nothing but its lock while it runs, and rm clears that
    _run(rt, _policy(_spec("wsl-nows", "  workspace: {enabled: false}\n", command='["/bin/true"]')))
    assert not list(ws_dir.glob("*.img")) and not _exists(rt, "wsl-nows")
    _cli("rm", "wsl-nows")
    assert sorted(os.listdir(ws_dir)) == []


def test_kept_workspace_survives_rm_until_workspace_rm(rt, capsys):
    ws_dir = rt.paths.workspaces
    _run(rt, _policy(_spec("wsl-keep", "  workspace: {keep: true}\n")))
    _run(rt, _policy(_spec("wsl-flag")))
    assert _cli("rm", "wsl-flag", "--keep-workspace") == 0
    assert _exists(rt, "wsl-flag") and _exists(rt, "wsl-keep")
    capsys.readouterr()
    assert _cli("workspace", "ls") == 0
    out = capsys.readouterr().out
    assert "wsl-flag" in out and "wsl-keep" in out and "(removed)" in out and "16.0M" in out
    assert _cli("workspace", "rm", "wsl-flag", "wsl-keep") == 0
    assert sorted(os.listdir(ws_dir)) == []


def test_a_running_agents_workspace_is_never_removed(rt):
    import threading

    ws_dir = rt.paths.workspaces
    pol = _policy(_spec("wsl-busy", command='["/bin/sh", "-c", "touch /workspace/started; sleep 3"]'))
    t = threading.Thread(target=_run, args=(rt, pol))
    t.start()
    try:
        deadline = time.monotonic() + 20
        top = rt.paths.runtime / "ws" / ("wsl-busy" if rt.backend_name == "image" else ".pool/wsl-busy")
        while not (top / "started").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _cli("workspace", "rm", "wsl-busy") == 77
        assert _cli("rm", "wsl-busy") == 77
        assert _cli("workspace", "prune", "--unused-for", "0") == 0  # skips it
        assert _exists(rt, "wsl-busy")
    finally:
        t.join()
    assert _cli("workspace", "rm", "wsl-busy") == 0
    assert sorted(os.listdir(ws_dir)) == []


def test_workspace_rm_on_a_full_disk_frees_it_and_records_after(tmp_path):
    """The full disk is when removing a workspace matters: the audit record that cannot be
    written first is written once the removal gave the space back. (The image backend: a 64M
    disk holds no pool; the pool's case is tests/integration/test_wspool.py.)"""
    import json as _json
    import secrets
    import sys

    home = Path(f"/tmp/agentvm-wsfull-{secrets.token_hex(4)}")
    home.mkdir(mode=0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0711", "tmpfs", str(home)], check=True)
    env = dict(os.environ, AGENTVM_HOME=str(home), AGENTVM_NO_DAEMON="1", AGENTVM_WORKSPACE_BACKEND="image")

    def av(*args):
        return subprocess.run([sys.executable, "-m", "agentvm", *args], env=env, capture_output=True, timeout=120)

    try:
        f = tmp_path / "a.yaml"
        f.write_text(_spec("wsl-full"))
        assert av("run", "-f", str(f)).returncode == 0
        subprocess.run(["dd", "if=/dev/zero", f"of={home}/fill", "bs=1M"], capture_output=True)  # until ENOSPC
        assert os.statvfs(home).f_bavail == 0
        r = av("workspace", "rm", "wsl-full")
        assert r.returncode == 0, r.stderr
        assert not (home / "workspaces" / "wsl-full.img").exists()
        assert os.statvfs(home).f_bavail * os.statvfs(home).f_frsize >= 15 * (1 << 20)
        recs = [_json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines()]
        rm = [x for x in recs if x["kind"] == "workspace.removed"]
        assert len(rm) == 1 and rm[0]["data"]["name"] == "wsl-full" and "disk was full" in rm[0]["data"]["recorded"]
        assert av("audit", "verify").returncode == 0
    finally:
        for d in (home / "run" / "ws").glob("*") if (home / "run" / "ws").is_dir() else ():
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        subprocess.run(["umount", "-l", str(home)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def test_rm_through_the_daemon_removes_the_workspace_unless_kept(fresh_home, monkeypatch):
    """The daemon's side of `agentvm rm` (DELETE /v1/sandboxes/NAME[?keep_workspace=1] calling
    agentvm.workspace.on_agent_removed): removed unless kept by the flag or the agent file.
    The default backend (the pool, where it runs)."""
    import sys

    from agentvm import workspace, wspool
    from agentvm.daemon.client import Client

    def names():
        return sorted(w.name for w in workspace.list_workspaces(ws_dir, runtime=fresh_home / "run"))

    monkeypatch.delenv("AGENTVM_NO_DAEMON", raising=False)
    monkeypatch.delenv("AGENTVM_WORKSPACE_BACKEND", raising=False)
    av = [sys.executable, "-m", "agentvm"]
    assert subprocess.run(av + ["up"], capture_output=True).returncode == 0
    ws_dir = fresh_home / "workspaces"
    try:
        c = Client()
        answers = {}
        for name, extra, keep in (("wsd-plain", "", False), ("wsd-spec", "  workspace: {keep: true}\n", False),
                                  ("wsd-flag", "", True)):
            c.create(_spec(name, "  lifecycle: persistent\n" + extra,
                           command="[/bin/sh, -c, 'head -c 100000 /dev/urandom > /workspace/f; sleep 300']"), "<test>")
            c.action(name, "start")
            assert name in names()
            c.action(name, "stop")
            answers[name] = c.rm(name, keep_workspace=keep)
        assert answers["wsd-plain"]["workspace"]["removed"] is True and answers["wsd-plain"]["workspace"]["bytes"] > 0
        assert answers["wsd-spec"]["workspace"]["kept"] is True and answers["wsd-flag"]["workspace"]["kept"] is True
        assert names() == ["wsd-flag", "wsd-spec"]
        recs = c.audit(None, "wsd-plain")
        assert [r["data"]["bytes"] for r in recs if r["kind"] == "workspace.removed"] == [
            answers["wsd-plain"]["workspace"]["bytes"]]
    finally:
        subprocess.run(av + ["down"], capture_output=True)
        for n in ("wsd-plain", "wsd-spec", "wsd-flag"):
            _cli("workspace", "rm", n)
        wspool.Pool(ws_dir, fresh_home / "run").teardown()
