"""Workspace lifecycle (issue 42): list, remove, prune, `rm` with and without keeping, the
disk they commit - the library (agentvm.workspace) and the CLI (`agentvm workspace ...`,
`agentvm rm`, `doctor`, `/metrics`). No mounts here: images are plain files, fully
allocated like the real ones; "in use" is the agent's lock held, as a running sandbox holds it."""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from pathlib import Path

import pytest

from agentvm import workspace as ws
from agentvm.errors import EXIT_CONFIG, EXIT_POLICY, ConfigError, PolicyDenied

MiB = 1 << 20
DAY = 86400.0


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("AGENTVM_HOME", str(h))
    monkeypatch.setenv("AGENTVM_NO_DAEMON", "1")
    (h / "workspaces").mkdir(parents=True)
    getattr(ws, "_cache_clear", lambda: None)()  # (absent before issue 42)
    return h


def make_image(home: Path, name: str, size: int = 2 * MiB, *, age: float = 0.0, reserve: bool = True) -> Path:
    img = home / "workspaces" / f"{name}.img"
    with open(img, "wb") as fh:
        fh.truncate(size)
        if reserve:
            os.posix_fallocate(fh.fileno(), 0, size)
    (home / "workspaces" / f"{name}.lock").touch()
    if age:
        t = time.time() - age
        os.utime(img, (t, t))
    return img


