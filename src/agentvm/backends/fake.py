"""A fake substrate for testing code above the backend interface (runtime, CLI, daemon).

Like httpx's ``MockTransport``: no process is started. A ``handler(argv, env) -> int`` (or a
fixed exit code) decides what "running" returns; every call is recorded in ``calls`` so a test
can assert what the layer above asked for. Capabilities are configurable, which is how the
fail-closed logic is tested without breaking the host.

It provides no isolation at all and ``get_backend('fake')`` is refused outside tests unless
``AGENTVM_ALLOW_FAKE=1``.
"""

from __future__ import annotations

import time
from typing import Callable

from agentvm.backends.base import (
    Capabilities,
    ExitStatus,
    LaunchContext,
    LaunchPlan,
    Primitive,
    SandboxHandle,
    TeardownReport,
)
from agentvm.backends.protocol import Backend
from agentvm.errors import EXIT_TIMEOUT
from agentvm.policy import Policy

PRIMITIVES = ("userns", "seccomp", "landlock", "cgroups", "disk-quota")

Handler = Callable[[tuple[str, ...], dict[str, str]], int]


class FakeBackend(Backend):
    name = "fake"
    primitives = PRIMITIVES
    host_local = False  # allocates no uid, workspace or cgroup on the host

    def __init__(
        self,
        handler: Handler | int = 0,
        *,
        missing: tuple[str, ...] = (),
        duration: float = 0.0,
        teardown_ok: bool = True,
        hold: bool = False,
    ) -> None:
        import threading

        self.hold = hold  # wait() blocks until stop()/destroy(): a long-running worker
        self._released: dict[str, "threading.Event"] = {}
        self.handler = handler
        self.missing = set(missing)
        self.duration = duration
        self.teardown_ok = teardown_ok
        self.calls: list[tuple] = []
        self.live: dict[str, SandboxHandle] = {}

    def capabilities(self) -> Capabilities:
        prims = tuple(
            Primitive(p, p not in self.missing, "fake: missing" if p in self.missing else "fake") for p in PRIMITIVES
        )
        return Capabilities(self.name, prims, {})

    def required_primitives(self, policy: Policy) -> tuple[str, ...]:
        req = ["userns", "seccomp", "landlock", "cgroups"]
        if policy.agent and policy.workspace:
            req.append("disk-quota")
        return tuple(req)

    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan:
        return LaunchPlan.of(policy, ctx, substrate=self.name, command=policy.command, env=dict(policy.env),
                             identity="nobody (fake: nothing runs)",
                             body={"gate": ctx.gate.kind if ctx.gate else None, "workspace": ctx.workspace})

    def launch(self, plan: LaunchPlan, *, stdio=None) -> SandboxHandle:
        self.calls.append(("launch", plan.sandbox_id, plan.command))
        import threading

        h = SandboxHandle(plan.sandbox_id, plan, started_at=time.monotonic(), private={"done": False})
        self.live[plan.sandbox_id] = h
        self._released[plan.sandbox_id] = threading.Event()
        return h

    def wait(self, handle: SandboxHandle, timeout: float | None = None) -> ExitStatus:
        self.calls.append(("wait", handle.sandbox_id, timeout))
        if self.hold:
            if self._released[handle.sandbox_id].wait(timeout):
                return ExitStatus(exit_code=143, signal=15)
            return ExitStatus(exit_code=EXIT_TIMEOUT, timed_out=True, duration=timeout or 0)
        if timeout and self.duration > timeout:
            return ExitStatus(exit_code=EXIT_TIMEOUT, timed_out=True, duration=timeout)
        code = self.handler if isinstance(self.handler, int) else self.handler(handle.plan.command, dict(handle.plan.env))
        return ExitStatus(exit_code=code, duration=self.duration)

    def poll(self, handle: SandboxHandle) -> bool:
        ev = self._released.get(handle.sandbox_id)
        return not self.hold or ev is None or ev.is_set()

    def exec(self, handle: SandboxHandle, argv: list[str], *, stdio=None, timeout: float | None = None) -> ExitStatus:
        import os

        self.calls.append(("exec", handle.sandbox_id, tuple(argv)))
        code = self.handler if isinstance(self.handler, int) else self.handler(tuple(argv), dict(handle.plan.env))
        if stdio is not None:
            os.write(stdio[1], f"fake exec: {' '.join(argv)}\n".encode())
        return ExitStatus(exit_code=code)

    def inspect(self, handle: SandboxHandle) -> dict:
        return {"sandbox_id": handle.sandbox_id, "running": handle.sandbox_id in self.live,
                "uptime": time.monotonic() - handle.started_at}

    def set_limits(self, handle: SandboxHandle, *, memory=None, pids=None, cpus=None) -> dict:
        self.calls.append(("set_limits", handle.sandbox_id, memory, pids, cpus))
        return {k: v for k, v in (("memory", memory), ("pids", pids), ("cpus", cpus)) if v is not None}

    def stop(self, handle: SandboxHandle, grace: float = 2.0) -> None:
        self.calls.append(("stop", handle.sandbox_id))
        ev = self._released.get(handle.sandbox_id)
        if ev is not None:
            ev.set()

    # pause/unpause/suspend: the protocol's "not supported" defaults (a test sets
    # ``can_pause``/``can_suspend`` to exercise the layer above)
    can_pause = False

    def pause(self, handle: SandboxHandle, timeout: float = 5.0) -> None:
        if not self.can_pause:
            return super().pause(handle, timeout)
        self.calls.append(("pause", handle.sandbox_id))
        handle.private["paused"] = True

    def unpause(self, handle: SandboxHandle, timeout: float = 5.0) -> None:
        if not self.can_pause:
            return super().unpause(handle, timeout)
        self.calls.append(("unpause", handle.sandbox_id))
        handle.private["paused"] = False

    def paused(self, handle: SandboxHandle) -> bool:
        return bool(handle.private.get("paused"))

    def destroy(self, handle: SandboxHandle) -> TeardownReport:
        self.calls.append(("destroy", handle.sandbox_id))
        self.live.pop(handle.sandbox_id, None)
        if self.teardown_ok:
            return TeardownReport(verified=True)
        return TeardownReport(verified=False, processes_left=[4242])
