"""Suspend/resume, pause/unpause and the idle policy on the control plane (issue 37), driven
directly over the fake backend; and the checkpoint's binding (agentvm.checkpoint) on real files."""

from __future__ import annotations

import asyncio
import os

import pytest

from agentvm import checkpoint
from agentvm.backends.fake import FakeBackend
from agentvm.daemon.control import ControlPlane
from agentvm.errors import AgentVMError
from agentvm.paths import Paths

SPEC = """apiVersion: agentvm/v1
kind: Agent
metadata: {{name: {name}}}
spec:
  lifecycle: {lifecycle}
  command: [worker]
"""


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")


def drive(tmp_path, body, *, can_pause=True):
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run")
    backend = FakeBackend(0, hold=True)
    backend.can_pause = can_pause

    async def main():
        cp = ControlPlane(paths, backend=backend)
        await cp.open()
        try:
            return await body(cp, backend)
        finally:
            await cp.close()

    return asyncio.run(main())


def kinds(cp, name):
    return [r["kind"] for r in cp.audit_records(sandbox=name)]


# ---------------------------------------------------------------- the binding
def _image(tmp_path):
    d = checkpoint.make_private_dir(tmp_path / "checkpoints" / "a" / "a-1")
    (d / "checkpoint.img").write_bytes(b"memory" * 1000)
    return d


def test_seal_then_verify_accepts_the_same_image(tmp_path):
    d = _image(tmp_path)
    cp = checkpoint.seal("a", "a-1", "gvisor", "p" * 64, d)
    assert oct(os.stat(d).st_mode & 0o777) == "0o700"
    assert oct(os.stat(d / "checkpoint.img").st_mode & 0o777) == "0o600"
    assert checkpoint.verify(cp, "a", "p" * 64) is cp


@pytest.mark.parametrize("tamper", ["edit", "append", "extra-file", "swap-sandbox", "symlink"])
def test_a_tampered_image_is_refused(tmp_path, tamper):
    d = _image(tmp_path)
    cp = checkpoint.seal("a", "a-1", "gvisor", "p" * 64, d)
    img = d / "checkpoint.img"
    if tamper == "edit":
        with open(img, "r+b") as f:
            f.seek(10)
            f.write(b"X")
    elif tamper == "append":
        with open(img, "ab") as f:
            f.write(b"\0")
    elif tamper == "extra-file":
        (d / "more.img").write_bytes(b"")
    elif tamper == "swap-sandbox":  # the same image, claimed for another sandbox
        cp.sandbox_id = "b-2"
    elif tamper == "symlink":
        (d / "link").symlink_to("/etc/passwd")
    with pytest.raises(AgentVMError) as ei:
        checkpoint.verify(cp, "a", "p" * 64)
    assert ei.value.code == "checkpoint.tampered"


def test_another_policy_or_no_image_is_refused(tmp_path):
    d = _image(tmp_path)
    cp = checkpoint.seal("a", "a-1", "gvisor", "p" * 64, d)
    with pytest.raises(AgentVMError) as ei:
        checkpoint.verify(cp, "a", "q" * 64)
    assert ei.value.code == "checkpoint.policy-changed"
    with pytest.raises(AgentVMError) as ei:
        checkpoint.verify(None, "a", "p" * 64)
    assert ei.value.code == "checkpoint.missing"


# ---------------------------------------------------------------- the control plane
def test_pause_unpause_and_stop_of_a_paused_sandbox(tmp_path):
    async def body(cp, backend):
        await cp.create(SPEC.format(name="w", lifecycle="persistent"))
        await cp.start_and_wait("w")
        assert (await cp.pause("w"))["state"] == "paused"
        assert cp.sandbox("w")["state"] == "paused"
        assert ("pause", cp.managed["w"].session.sandbox_id) in backend.calls
        assert (await cp.unpause("w"))["state"] == "running"
        await cp.pause("w")
        await cp.stop("w")
        assert cp.sandbox("w")["state"] == "stopped"
        sid = [c for c in backend.calls if c[0] == "pause"][-1][1]
        i_unpause = max(i for i, c in enumerate(backend.calls) if c == ("unpause", sid))
        i_stop = max(i for i, c in enumerate(backend.calls) if c == ("stop", sid))
        assert i_unpause < i_stop, "a paused sandbox is thawed before it is stopped"
        k = kinds(cp, "w")
        assert "lifecycle.paused" in k and "lifecycle.unpaused" in k

    drive(tmp_path, body)


