"""A deep folder in the workspace (security review 2026-11-28, finding 7: 1 200 levels made
snapshot and fork fail with `internal: RecursionError`): the snapshot walk is iterative, a
tree within the depth is snapshotted and restored whole, a deeper one is a clear
snapshot.too-deep with nothing left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agentvm import snapshot
from agentvm.errors import AgentVMError
from test_files_tar_bounds import _deep, _rm_deep


@pytest.fixture
def ws():
    """Not under pytest's tmp_path (its clean-up recurses per level)."""
    base = Path(tempfile.mkdtemp(prefix="agentvm-test-deep-"))
    (base / "w").mkdir()
    (base / "w" / "deep").mkdir()
    (base / "w" / "top.txt").write_text("top\n")
    try:
        yield base
    finally:
        for d in (base / "w" / "deep", base / "r" / "deep"):
            if d.exists():
                _rm_deep(d)
        shutil.rmtree(base)


def _fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def test_a_deep_folder_is_a_clear_refusal(ws):
    _deep(ws / "w" / "deep", 1200)  # the review's depth
    before = _fds()
    with open(ws / "out.tar", "wb") as out, pytest.raises(AgentVMError) as ei:
        snapshot.tar_workspace(ws / "w", out, limit=1 << 30)
    assert ei.value.code == "snapshot.too-deep", ei.value
    assert _fds() <= before, "dir fds leaked"


def test_a_long_path_within_the_depth_is_a_clear_refusal(ws):
    d = ws / "w" / "deep"
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(20):  # 20 levels of 200-byte names: a 4 000-byte path, past what restore can extract
        os.mkdir("n" * 200, dir_fd=fd)
        nfd = os.open("n" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    with open(ws / "out.tar", "wb") as out, pytest.raises(AgentVMError) as ei:
        snapshot.tar_workspace(ws / "w", out, limit=1 << 30)
    assert ei.value.code == "snapshot.too-deep"


def test_a_tree_within_the_depth_is_snapshotted_and_restored_whole(ws):
    _deep(ws / "w" / "deep", snapshot.MAX_DEPTH - 2)
    with open(ws / "out.tar", "wb") as out:
        digest, _n, files, skipped = snapshot.tar_workspace(ws / "w", out, limit=1 << 30)
    assert files == 2 and skipped == 0
    (ws / "r").mkdir()
    snapshot.untar_into(ws / "out.tar", digest, ws / "r", None, None, replace=True)
    assert (ws / "r" / "top.txt").read_text() == "top\n"
    fd = os.open(ws / "r" / "deep", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(snapshot.MAX_DEPTH - 2):
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("f", os.O_RDONLY, dir_fd=fd), "rb") as fh:
            assert fh.read() == b"bottom\n"
    finally:
        os.close(fd)
