"""The substrate contract (see conftest): the same tests for fake, bwrap and gvisor."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from agentvm.errors import AgentVMError, EXIT_TIMEOUT

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("script, code", [("exit 0", 0), ("exit 3", 3), ("exit 126", 126), ("false", 1)])
def test_exit_codes_propagate(sub, script, code):
    res, out, err = sub.run(["/bin/sh", "-c", script])
    assert res.exit_code == code, (res, out, err)
    assert res.teardown["verified"], res.teardown
    assert res.substrate == sub.name


def test_a_missing_command_is_127(sub):
    res, out, err = sub.run(["/nonexistent/agentvm-no-such-program"])
    assert res.exit_code == 127, (res, out, err)
    assert res.teardown["verified"]


def test_timeout_is_124_and_tears_down(sub):
    from agentvm.policy import Limits

    res, out, err = sub.run(["/bin/sh", "-c", "sleep 30"], limits=Limits(timeout=1.0))
    assert res.exit_code == EXIT_TIMEOUT and res.timed_out, (res, err)
    assert res.duration < 20
    assert res.teardown["verified"], res.teardown


def test_stop_then_verified_destroy(sub):
    lc, s = sub.start(["/bin/sh", "-c", "sleep 60"])
    try:
        assert not s.backend.poll(s.handle), "running"
        info = s.backend.inspect(s.handle)
        assert info["running"] is True and info["uptime"] >= 0
        lc.stop(s, grace=1.0)
        assert s.backend.poll(s.handle), "stopped"
        status = lc.wait(s, 10)
        assert status.exit_code in (143, 137) or status.signal in (15, 9), status
    finally:
        lc.teardown(s)
    assert s.report is not None and s.report.verified, s.report
    if sub.real:
        assert not (sub.rt.paths.sandboxes / s.sandbox_id).exists(), "the run dir is gone"
        res = lc.result(s)
        assert res.teardown["verified"]


def test_wait_async_awaits_the_exit(sub):
    import asyncio

    lc, s = sub.start(["/bin/sh", "-c", "exit 7"])
    try:
        status = asyncio.run(asyncio.wait_for(lc.wait_async(s), 30))
        assert status.exit_code == 7, status
    finally:
        lc.teardown(s)
    assert s.report.verified


def test_exec_stdio_exit_code_and_timeout(sub):
    lc, s = sub.start(["/bin/sh", "-c", "sleep 60"])
    try:
        es, out = sub.exec(s, ["/bin/sh", "-c", "echo hello-from-exec"], timeout=30)
        assert es.exit_code == 0 and "hello-from-exec" in out, (es, out)
        es, out = sub.exec(s, ["/bin/sh", "-c", "exit 5"], timeout=30)
        assert es.exit_code == 5, (es, out)
        es, out = sub.exec(s, ["/bin/sh", "-c", "sleep 30"], timeout=1)
        assert es.exit_code == EXIT_TIMEOUT and es.timed_out, es
        assert not s.backend.poll(s.handle), "an exec's timeout does not end the sandbox"
    finally:
        lc.stop(s, 1.0)
        lc.teardown(s)
    assert s.report.verified, s.report


def test_exec_runs_as_the_agent_with_the_sandbox_environment(real):
    lc, s = real.start(["/bin/sh", "-c", "sleep 60"], env=(("CONTRACT_MARK", "m-41"),))
    try:
        es, out = real.exec(s, ["/bin/sh", "-c", "id -u; echo $CONTRACT_MARK; cat /proc/self/status | grep ^Seccomp"],
                            timeout=30)
        lines = out.split()
        assert es.exit_code == 0 and lines[0] == "1000" and "m-41" in lines, (es, out)
        assert "2" in lines[lines.index("Seccomp:") + 1], "exec'd processes are under the same seccomp filter"
    finally:
        lc.stop(s, 1.0)
        lc.teardown(s)


def test_a_failed_launch_leaves_nothing(real, grant_dir):
    from agentvm.policy import MountGrant

    d = grant_dir()
    lc_s = None
    from agentvm.lifecycle import EmbeddedGateHost, Lifecycle

    lc = Lifecycle(real.rt, EmbeddedGateHost(real.rt))
    s = lc.prepare(real.policy(["/bin/true"], mounts=(MountGrant(str(d), "/data", False),), risk_tier="L2"))
    lc_s = s
    os.rmdir(d)  # gone between the checks and the launch
    with pytest.raises(AgentVMError) as ei:
        lc.launch(s)
    assert "cannot open" in ei.value.message or "changed" in ei.value.message, ei.value.message
    lc.teardown(lc_s)
    assert not (real.rt.paths.sandboxes / s.sandbox_id).exists(), "no run dir"
    from agentvm import cgroups as cg

    layout = cg.detect()
    roots = ([layout.v2_root] if layout.v2_root else []) + list(layout.v1.values())
    left = [str(r / cg.PARENT / s.sandbox_id) for r in roots if (r / cg.PARENT / s.sandbox_id).exists()]
    assert not left, f"cgroups left behind: {left}"


# ---------------------------------------------------------------------------- isolation


def test_memory_limit_is_enforced(real):
    from agentvm.policy import Limits

    res, out, err = real.run(["/usr/bin/python3", "-c", "b = bytearray(400 * 1024 * 1024); print('ALLOCATED')"],
                             limits=Limits(memory=96 * 1024**2, timeout=60))
    assert "ALLOCATED" not in out, "400 MB fitted in a 96 MB sandbox"
    assert res.exit_code != 0
    assert res.oom_killed or res.exit_code in (137, 1), (res, err[-400:])
    assert res.teardown["verified"]


def test_task_limit_stops_a_fork_bomb_and_the_host_survives(real):
    from agentvm.policy import Limits

    script = ("import os,time\nn=0\ntry:\n  for i in range(400):\n    if os.fork()==0:\n      time.sleep(30); os._exit(0)\n"
              "    n+=1\nexcept OSError as e:\n  print('REFUSED', n, e.errno)\n")
    res, out, err = real.run(["/usr/bin/python3", "-c", script], limits=Limits(pids=64, timeout=60))
    assert "REFUSED" in out or res.pids_limit_hit, (res, out, err[-400:])
    assert res.teardown["verified"], res.teardown


def test_the_gate_is_the_only_way_out(real, tmp_path):
    """A server on the host's loopback is unreachable directly; through the proxy, a host no
    rule allows is refused by the gate, with its reason."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    hits: list[bytes] = []

    def accept():
        srv.settimeout(30)
        try:
            c, _ = srv.accept()
            hits.append(c.recv(100))
            c.close()
        except OSError:
            pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = f"""
import os, socket, urllib.request, urllib.error
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=3); s.sendall(b"DIRECT"); print("DIRECT-CONNECTED")
except OSError as e:
    print("DIRECT-REFUSED", e.errno)
try:
    urllib.request.urlopen("http://not-allowed.contract.test:{port}/x", timeout=10); print("PROXY-ALLOWED")
except urllib.error.HTTPError as e:
    print("PROXY-DENIED", e.code)
except OSError as e:
    print("PROXY-ERROR", e)
"""
    res, out, err = real.run(["/usr/bin/python3", "-c", code], network="gate")  # no rule: deny all
    srv.close()
    t.join(5)
    assert "DIRECT-CONNECTED" not in out and "DIRECT-REFUSED" in out, (out, err)
    assert "PROXY-DENIED 403" in out, (out, err)
    assert not hits, f"the host's server was reached: {hits}"
    denied = (res.egress or {}).get("denied") or []
    assert any(d["target"].startswith("not-allowed.contract.test") for d in denied), res.egress


