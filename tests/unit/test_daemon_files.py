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
