"""The control plane as a service (agentvm.daemon.control.ControlPlane), driven directly: no
socket, no HTTP, no JSON - typed calls in, typed answers or AgentVMError (by code) out. The
fake backend stands in for the substrate (no process is started)."""

from __future__ import annotations

import asyncio

import pytest

from agentvm.backends.fake import FakeBackend
from agentvm.daemon.control import ControlPlane, RunRequest
from agentvm.errors import AgentVMError
from agentvm.paths import Paths
from agentvm.policy_patch import AddRules, BudgetChange, RemoveRule, SetPaused

SPEC = """apiVersion: agentvm/v1
kind: Agent
metadata: {{name: {name}}}
spec:
  lifecycle: {lifecycle}
  command: [worker]
  egress:
    allow:
      - {{host: pypi.org}}
"""


def spec(name="w1", lifecycle="persistent"):
    return SPEC.format(name=name, lifecycle=lifecycle)


class Collected:
    """An Output that keeps what a command wrote (the transport's part, in memory)."""

    def __init__(self) -> None:
        self.started = False
        self.chunks: list[tuple[str, bytes]] = []

    async def start(self) -> None:
        self.started = True

    async def write(self, stream: str, data: bytes) -> None:
        assert self.started, "output before the stream started"
        self.chunks.append((stream, data))

    def hangup(self):
        return None

    def text(self, stream: str = "stdout") -> str:
        return b"".join(d for s, d in self.chunks if s == stream).decode()


def drive(tmp_path, body, *, hold: bool = True, handler=0):
    """``body(cp)`` (a coroutine function) on a fresh ControlPlane, opened and closed."""
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run")
    backend = FakeBackend(handler, hold=hold)

    async def main():
        cp = ControlPlane(paths, backend=backend)
        await cp.open()
        try:
            return await body(cp)
        finally:
            await cp.close()

    return asyncio.run(main())


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")