def test_grants_read_only_and_read_write(real, grant_dir):
    from agentvm.policy import MountGrant

    ro, rw = grant_dir(), grant_dir()
    (ro / "in.txt").write_text("given")
    os.chown(rw, 4243, 4243)
    code = ("cat /ro/in.txt; echo; (echo x > /ro/new) 2>/dev/null && echo RO-WRITABLE || echo RO-REFUSED;"
            " echo made > /rw/out.txt && echo RW-OK; id -u")
    res, out, err = real.run(["/bin/sh", "-c", code], risk_tier="L1",
                             mounts=(MountGrant(str(ro), "/ro", False), MountGrant(str(rw), "/rw", True)))
    assert res.exit_code == 0, (res, out, err)
    assert "given" in out and "RO-REFUSED" in out and "RO-WRITABLE" not in out and "RW-OK" in out, (out, err)
    assert not (ro / "new").exists()
    st = (rw / "out.txt").stat()
    assert (st.st_uid, st.st_gid) == (4243, 4243), "what the agent writes belongs to the folder's owner"
    assert (rw / "out.txt").read_text() == "made\n"


def test_the_workspace_is_durable_across_runs(real):
    name = f"contract-ws-{real.name}"
    res1, out1, err1 = real.run(["/bin/sh", "-c", "echo kept > /workspace/note; echo ok"], name=name, agent=True,
                                workspace="/workspace")
    assert res1.exit_code == 0, (res1, err1)
    res2, out2, err2 = real.run(["/bin/sh", "-c", "cat /workspace/note"], name=name, agent=True, workspace="/workspace")
    assert res2.exit_code == 0 and out2.strip() == "kept", (res2, out2, err2)


