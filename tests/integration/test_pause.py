"""pause/unpause at the backend level: the cgroup freezer stops every process of a real
sandbox where it is (memory kept, no CPU, the processes still there), and unpause lets them
go on from where they were - never called suspend (which would free host resources)."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import needs_root

pytestmark = [needs_root]

COUNTER = r"""
i=0
while [ $i -lt 100000 ]; do i=$((i+1)); echo $i > /out/c; sleep 0.01; done
"""


def _read(p: Path) -> int:
    for _ in range(50):
        try:
            return int(p.read_text().strip())
        except (OSError, ValueError):
            time.sleep(0.01)
    raise AssertionError(f"no counter in {p}")


def _state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


def _gvisor_unavailable() -> str | None:
    from tests.contract.conftest import skip_reason

    return skip_reason("gvisor")


@pytest.mark.parametrize("substrate", [
    "bwrap",
    pytest.param("gvisor", marks=pytest.mark.skipif(_gvisor_unavailable() is not None,
                                                    reason=str(_gvisor_unavailable()))),
])
def test_pause_freezes_every_process_and_unpause_continues(avm_home, substrate):
    from agentvm.policy import MountGrant, Policy
    from agentvm.runtime import Runtime

    out = Path(f"/tmp/agentvm-grant-{secrets.token_hex(4)}")
    out.mkdir(mode=0o755)
    seen: dict = {}

    def on_launch(backend, handle):
        try:
            c = out / "c"
            deadline = time.monotonic() + 20
            while not c.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            a = _read(c)
            backend.pause(handle)
            seen["paused"] = backend.paused(handle)
            group = handle.private["cgroup"]
            pids = sorted(group.pids())
            seen["pids"] = pids
            cpu0 = group.stats().get("cpu_time")
            b = _read(c)
            time.sleep(0.5)  # a running loop would have counted ~50 times
            seen["frozen_steady"] = _read(c) == b
            seen["cpu_steady"] = group.stats().get("cpu_time") == cpu0
            seen["alive"] = all(Path(f"/proc/{p}").exists() for p in pids)
            seen["states"] = {_state(p) for p in pids}
            backend.unpause(handle)
            seen["unpaused"] = not backend.paused(handle)
            time.sleep(0.3)
            seen["counts_again"] = _read(c) > b >= a
        finally:
            backend.stop(handle, grace=0.5)

    pol = Policy(name="run", command=("/bin/sh", "-c", COUNTER), mounts=(MountGrant(str(out), "/out", True),),
                 network="none", workspace=None, substrate=substrate)
    rt = Runtime()
    try:
        rt.run(pol, tty=False, stdio=(0, 1, 2), on_launch=on_launch)
    finally:
        rt.close()
        shutil.rmtree(out, ignore_errors=True)
    assert seen.get("paused") is True, seen
    assert seen["pids"], "the sandbox had processes"
    assert seen["frozen_steady"] and seen["alive"], seen
    assert seen["cpu_steady"], seen  # no CPU while paused (None == None where the host does not account it)
    assert seen["unpaused"] and seen["counts_again"], seen


def test_pause_without_a_running_sandbox_is_refused(avm_home):
    from agentvm.backends.bwrap import BwrapBackend
    from agentvm.backends.base import SandboxHandle
    from agentvm.errors import AgentVMError
    from agentvm.paths import default_paths

    b = BwrapBackend(default_paths())
    h = SandboxHandle("x", None, started_at=0.0, private={})
    with pytest.raises(AgentVMError):
        b.pause(h)
    assert b.paused(h) is False
