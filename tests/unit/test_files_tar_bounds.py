"""Folder cp-out's tar (daemon.files.tar_tree_beneath) is bounded as a tar, not only by its
files' content (security review 2026-11-28, finding 5: hard links / empty files with long
names cost 0 content bytes but 1.5 KiB of pax+ustar headers each), with a member cap, and a deep
folder is a clear refusal (finding 7: it was RecursionError, answered as `internal`)."""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

from agentvm.daemon import files
from agentvm.errors import AgentVMError


def _many_empty(d, n: int, *, long: bool = True) -> None:
    d.mkdir()
    (d / "a").write_bytes(b"")
    for i in range(n):
        os.link(d / "a", d / (f"{i:06d}" + ("x" * 200 if long else "")))


def test_headers_count_against_the_limit(tmp_path):
    _many_empty(tmp_path / "h", 300)  # 0 content bytes, ~1.5 KiB of headers each: ~450 KiB of tar
    buf = io.BytesIO()
    with pytest.raises(AgentVMError) as ei:
        files.tar_tree_beneath(tmp_path, "h", buf, 100 * 1024)
    assert ei.value.code == "files.too-large", ei.value
    assert len(buf.getvalue()) <= 100 * 1024, "the tar passed its limit before the refusal"


def test_a_tar_that_fits_is_at_most_its_limit_and_complete(tmp_path):
    _many_empty(tmp_path / "h", 50)
    (tmp_path / "h" / "data").write_bytes(os.urandom(70_000))
    probe = io.BytesIO()
    files.tar_tree_beneath(tmp_path, "h", probe, 1 << 30)
    exact = len(probe.getvalue())
    buf = io.BytesIO()
    got = files.tar_tree_beneath(tmp_path, "h", buf, exact)  # exactly its size: allowed
    assert len(buf.getvalue()) == exact and got["files"] == 52 and got["bytes"] == 70_000
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        assert len(tf.getmembers()) == 52
    with pytest.raises(AgentVMError):
        files.tar_tree_beneath(tmp_path, "h", io.BytesIO(), exact - 1)


def test_in_memory_read_is_capped_by_its_tar_size(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE", 64 * 1024)
    _many_empty(tmp_path / "h", 200)
    with pytest.raises(AgentVMError) as ei:
        files.read_tree_beneath(tmp_path, "h")
    assert ei.value.code == "files.too-large"


def test_members_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_MEMBERS", 100)
    _many_empty(tmp_path / "h", 150, long=False)
    with pytest.raises(AgentVMError) as ei:
        files.tar_tree_beneath(tmp_path, "h", io.BytesIO(), 1 << 30)
    assert ei.value.code == "files.too-large" and "100 entries" in str(ei.value)


def _deep(base, levels: int) -> None:
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as fh:
            fh.write(b"bottom\n")
    finally:
        os.close(fd)


def _rm_deep(base) -> None:
    """Remove a chain of nested folders without recursion (shutil.rmtree recurses per level)."""
    fds = [os.open(base, os.O_RDONLY | os.O_DIRECTORY)]
    names: list[str] = []
    try:
        while True:
            sub = None
            for n in os.listdir(fds[-1]):
                if stat.S_ISDIR(os.stat(n, dir_fd=fds[-1], follow_symlinks=False).st_mode):
                    sub = n
                else:
                    os.unlink(n, dir_fd=fds[-1])
            if sub is None:
                break
            fds.append(os.open(sub, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
            names.append(sub)
        while names:
            os.close(fds.pop())
            os.rmdir(names.pop(), dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture
def deep_tmp():
    """Not under pytest's tmp_path: pytest's own clean-up of old runs (shutil.rmtree, recursive)
    would die on a deep tree left behind by a killed run, in every later session."""
    import shutil
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(prefix="agentvm-test-deep-"))
    (base / "deep").mkdir()
    try:
        yield base
    finally:
        _rm_deep(base / "deep")
        shutil.rmtree(base)


def test_a_deep_folder_is_a_clear_refusal_not_internal(deep_tmp):
    tmp_path = deep_tmp
    _deep(tmp_path / "deep", 1200)  # the review's depth (RecursionError before)
    before = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    with pytest.raises(AgentVMError) as ei:
        files.tar_tree_beneath(tmp_path, "deep", io.BytesIO(), 1 << 30)
    assert ei.value.code == "files.too-deep", ei.value
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) <= before, "dir fds leaked"


def test_a_folder_within_the_depth_is_copied_whole(deep_tmp):
    tmp_path = deep_tmp
    _deep(tmp_path / "deep", files.MAX_DEPTH - 2)
    buf = io.BytesIO()
    got = files.tar_tree_beneath(tmp_path, "deep", buf, 1 << 30)
    assert got["dirs"] == files.MAX_DEPTH - 2 and got["files"] == 1
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        m = [x for x in tf.getmembers() if x.isreg()][0]
        assert m.name == "/".join(["d"] * (files.MAX_DEPTH - 2)) + "/f"
        assert tf.extractfile(m).read() == b"bottom\n"