def test_live_limits_change_in_a_running_sandbox(real):
    lc, s = real.start(["/bin/sh", "-c", "sleep 60"])
    try:
        applied = s.backend.set_limits(s.handle, memory=200 * 1024**2, pids=100)
        assert applied.get("memory") == 200 * 1024**2 and applied.get("pids") == 100, applied
    finally:
        lc.stop(s, 1.0)
        lc.teardown(s)


def test_the_plan_is_printable(sub):
    from agentvm.backends.base import HostContext, LaunchContext

    policy = sub.policy(["/bin/true"])
    host = HostContext(uid=3999999, gid=3999999, dedicated=True, run_dir="/run/x", etc_view="/run/etc-view")
    ctx = LaunchContext(sandbox_id="c-0", host=host if sub.real else None)
    backend = sub.rt.backend_for(policy)
    plan = backend.compile(policy, ctx)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["substrate"] == sub.name and d["command"] == ["/bin/true"] and "body" in d
    assert plan.sandbox_id == "c-0"


def test_a_caller_holding_hundreds_of_descriptors_still_starts_sandboxes(real, grant_dir, monkeypatch):
    """A daemon with many sandboxes (or a long test run) holds hundreds of descriptors, so what it
    opens for a launch - the helper's status pipe, a grant's O_PATH fd - gets a number past 255.
    gVisor's sandbox process remaps its stdio to fds 256-258 and refused to start when one of
    those numbers was taken by a descriptor handed down to runsc ("unable to remap stdios, FD
    258 is already in use": every gVisor start of a stretch of the full suite failed, each with
    the same numbers). Here the status pipe's write end is put on exactly 258, and a grant is
    given; and once more with every number below 256 held."""
    import fcntl

    from agentvm.policy import MountGrant

    ro = grant_dir()
    (ro / "in.txt").write_text("given")
    real_pipe2 = os.pipe2

    def pipe2_high(flags=0):  # the status pipe (opened last in a launch) on 257/258
        r, w = real_pipe2(flags)
        for fd, to in ((r, 257), (w, 258)):
            try:
                fcntl.fcntl(to, fcntl.F_GETFD)
                return r, w  # (taken: left as it is)
            except OSError:
                pass
        hi_r, hi_w = os.dup2(r, 257, inheritable=False), os.dup2(w, 258, inheritable=False)
        os.close(r)
        os.close(w)
        return hi_r, hi_w

    def run():
        return real.run(["/bin/sh", "-c", "cat /ro/in.txt; echo; ls /proc/self/fd | wc -l"], risk_tier="L1",
                        mounts=(MountGrant(str(ro), "/ro", False),))

    import agentvm.backends.gvisor as gv
    import agentvm.backends.bwrap as bw

    for mod in (gv, bw):
        monkeypatch.setattr(mod.os, "pipe2", pipe2_high)
    try:
        res, out, err = run()
    finally:
        monkeypatch.undo()
    results = [("status fd on 258", res, out, err)]
    held = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            if fd >= 256:
                os.close(fd)
                break
            held.append(fd)
        results.append(("every number below 256 held", *run()))
    finally:
        for fd in held:
            os.close(fd)
    for what, res, out, err in results:
        assert res.exit_code == 0, (what, res.setup_error, out, err)
        lines = out.split()
        assert lines[0] == "given", (what, out, err)
        assert int(lines[1]) < 16, f"the sandbox's command got the caller's descriptors: {out}"
