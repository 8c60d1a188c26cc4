"""The staged copies of `agentvm cp` (daemon.commands): a failure closes the staged file, and
the state disk filling while a copy is staged or packed is `state.disk-full`, saying which."""

import errno
import os
from pathlib import Path

import pytest

from agentvm.daemon.commands import _closed_on_failure
from agentvm.errors import AgentVMError


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_state_disk_full_names_the_copy_and_closes_the_file(err):
    r, w = os.pipe()
    os.close(w)
    done = 1
    with pytest.raises(AgentVMError) as info:
        with _closed_on_failure(r, Path("/srv/agentvm"), lambda: f"{done} bytes of the copy were staged"):
            done = 3  # what() is asked when it fails, not when the block begins
            raise OSError(err, os.strerror(err))
    assert info.value.code == "state.disk-full"
    assert str(info.value) == "the daemon's state disk filled while 3 bytes of the copy were staged"
    assert info.value.hint == "free space on the disk of /srv/agentvm"
    assert not _is_open(r)


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "I/O error"), ValueError("bad"), KeyboardInterrupt()])
def test_other_failures_pass_through_and_close_the_file(exc):
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(type(exc)) as info:
        with _closed_on_failure(r, Path("/srv/agentvm"), lambda: "x"):
            raise exc
    assert info.value is exc
    assert not _is_open(r)


def test_success_keeps_the_file_open():
    r, w = os.pipe()
    os.close(w)
    try:
        with _closed_on_failure(r, Path("/srv/agentvm"), lambda: "x"):
            pass
        assert _is_open(r)
    finally:
        os.close(r)
