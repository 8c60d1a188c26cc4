"""`cp` into/out of a workspace the agent controls: links, FIFOs and growing files planted by
the agent must neither escape the workspace nor hang or bloat the (root) daemon."""

from __future__ import annotations

import os
import threading

import pytest

from agentvm.daemon import files
from agentvm.errors import PolicyDenied


def _in_thread(fn, *args):
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{fn.__name__} blocked"
    return out


def test_write_and_read_back(tmp_path):
    assert files.write_beneath(tmp_path, "a/b/c.txt", b"payload", None) == 7
    assert files.read_beneath(tmp_path, "a/b/c.txt") == b"payload"
    files.write_beneath(tmp_path, "a/b/c.txt", b"x", None)
    assert (tmp_path / "a/b/c.txt").read_bytes() == b"x", "an existing file is replaced, not appended to"


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../x", "", "a\x00b"])
def test_paths_outside_are_refused(tmp_path, rel):
    with pytest.raises(PolicyDenied):
        files.write_beneath(tmp_path, rel, b"x", None)


def test_symlinks_anywhere_on_the_path_are_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "dirlink").symlink_to(outside)
    (ws / "filelink").symlink_to(outside / "f")
    for rel in ("dirlink/f", "filelink"):
        with pytest.raises(PolicyDenied):
            files.write_beneath(ws, rel, b"x", None)
    assert not (outside / "f").exists()


def test_a_planted_fifo_neither_blocks_nor_is_written(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    out = _in_thread(files.write_beneath, tmp_path, "pipe", b"x", None)  # nobody reading
    assert isinstance(out.get("error"), PolicyDenied), out
    rfd = os.open(tmp_path / "pipe", os.O_RDONLY | os.O_NONBLOCK)  # the agent holds it open
    try:
        out = _in_thread(files.write_beneath, tmp_path, "pipe", b"x", None)
        assert isinstance(out.get("error"), PolicyDenied), out
        assert os.read(rfd, 1) == b"", "nothing was written into it"
    finally:
        os.close(rfd)
    out = _in_thread(files.read_beneath, tmp_path, "pipe")
    assert isinstance(out.get("error"), PolicyDenied), out


def test_read_is_capped_even_if_the_file_grows(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE", 1000)
    (tmp_path / "big").write_bytes(b"x" * 1001)
    with pytest.raises(PolicyDenied):
        files.read_beneath(tmp_path, "big")
    # a file that looks small at fstat time but grows while it is read: the byte count, not
    # st_size, enforces the cap
    monkeypatch.setattr(files, "MAX_FILE", 10)
    real_fstat = os.fstat

    def lying_fstat(fd):
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 0,
                               st.st_atime, st.st_mtime, st.st_ctime))

    (tmp_path / "grows").write_bytes(b"y" * 50)
    monkeypatch.setattr(files.os, "fstat", lying_fstat)
    with pytest.raises(PolicyDenied):
        files.read_beneath(tmp_path, "grows")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_copy_into_a_full_workspace_leaves_nothing_behind(tmp_path):
    import subprocess

    from agentvm.errors import AgentVMError

    ws = tmp_path / "ws"
    ws.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ws)], check=True)
    try:
        (ws / "keep").write_bytes(b"old")
        with pytest.raises(AgentVMError) as ei:
            files.write_beneath(ws, "keep", b"x" * (3 << 20), uid=4321)
        assert ei.value.code == "files.no-space" and "nothing partial" in ei.value.message
        assert sorted(p.name for p in ws.iterdir()) == ["keep"] and (ws / "keep").read_bytes() == b"old"
        assert files.write_beneath(ws, "sub/new", b"y", uid=4321) == 1
        assert (ws / "sub" / "new").stat().st_uid == 4321 and (ws / "sub").stat().st_uid == 4321
    finally:
        subprocess.run(["umount", str(ws)], check=True)


def test_reading_a_missing_file_says_so(tmp_path):
    from agentvm.errors import AgentVMError

    with pytest.raises(AgentVMError) as ei:
        files.read_beneath(tmp_path, "nope/x")
    assert ei.value.code == "files.not-found" and ei.value.exit_code == 78
    with pytest.raises(AgentVMError) as ei:
        files.read_beneath(tmp_path, "x")
    assert ei.value.code == "files.not-found"


# -- folders as tar streams ---------------------------------------------------------------
def _tar(entries) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as tf:
        for name, kind, data in entries:
            ti = tarfile.TarInfo(name)
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif kind == "file":
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            elif kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, data
                tf.addfile(ti)
            elif kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, data
                tf.addfile(ti)
    return buf.getvalue()


def test_a_folder_goes_in_and_comes_out_whole(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    got = files.write_tree_beneath(ws, "src", _tar([("a", "dir", None), ("a/b.txt", "file", b"bee"),
                                                    ("top.txt", "file", b"top")]), None)
    assert got == {"files": 2, "dirs": 1, "bytes": 6}
    assert (ws / "src/a/b.txt").read_bytes() == b"bee" and (ws / "src/top.txt").read_bytes() == b"top"
    os.symlink("/etc/shadow", ws / "src/a/planted")  # the agent's link: left out, never followed
    data, counts = files.read_tree_beneath(ws, "src")
    assert counts == {"files": 2, "dirs": 1, "bytes": 6, "skipped": 1}
    import io
    import tarfile

    names = sorted(m.name for m in tarfile.open(fileobj=io.BytesIO(data)).getmembers())
    assert names == ["a", "a/b.txt", "top.txt"]
    assert files.is_dir_beneath(ws, "src") and not files.is_dir_beneath(ws, "src/top.txt")


@pytest.mark.parametrize("entries,why", [
    ([("../escape", "file", b"x")], "files.bad-path"),
    ([("/abs", "file", b"x")], "files.bad-path"),
    ([("ok", "file", b"x"), ("link", "symlink", "/etc/shadow")], "files.not-regular"),
    ([("ok", "file", b"x"), ("hard", "hardlink", "ok")], "files.not-regular"),
])
def test_an_archive_cannot_reach_out_and_nothing_is_written_when_refused(tmp_path, entries, why):
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(PolicyDenied) as e:
        files.write_tree_beneath(ws, "in", _tar(entries), None)
    assert e.value.code == why
    assert list(ws.iterdir()) == [] and not (tmp_path / "escape").exists()


def test_a_folder_reached_through_a_planted_link_is_refused(tmp_path):
    ws = tmp_path / "ws"
    (ws / "real").mkdir(parents=True)
    os.symlink(tmp_path, ws / "out")
    with pytest.raises(PolicyDenied):
        files.read_tree_beneath(ws, "out")
    with pytest.raises(PolicyDenied):
        files.write_tree_beneath(ws, "out/x", _tar([("f", "file", b"x")]), None)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("read", [files.read_beneath, files.open_beneath], ids=["read", "open"])
def test_reads_through_a_symlink_are_refused_and_read_nothing_outside(tmp_path, read):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("secret")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "dirlink").symlink_to(outside)
    (ws / "filelink").symlink_to(outside / "f")
    for rel in ("dirlink/f", "filelink"):
        with pytest.raises(PolicyDenied) as ei:
            read(ws, rel)
        assert ei.value.code == "files.symlink", (rel, ei.value.code)