def hold(home: Path, name: str) -> int:
    """What a running sandbox of ``name`` holds."""
    fd = os.open(home / "workspaces" / f"{name}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def register(home: Path, *names: str) -> None:
    """Agents registered with the daemon (its state table, as daemon/state.py makes it)."""
    from agentvm.daemon.state import State

    st = State(home / "daemon.db")
    for n in names:
        st.create(n, "apiVersion: agentvm/v1\n", "<t>", "persistent", None, None)
    st.close()


def cli(*args) -> int:
    from agentvm.cli.app import cli_main

    return cli_main(list(args))


def audit_records(home: Path, kind: str) -> list[dict]:
    db = home / "audit" / "audit.db"
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    try:
        return [dict(json.loads(d), _sandbox=s, _actor=a)
                for d, s, a in con.execute("SELECT data, sandbox, actor FROM audit WHERE kind=? ORDER BY seq", (kind,))]
    finally:
        con.close()


# ------------------------------------------------------------------------------ library


def test_list_reports_size_used_last_use_owner_and_in_use(home):
    make_image(home, "alpha", 4 * MiB, age=3 * DAY)
    make_image(home, "beta", 8 * MiB, reserve=False)  # sparse: committed, not used
    (home / "workspaces" / "nows.lock").touch()  # an agent without a workspace: not a workspace
    (home / "workspaces" / "half.img.tmp").write_bytes(b"x")  # a half-made image: not one either
    register(home, "beta")
    fd = hold(home, "beta")
    try:
        rows = {w.name: w for w in ws.list_workspaces(home / "workspaces", owners=ws.registered_agents(home))}
    finally:
        os.close(fd)
    assert set(rows) == {"alpha", "beta"}
    a, b = rows["alpha"], rows["beta"]
    assert (a.size, a.kind, a.owner, a.in_use) == (4 * MiB, "image", None, False)
    assert a.used >= 4 * MiB and a.used == (home / "workspaces" / "alpha.img").stat().st_blocks * 512
    assert abs(a.last_use - (time.time() - 3 * DAY)) < 60
    assert (b.size, b.owner, b.in_use) == (8 * MiB, "beta", True)
    assert b.used < MiB  # sparse


def test_listing_never_takes_a_lock(home, monkeypatch):
    """A look that took the agent's lock, even for a moment, could make a sandbox starting then
    fail with "already running": in use is read from /proc/locks."""
    make_image(home, "looked")
    make_image(home, "held")
    fd = hold(home, "held")
    try:
        monkeypatch.setattr(ws.fcntl, "flock", lambda *a: pytest.fail("list_workspaces took a lock"))
        rows = {w.name: w.in_use for w in ws.list_workspaces(home / "workspaces")}
    finally:
        os.close(fd)
    assert rows == {"looked": False, "held": True}


def test_remove_frees_the_image_and_lock_and_records_first(home):
    img = make_image(home, "gone", 4 * MiB)
    seen = []
    freed = ws.remove_workspace(home / "workspaces", "gone", record=lambda k, d: seen.append((k, d, img.exists())))
    assert freed >= 4 * MiB
    assert not img.exists() and not (home / "workspaces" / "gone.lock").exists()
    assert seen == [("workspace.removed", {"name": "gone", "bytes": freed, "size": 4 * MiB}, True)]  # before the unlink


def test_remove_on_a_full_disk_records_after_and_anything_else_refuses(home):
    img = make_image(home, "full")
    calls = []

    def record(kind, data):
        calls.append(dict(data))
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")

    assert ws.remove_workspace(home / "workspaces", "full", record=record) > 0
    assert not img.exists()  # removing it is what gives the space back
    assert len(calls) == 2 and calls[1]["name"] == "full" and "disk was full" in calls[1]["recorded"]
    img = make_image(home, "other")

    def broken(kind, data):
        raise sqlite3.DatabaseError("file is not a database")

    with pytest.raises(sqlite3.DatabaseError):
        ws.remove_workspace(home / "workspaces", "other", record=broken)
    assert img.exists()  # not recorded, not removed


def test_remove_refuses_a_workspace_in_use_and_keeps_it(home):
    img = make_image(home, "busy")
    fd = hold(home, "busy")
    try:
        with pytest.raises(PolicyDenied) as e:
            ws.remove_workspace(home / "workspaces", "busy", record=lambda *a: pytest.fail("recorded"))
        assert e.value.code == "workspace.in-use" and e.value.exit_code == EXIT_POLICY
        assert img.exists()
    finally:
        os.close(fd)
    ws.remove_workspace(home / "workspaces", "busy")
    assert not img.exists()


def test_remove_refuses_a_mounted_one(home, monkeypatch):
    img = make_image(home, "mnt")
    monkeypatch.setattr(ws, "_attached", lambda: {str(img)})  # attached to a loop device
    with pytest.raises(PolicyDenied):
        ws.remove_workspace(home / "workspaces", "mnt")
    assert img.exists()


def test_remove_unknown_or_bad_names(home):
    with pytest.raises(ConfigError) as e:
        ws.remove_workspace(home / "workspaces", "nothing")
    assert e.value.code == "workspace.not-found" and e.value.exit_code == EXIT_CONFIG
    for bad in ("../x", "A", "", "a/b", "x" * 70):
        with pytest.raises(ConfigError):
            ws.remove_workspace(home / "workspaces", bad)


def test_a_lock_unlinked_under_its_opener_is_not_taken(home, monkeypatch):
    """remove_workspace unlinks the lock while holding it: a sandbox that opened the old file
    before and flocks it after must not believe it holds the agent's lock."""
    d = home / "workspaces"
    lock = d / "race.lock"
    lock.touch()
    real_flock = fcntl.flock
    done = []

    def flock(fd, op):
        real_flock(fd, op)
        if not done:  # between our open and our flock, the file was removed
            done.append(1)
            lock.unlink()

    monkeypatch.setattr(ws.fcntl, "flock", flock)
    fd = ws.lock_agent(d, "race", "why", "hint")
    try:
        assert os.fstat(fd).st_ino == lock.stat().st_ino  # the lock at the path, not the unlinked one
    finally:
        os.close(fd)


def test_prune_removes_exactly_the_unused_ones(home):
    d = home / "workspaces"
    make_image(home, "old1", age=10 * DAY)
    make_image(home, "old2", age=8 * DAY)
    make_image(home, "recent", age=2 * DAY)
    make_image(home, "fresh")
    make_image(home, "oldbusy", age=30 * DAY)
    make_image(home, "oldowned", age=30 * DAY)
    register(home, "oldowned")
    owners = ws.registered_agents(home)
    fd = hold(home, "oldbusy")
    try:
        dry = ws.prune(d, 7 * DAY, owners=owners, dry_run=True)
        assert sorted(n for n, _ in dry) == ["old1", "old2"]
        assert len(list(d.glob("*.img"))) == 6
        seen = []
        out = ws.prune(d, 7 * DAY, owners=owners, record=lambda k, data: seen.append(data["name"]))
    finally:
        os.close(fd)
    assert sorted(n for n, _ in out) == ["old1", "old2"] and all(b >= 2 * MiB for _, b in out)
    assert sorted(seen) == ["old1", "old2"]
    assert sorted(p.stem for p in d.glob("*.img")) == ["fresh", "oldbusy", "oldowned", "recent"]
    with pytest.raises(PolicyDenied):  # owners unknown (state unreadable): nothing pruned
        ws.prune(d, 0, owners=None)


def test_last_use_is_set_when_a_sandbox_takes_and_releases_it(home):
    """acquire (without a quota: a plain directory, so no mount needed) touches the workspace."""
    d = home / "workspaces"
    lease = ws.acquire(d, home / "run", "toucher", uid=os.getuid(), gid=os.getgid(), size=MiB, enforce_quota=False)
    old = time.time() - 30 * DAY
    os.utime(d / "toucher", (old, old))
    lease.release()
    assert time.time() - (d / "toucher").stat().st_mtime < 60
    assert [w.name for w in ws.prune(d, 7 * DAY, owners=set())] == []


def test_on_agent_removed_keeps_when_asked_or_declared(home):
    d = home / "workspaces"
    make_image(home, "k1")
    assert ws.on_agent_removed(d, "k1", keep=True) == {"removed": False, "kept": True, "bytes": 0}
    spec = "apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: k1}\nspec:\n  workspace: {keep: true}\n"
    assert ws.on_agent_removed(d, "k1", spec_text=spec)["kept"] is True
    assert (d / "k1.img").exists()
    r = ws.on_agent_removed(d, "k1", spec_text=spec.replace("keep: true", "keep: false"))
    assert r["removed"] is True and r["bytes"] >= 2 * MiB and not (d / "k1.img").exists()
    (d / "nows.lock").touch()  # an agent without a workspace: its lock goes too
    assert ws.on_agent_removed(d, "nows") == {"removed": False, "kept": False, "bytes": 0}
    assert not (d / "nows.lock").exists()


def test_usage_sums_and_warns_past_90_percent(home, monkeypatch):
    d = home / "workspaces"
    make_image(home, "u1", 4 * MiB)
    make_image(home, "u2", 8 * MiB, reserve=False)
    u = ws.usage(d)
    assert (u.count, u.committed) == (2, 12 * MiB)
    assert 4 * MiB <= u.used < 5 * MiB
    assert u.fs_free > 0 and not u.warnings

    class Full:
        f_blocks, f_bfree, f_bavail, f_frsize = 1000, 50, 40, 4096

    monkeypatch.setattr(ws.os, "statvfs", lambda p: Full)
    u = ws.usage(d)
    assert u.fs_free == 40 * 4096 and u.fs_use > 0.9
    assert len(u.warnings) == 1 and "96% full" in u.warnings[0] and "prune" in u.warnings[0]


def test_usage_of_5000_workspaces_is_cheap_and_cached(home, monkeypatch):
    d = home / "workspaces"
    for i in range(5000):
        with open(d / f"w{i}.img", "wb") as fh:
            fh.truncate(16 * MiB)  # sparse: 5000 of them cost nothing on this disk
    t0 = time.perf_counter()
    u = ws.usage(d)
    took = time.perf_counter() - t0
    assert u.count == 5000 and u.committed == 5000 * 16 * MiB
    assert took < 1.0, took
    calls = []
    real = ws.usage
    monkeypatch.setattr(ws, "usage", lambda p: calls.append(p) or real(p))
    for _ in range(20):
        ws.cached_usage(d, 5.0)
    assert len(calls) <= 1


def test_metrics_expose_workspace_gauges(home):
    from prometheus_client.parser import text_string_to_metric_families

    from agentvm.observe.metrics import Observer

    make_image(home, "m1", 4 * MiB)
    o = Observer(sandboxes_by_state=dict, approvals_pending=lambda: None, audit_status=lambda: (0, True),
                 workspace_dir=home / "workspaces")
    fams = {f.name: f for f in text_string_to_metric_families(o.exposition().decode())}
    by_kind = {s.labels["kind"]: s.value for s in fams["agentvm_workspace_bytes"].samples}
    assert by_kind["committed"] == 4 * MiB and by_kind["used"] >= 4 * MiB
    assert fams["agentvm_workspace_disk_free_bytes"].samples[0].value > 0
    # the daemon's Observer as constructed today (no workspace_dir): the installation's own
    o = Observer(sandboxes_by_state=dict, approvals_pending=lambda: None, audit_status=lambda: (0, True))
    getattr(ws, "_cache_clear", lambda: None)()  # (absent before issue 42)
    fams = {f.name: f for f in text_string_to_metric_families(o.exposition().decode())}
    assert {s.labels["kind"]: s.value for s in fams["agentvm_workspace_bytes"].samples}["committed"] == 4 * MiB


# ------------------------------------------------------------------------------ spec


def test_spec_workspace_keep():
    from agentvm.errors import SpecError
    from agentvm.spec.loader import load_agent_text

    base = "apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: s1}\nspec:\n"
    assert load_agent_text(base + "  command: [\"true\"]\n").spec.spec.workspace.keep is False
    assert load_agent_text(base + "  workspace: {keep: true}\n").spec.spec.workspace.keep is True
    with pytest.raises(SpecError) as e:
        load_agent_text(base + "  workspace: {keep: true, enabled: false}\n")
    assert "keep" in str(e.value)
    with pytest.raises(SpecError):
        load_agent_text(base + "  workspace: {keep: maybe}\n")
    from agentvm.spec import schema

    assert schema.json_schema()["$defs"]["Workspace"]["properties"]["keep"]["type"] == "boolean"


# ------------------------------------------------------------------------------ CLI


def test_cli_ls_shows_name_size_used_last_use_and_owner(home, capsys):
    make_image(home, "mine", 4 * MiB, age=2 * DAY)
    make_image(home, "orphan", 2 * MiB, age=3600)
    register(home, "mine")
    assert cli("workspace", "ls") == 0
    out = capsys.readouterr().out
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln and not ln.startswith("NAME")}
    assert line["mine"].split()[1:] == ["4.0M", "4.0M", "2d", "ago", "mine"]
    assert line["orphan"].split()[1:] == ["2.0M", "2.0M", "1h", "ago", "(removed)"]
    assert "6.0M committed" in out
    assert cli("workspace", "ls", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert {w["name"]: w["owner"] for w in doc["workspaces"]} == {"mine": "mine", "orphan": None}
    assert doc["usage"]["committed"] == 6 * MiB


def test_cli_workspace_rm_audits_and_refuses_in_use_or_owned(home, capsys):
    make_image(home, "a1", 4 * MiB)
    make_image(home, "a2")
    make_image(home, "owned")
    register(home, "owned")
    fd = hold(home, "a2")
    try:
        assert cli("workspace", "rm", "a2") == EXIT_POLICY
    finally:
        os.close(fd)
    assert cli("workspace", "rm", "owned") == EXIT_POLICY
    assert cli("workspace", "rm", "a1") == 0
    assert "a1: workspace removed (4.0M freed)" in capsys.readouterr().out
    assert sorted(p.stem for p in (home / "workspaces").glob("*.img")) == ["a2", "owned"]
    recs = audit_records(home, "workspace.removed")
    assert len(recs) == 1 and recs[0]["name"] == "a1" and recs[0]["bytes"] >= 4 * MiB and recs[0]["_sandbox"] == "a1"
    assert recs[0]["_actor"].startswith("cli:")
    assert cli("workspace", "rm", "nope") == EXIT_CONFIG


def test_cli_prune(home, capsys):
    make_image(home, "p-old", age=9 * DAY)
    make_image(home, "p-new", age=1 * DAY)
    assert cli("workspace", "prune", "--unused-for", "7d", "--dry-run") == 0
    assert len(list((home / "workspaces").glob("*.img"))) == 2
    assert cli("workspace", "prune", "--unused-for", "7d", "--json") == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert [r["name"] for r in json.loads(out)["removed"]] == ["p-old"]
    assert [p.stem for p in (home / "workspaces").glob("*.img")] == ["p-new"]
    assert [r["name"] for r in audit_records(home, "workspace.removed")] == ["p-old"]


def test_cli_workspace_group_and_its_usage_errors_exit_78(home, capsys):
    assert cli("workspace", "--help") == 0 and cli("rm", "--help") == 0
    help_text = capsys.readouterr().out
    assert "prune" in help_text and "--keep-workspace" in help_text
    for args in (["workspace", "prune"], ["workspace", "prune", "--unused-for", "soon"], ["workspace", "rm"],
                 ["workspace", "bogus"], ["rm", "x", "--keep"], ["workspace", "ls", "--all"]):
        assert cli(*args) == EXIT_CONFIG, args


def test_cli_rm_without_a_daemon_removes_the_workspace_unless_kept(home, capsys):
    make_image(home, "r1", 4 * MiB)
    make_image(home, "r2")
    assert cli("rm", "r2", "--keep-workspace") == 0
    assert "r2: workspace kept" in capsys.readouterr().out
    assert (home / "workspaces" / "r2.img").exists()
    assert cli("rm", "r1") == 0
    assert "r1: workspace removed (4.0M freed)" in capsys.readouterr().out
    assert not (home / "workspaces" / "r1.img").exists()
    assert [r["name"] for r in audit_records(home, "workspace.removed")] == ["r1"]
    assert cli("rm", "r1") == EXIT_CONFIG  # nothing left of it
    register(home, "r2")  # registered with a daemon that is down: its rm is the daemon's
    assert cli("rm", "r2") == EXIT_CONFIG
    assert (home / "workspaces" / "r2.img").exists()


def test_client_rm_asks_the_daemon_to_keep_only_when_told(monkeypatch):
    from agentvm.daemon.client import Client

    sent = []
    monkeypatch.setattr(Client, "request", lambda self, m, p, doc=None, **kw: sent.append((m, p)) or {"removed": "x"})
    c = Client("/nonexistent.sock")
    c.rm("x")
    c.rm("x", keep_workspace=True)
    assert sent == [("DELETE", "/v1/sandboxes/x"), ("DELETE", "/v1/sandboxes/x?keep_workspace=1")]


def test_cli_rm_through_a_daemon_passes_the_flag_and_says_what_happened(home, monkeypatch, capsys):
    from agentvm.daemon.client import Client

    sent = []

    def request(self, m, p, doc=None, **kw):
        sent.append(p)
        return {"removed": "d1", "workspace": {"removed": "keep" not in p, "kept": "keep" in p, "bytes": 16 * MiB}}

    monkeypatch.setattr(Client, "request", request)
    assert cli("rm", "d1") == 0
    assert "d1: removed (workspace removed (16.0M freed))" in capsys.readouterr().out
    assert cli("rm", "d1", "--keep-workspace") == 0
    assert "d1: removed (workspace kept)" in capsys.readouterr().out
    assert sent == ["/v1/sandboxes/d1", "/v1/sandboxes/d1?keep_workspace=1"]


@pytest.fixture
def traversable_home(monkeypatch):
    """A home the doctor's backend accepts (every parent traversable)."""
    import secrets
    import shutil

    h = Path(f"/tmp/agentvm-wstest-{secrets.token_hex(4)}")
    (h / "workspaces").mkdir(parents=True)
    os.chmod(h, 0o711)
    monkeypatch.setenv("AGENTVM_HOME", str(h))
    getattr(ws, "_cache_clear", lambda: None)()  # (absent before issue 42)
    yield h
    shutil.rmtree(h, ignore_errors=True)


def test_doctor_reports_workspace_disk_and_warns_without_failing(traversable_home, monkeypatch, capsys):
    import agentvm.doctor as doctor

    home = traversable_home
    make_image(home, "dw", 4 * MiB)

    class Full:
        f_blocks, f_bfree, f_bavail, f_frsize = 1000, 30, 20, 4096

    rep = doctor.run_doctor(smoke=False)
    assert rep.workspaces["committed"] == 4 * MiB and rep.workspaces["fs_free"] > 0
    ok_before = rep.ok
    monkeypatch.setattr(ws.os, "statvfs", lambda p: Full)
    rep = doctor.run_doctor(smoke=False)
    d = rep.to_dict()
    assert d["workspaces"]["used"] >= 4 * MiB and d["warnings"] and "98% full" in d["warnings"][0]
    assert rep.ok == ok_before  # a warning, never a failure
    from agentvm.cli.doctor_cmd import _workspaces

    _workspaces(d["workspaces"])
    out = capsys.readouterr().out
    assert "4.0M committed" in out and "warning:" in out


def test_up_warns_past_90_percent(home, monkeypatch, capsys):
    from agentvm.cli.daemon_cmds import _warn_workspace_disk
    from agentvm.paths import default_paths

    _warn_workspace_disk(default_paths())
    assert "warning" not in capsys.readouterr().err

    class Full:
        f_blocks, f_bfree, f_bavail, f_frsize = 1000, 30, 20, 4096

    monkeypatch.setattr(ws.os, "statvfs", lambda p: Full)
    _warn_workspace_disk(default_paths())
    assert "agentvm: warning: the filesystem holding" in capsys.readouterr().err