def test_exec_wakes_a_paused_sandbox(tmp_path):
    from tests.unit.test_control_plane import Collected

    async def body(cp, backend):
        await cp.create(SPEC.format(name="w", lifecycle="persistent"))
        await cp.start_and_wait("w")
        await cp.pause("w")
        st = await cp.exec("w", ["true"], Collected())
        assert st.exit_code == 0
        assert cp.sandbox("w")["state"] == "running"
        woken = [r for r in cp.audit_records(sandbox="w") if r["kind"] == "lifecycle.unpaused"]
        assert woken and woken[-1]["data"].get("woken_by") == "exec"

    drive(tmp_path, body)


def test_suspend_refused_where_the_substrate_cannot(tmp_path):
    async def body(cp, backend):
        await cp.create(SPEC.format(name="w", lifecycle="persistent"))
        await cp.start_and_wait("w")
        with pytest.raises(AgentVMError) as ei:
            await cp.suspend("w")
        assert ei.value.code == "backend.suspend-unsupported"
        assert "agentvm pause" in ei.value.hint and "gvisor" in ei.value.hint
        assert cp.sandbox("w")["state"] == "running", "a refused suspend leaves it running"
        with pytest.raises(AgentVMError) as ei:
            await cp.resume_sandbox("w")
        assert ei.value.code == "sandbox.not-suspended"

    drive(tmp_path, body)


def test_pause_refused_without_a_freezer(tmp_path):
    async def body(cp, backend):
        await cp.create(SPEC.format(name="w", lifecycle="persistent"))
        await cp.start_and_wait("w")
        with pytest.raises(AgentVMError) as ei:
            await cp.pause("w")
        assert ei.value.code == "backend.pause-unsupported"
        assert cp.sandbox("w")["state"] == "running"

    drive(tmp_path, body, can_pause=False)


def test_idle_policy_pauses_a_quiet_worker(tmp_path):
    spec = SPEC.format(name="w", lifecycle="{kind: persistent, idle: {after: 1, action: pause}}")

    async def body(cp, backend):
        await cp.create(spec)
        await cp.start_and_wait("w")
        await cp.wait_state("w", ("paused",), 10)
        assert cp.sandbox("w")["state"] == "paused"
        rec = [r for r in cp.audit_records(sandbox="w") if r["kind"] == "lifecycle.idle"]
        assert rec and rec[-1]["data"]["action"] == "pause"
        paused = [r for r in cp.audit_records(sandbox="w") if r["kind"] == "lifecycle.paused"]
        assert paused[-1]["actor"] == "idle"

    drive(tmp_path, body)


def test_idle_suspend_on_bwrap_is_refused_when_the_file_is_read():
    from agentvm.spec.loader import load_agent_text

    text = SPEC.format(name="w", lifecycle="{kind: persistent, idle: {after: 15m, action: suspend}}")
    with pytest.raises(AgentVMError) as ei:
        load_agent_text(text, "w.yaml")
    assert "backend.suspend-unsupported" in str(ei.value) + str(getattr(ei.value, "message", ""))
    ok = load_agent_text(text.replace("  command:", "  substrate: gvisor\n  command:"), "w.yaml")
    assert ok.spec.spec.idle.action == "suspend" and ok.spec.spec.idle.after == 900
    with pytest.raises(AgentVMError):  # idle is for persistent workers
        load_agent_text(SPEC.format(name="w", lifecycle="{kind: ephemeral, idle: {after: 1m, action: stop}}"), "w.yaml")
