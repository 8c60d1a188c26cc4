"""`exec` enters a running sandbox through a pid. A pid is a number the kernel reuses: if the
cached one now belongs to a process of *another* sandbox, `exec` must refuse rather than run
the operator's command in the wrong sandbox."""

from __future__ import annotations

import os
import time

import pytest

from agentvm.policy import Policy
from agentvm.runtime import Runtime
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]


def _start(rt: Runtime, marker: str):
    policy = Policy(name="run", network="none", command=("/bin/sh", "-c", f"echo {marker} > /tmp/marker; exec sleep 60"))
    plan, res = rt.prepare(policy, tty=False)
    backend = rt.backend_for(policy)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        h = backend.launch(plan, stdio=(null, null, null))
    finally:
        os.close(null)
    try:
        backend.sandbox_pid(h)
        # the agent's first process exists; wait until its first line ran (the marker is there)
        deadline = time.monotonic() + 10
        while _exec(backend, h, ["/bin/test", "-s", "/tmp/marker"])[0].exit_code != 0:
            assert time.monotonic() < deadline, "the sandbox never wrote its marker"
            time.sleep(0.01)
    except BaseException:
        res.release(backend.destroy(h))
        raise
    return backend, h, res


def _exec(backend, h, argv):
    r, w = os.pipe()
    try:
        es = backend.exec(h, argv, stdio=(os.open(os.devnull, os.O_RDONLY), w, w), timeout=20)
    finally:
        os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    return es, out.decode(errors="replace")


def test_exec_refuses_a_pid_that_now_belongs_to_another_sandbox(avm_home):
    rt = Runtime()
    a = b = None
    try:
        a = _start(rt, "sandbox-A")
        b = _start(rt, "sandbox-B")
        backend, ha, _ = a
        es, out = _exec(backend, ha, ["/bin/cat", "/tmp/marker"])
        assert es.exit_code == 0 and out.strip() == "sandbox-A", (es, out)
        # A's first process is gone and its pid number now names B's agent
        ha.private["agent_pid"] = b[1].private["agent_pid"]
        es, out = _exec(backend, ha, ["/bin/cat", "/tmp/marker"])
        assert "sandbox-B" not in out, "exec ran in another sandbox"
        assert es.exit_code != 0 and es.setup_error and "no longer in the sandbox" in es.setup_error["message"], (es, out)
    finally:
        for s in (a, b):
            if s is not None:
                backend_, h, res = s
                res.release(backend_.destroy(h))
        rt.close()


def test_launch_and_exec_back_to_back_many_times(avm_home):
    """The status stream is read whole every time: 25 sandboxes launched and entered in a row,
    each torn down verified (a partial read once reported a running sandbox as not running)."""
    rt = Runtime()
    try:
        for i in range(25):
            backend, h, res = _start(rt, f"loop-{i}")
            try:
                es, out = _exec(backend, h, ["/bin/cat", "/tmp/marker"])
                assert es.exit_code == 0 and out.strip() == f"loop-{i}", (i, es, out)
            finally:
                report = backend.destroy(h)
                res.release(report)
            assert report.verified and not (report.processes_left or report.cgroups_left or report.mounts_left), (i, report)
    finally:
        rt.close()


def test_a_setup_failure_inside_bwrap_is_ours_not_the_commands_exit_code(avm_home):
    """bwrap forks the sandbox, then a mount fails in there (here: a source that does not
    exist): it exits 1, which must not pass for the command's own exit status."""
    import dataclasses

    rt = Runtime()
    try:
        policy = Policy(name="run", network="none", command=("/bin/true",))
        plan, res = rt.prepare(policy, tty=False)
        backend = rt.backend_for(policy)
        bw = list(plan.body.bwrap_args)
        i = bw.index("--remount-ro")
        bw[i:i] = ["--ro-bind", "/nonexistent-agentvm-source", "/x"]
        es, report = _run_plan(backend, dataclasses.replace(plan, body=dataclasses.replace(plan.body, bwrap_args=tuple(bw))),
                               res)
        assert es.exit_code == 125 and es.setup_error and es.setup_error["step"] == "bwrap-setup", es
        assert report.verified, report
        # and a command that really exits 1 still reports 1
        plan, res = rt.prepare(Policy(name="run", network="none", command=("/bin/sh", "-c", "exit 1")), tty=False)
        es, _ = _run_plan(backend, plan, res)
        assert es.exit_code == 1 and es.setup_error is None, es
    finally:
        rt.close()


def _run_plan(backend, plan, res):
    null = os.open(os.devnull, os.O_RDWR)
    try:
        h = backend.launch(plan, stdio=(null, null, null))
    finally:
        os.close(null)
    es = backend.wait(h)
    report = backend.destroy(h)
    res.release(report)
    return es, report