def refused(code: str):
    class Want:
        def __enter__(self):
            self.ctx = pytest.raises(AgentVMError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            ok = self.ctx.__exit__(*exc)
            assert self.info.value.code == code, (self.info.value.code, self.info.value.message)
            return ok

    return Want()


def test_create_start_exec_stop_remove(tmp_path):
    async def body(cp: ControlPlane):
        row = await cp.create(spec(), "w1.yaml", actor="t")
        assert row["name"] == "w1" and row["state"] == "created" and cp.names() == ["w1"]
        with refused("sandbox.exists"):
            await cp.create(spec())
        out = Collected()
        with refused("sandbox.not-running"):
            await cp.exec("w1", ["echo", "hi"], out)
        assert not out.started  # refused before anything streamed
        running = await cp.start_and_wait("w1", actor="t")
        assert running["state"] == "running" and running["substrate"] == "fake"
        status = await cp.exec("w1", ["echo", "hi"], out, actor="t")
        assert status.exit_code == 0 and out.text() == "fake exec: echo hi\n"
        await cp.stop("w1", actor="t")
        assert cp.sandbox("w1")["state"] == "stopped"
        ws = await cp.remove("w1", actor="t")
        assert cp.sandboxes() == [] and isinstance(ws, dict)
        with refused("sandbox.not-found"):
            cp.sandbox("w1")
        return {r["kind"]: r["actor"] for r in cp.audit_records(sandbox="w1")}

    actors = drive(tmp_path, body)
    for k in ("lifecycle.created", "lifecycle.start-requested", "operator.exec", "lifecycle.stopped",
              "lifecycle.removed"):
        assert actors.get(k) == "t", (k, actors)  # recorded, under the caller's actor
    assert actors.get("lifecycle.running") == "agentvm"


def test_live_policy_reaches_the_running_endpoint_and_is_kept(tmp_path):
    async def body(cp: ControlPlane):
        await cp.create(spec())
        await cp.start_and_wait("w1")
        ep = cp.managed["w1"].endpoint
        got = await cp.change_policy("w1", AddRules("allow", ("example.com:8443",)), actor="t")
        assert got["applied"] and got["live"] and got["patch"] == {"allow": ["example.com:8443"]}
        assert any(r.host == "example.com" for r in ep.policy.allow)  # the gate decides under it now
        await cp.change_policy("w1", SetPaused(True))
        assert ep.paused and cp.policy_view("w1")["paused"] is True
        with refused("policy.no-such-rule"):
            await cp.change_policy("w1", RemoveRule("nope"))
        with refused("budget.invalid"):
            await cp.change_policy("w1", BudgetChange(tokens=-1))
        view = cp.policy_view("w1")
        await cp.stop("w1")
        await cp.start_and_wait("w1")  # a restart starts with the live changes
        ep2 = cp.managed["w1"].endpoint
        return view, ep2.paused, [r.host for r in ep2.policy.allow], cp.audit_records(sandbox="w1")

    view, paused, hosts, recs = drive(tmp_path, body)
    assert view["live"] and any(r["host"] == "example.com" for r in view["rules"])
    assert paused and "example.com" in hosts
    changes = [r["data"] for r in recs if r["kind"] == "policy.change"]
    assert [c["op"] for c in changes] == ["allow", "pause"], changes  # refusals change nothing


def test_a_run_streams_its_output_and_returns_its_result(tmp_path):
    def handler(argv, env):
        return 3 if argv[-1] == "fail" else 0

    async def body(cp: ControlPlane):
        out = Collected()
        ok = await cp.run(RunRequest(command=("true",)), out, actor="t")
        bad = await cp.run(RunRequest(command=("x", "fail"), network="none"), Collected(), actor="t")
        with refused("api.bad-request"):
            await cp.run(RunRequest(), Collected())
        return ok, bad, out.started, [r["kind"] for r in cp.audit_records()]

    ok, bad, started, kinds = drive(tmp_path, body, hold=False, handler=handler)
    assert ok.exit_code == 0 and bad.exit_code == 3 and started
    assert ok.teardown.get("verified") is not None
    assert kinds.count("operator.run") == 2 and kinds.count("run.started") == 2 and kinds.count("run.exited") == 2


def test_events_reach_a_subscriber_and_a_closed_plane_ends_them(tmp_path):
    async def body(cp: ControlPlane):
        q = cp.subscribe()
        await cp.create(spec())
        await cp.start_and_wait("w1")
        kinds = []
        while not q.empty():
            kinds.append(q.get_nowait()["kind"])
        cp.unsubscribe(q)
        return kinds

    kinds = drive(tmp_path, body)
    assert kinds[:2] == ["lifecycle.created", "lifecycle.start-requested"] and "lifecycle.running" in kinds


def test_fleet_and_approvals_without_http(tmp_path):
    async def body(cp: ControlPlane):
        status = cp.fleet_status()
        with refused("fleet.no-rollback-target"):
            await cp.fleet_rollback()
        with refused("fleet.not-a-commit-id"):
            await cp.fleet_apply(str(tmp_path), "main")
        pending = cp.approvals()
        with refused("approvals.not-found"):
            cp.approval("nope")
        return status, pending, [r["kind"] for r in cp.audit_records()]

    status, pending, kinds = drive(tmp_path, body)
    assert status["agents"] == [] and status["drift"] is False and pending == []
    assert "fleet.refused" in kinds  # a refused apply is on the chain


def test_every_refusal_is_an_agentvm_error_with_a_registered_code(tmp_path):
    from agentvm.errorcodes import lookup

    async def body(cp: ControlPlane):
        codes = []
        for call in (lambda: cp.stop("nope"), lambda: cp.start("nope"), lambda: cp.remove("nope"),
                     lambda: cp.change_policy("nope", SetPaused(True)), lambda: cp.logs("nope"),
                     lambda: cp.copy_out("nope", "f"), lambda: cp.copy_in("nope", "f", b"x")):
            try:
                await call()
            except AgentVMError as exc:
                codes.append(exc.code)
        await cp.create(spec())
        try:
            await cp.copy_in("w1", "f", b"x")
        except AgentVMError as exc:
            codes.append(exc.code)
        return codes

    codes = drive(tmp_path, body)
    assert codes == ["sandbox.not-found"] * 7 + ["sandbox.not-running"]
    assert all(lookup(c) is not None for c in codes)
