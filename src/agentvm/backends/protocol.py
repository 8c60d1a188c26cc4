"""The substrate protocol every backend implements (kept apart from ``base`` so the hot
path does not import ``typing.Protocol``). See ``base`` for the data it exchanges."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from agentvm.backends.base import Capabilities, ExitStatus, LaunchContext, LaunchPlan, SandboxHandle, TeardownReport
from agentvm.policy import Policy


@runtime_checkable
class Backend(Protocol):
    name: str

    def capabilities(self) -> Capabilities: ...

    def required_primitives(self, policy: Policy) -> tuple[str, ...]: ...

    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan: ...

    def launch(self, plan: LaunchPlan, *, stdio: tuple[int, int, int] | None = None) -> SandboxHandle: ...

    def wait(self, handle: SandboxHandle, timeout: float | None = None) -> ExitStatus: ...

    def exec(self, handle: SandboxHandle, argv: list[str]) -> ExitStatus: ...

    def inspect(self, handle: SandboxHandle) -> dict: ...

    def stop(self, handle: SandboxHandle, grace: float = 2.0) -> None: ...

    def destroy(self, handle: SandboxHandle) -> TeardownReport: ...
