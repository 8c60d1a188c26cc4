"""The substrate contract: the one door between agent-vm and a sandbox technology.

Every caller (the lifecycle driver, the daemon, the pty relay, the CLI) goes through these
methods and the common types of ``base``; nothing outside ``backends/`` reads a backend's
private state or branches on its name. ``tests/contract/`` runs the same behavioural tests
against every backend present: a new substrate is done when it passes them.

Shaped so a remote substrate (Kubernetes) fits without another redesign:

* the common types carry no host pid, uid or cgroup (``LaunchContext.host`` is ``None`` for
  a remote substrate, and ``SandboxHandle.private`` is the backend's own);
* the workspace is a volume (``LaunchContext.workspace``), the gate an attachment of a kind
  the backend accepts (``gate_kinds``; a unix socket here, a TCP/mTLS address there);
* exec's stdio are three stream ends the caller owns (pipe fds here; a remote backend
  pumps its exec stream into them), and the exit is awaitable (``wait_async``) without a
  thread per sandbox.
"""

from __future__ import annotations

import abc

from agentvm.backends.base import (
    Capabilities,
    ExitStatus,
    GateAttachment,
    LaunchContext,
    LaunchPlan,
    SandboxHandle,
    TeardownReport,
)
from agentvm.errors import BackendError
from agentvm.policy import Policy

Stdio = tuple[int, int, int]  # stdin, stdout, stderr: stream ends the caller owns


class Backend(abc.ABC):
    #: the substrate's name in agent files (``substrate: NAME``) and on ``--substrate``
    name: str = ""
    #: the primitives ``capabilities()`` probes: the names ``--degrade`` accepts for it
    primitives: tuple[str, ...] = ()
    #: True: needs this host's resources (a dedicated uid, the workspace on this disk, the
    #: /etc view, host folders as grants), which the runtime resolves into ``LaunchContext.host``
    host_local: bool = True
    #: the gate attachments this backend can bridge into a sandbox
    gate_kinds: tuple[str, ...] = ("unix",)
    #: how strong the isolation boundary is, for ``minSubstrate`` (higher is stronger)
    strength: int = 0
    #: can give the sandbox a terminal (a pty whose slave is its controlling tty)
    tty: bool = True

    # ---------------------------------------------------------------- planning (no side effects)
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this host/backend can guarantee (probed once, cached)."""

    @abc.abstractmethod
    def required_primitives(self, policy: Policy) -> tuple[str, ...]:
        """The primitives ``policy`` relies on here: any missing refuses the run (fail closed)."""

    def gate_attachment(self, sandbox_id: str, run_dir: str) -> GateAttachment:
        """Where the gate listens for this sandbox (bound by the gate *before* launch)."""
        return GateAttachment("unix", f"{run_dir}/gate.sock")

    @abc.abstractmethod
    def compile(self, policy: Policy, ctx: LaunchContext) -> LaunchPlan:
        """Pure: the policy as this substrate's plan (common header + printable body)."""

    # ---------------------------------------------------------------- side effects
    @abc.abstractmethod
    def launch(self, plan: LaunchPlan, *, stdio: Stdio | None = None) -> SandboxHandle:
        """Start the sandbox. A failure leaves nothing behind (raises ``LaunchError``)."""

    @abc.abstractmethod
    def wait(self, handle: SandboxHandle, timeout: float | None = None) -> ExitStatus:
        """Block until the sandbox's command exits; on ``timeout`` kill it and return 124."""

    async def wait_async(self, handle: SandboxHandle) -> ExitStatus:
        """The exit, awaitable without holding a thread while the sandbox runs."""
        import asyncio  # not at import time: `agentvm run` never needs it

        return await asyncio.to_thread(self.wait, handle, None)

    @abc.abstractmethod
    def poll(self, handle: SandboxHandle) -> bool:
        """Has the sandbox's command exited? (never blocks)"""

    @abc.abstractmethod
    def exec(self, handle: SandboxHandle, argv: list[str], *, stdio: Stdio | None = None,
             timeout: float | None = None) -> ExitStatus:
        """Run ``argv`` inside the running sandbox under the same confinement; 124 on timeout."""

    @abc.abstractmethod
    def inspect(self, handle: SandboxHandle) -> dict:
        """Live facts for people: ``running``, ``uptime`` and the backend's own (usage...)."""

    def set_limits(self, handle: SandboxHandle, *, memory: int | None = None, pids: int | None = None,
                   cpus: float | None = None) -> dict:
        """Tighten limits of a running sandbox; returns what was applied."""
        raise BackendError(f"the {self.name} substrate cannot change limits of a running sandbox")

    @abc.abstractmethod
    def stop(self, handle: SandboxHandle, grace: float = 2.0) -> None:
        """Ask the sandbox to end (SIGTERM), then kill it after ``grace``."""

    @abc.abstractmethod
    def destroy(self, handle: SandboxHandle) -> TeardownReport:
        """Remove everything of the sandbox and *verify* nothing is left."""

    # ---------------------------------------------------------------- pause / suspend (issue 37)
    #: can write a running sandbox's whole state to disk and bring it back (``suspend``)
    can_suspend: bool = False
    #: why not, for the refusal (``backend.suspend-unsupported``)
    suspend_refusal: str = "this substrate cannot checkpoint a sandbox"

    def pause(self, handle: SandboxHandle, timeout: float = 5.0) -> None:
        """Freeze every process of the sandbox (memory and host resources kept, CPU zero)."""
        raise BackendError(f"the {self.name} substrate cannot pause a sandbox", code="backend.pause-unsupported",
                           hint="stop the sandbox instead")

    def unpause(self, handle: SandboxHandle, timeout: float = 5.0) -> None:
        raise BackendError(f"the {self.name} substrate cannot pause a sandbox", code="backend.pause-unsupported",
                           hint="stop the sandbox instead")

    def paused(self, handle: SandboxHandle) -> bool:
        return False

    def suspend(self, handle: SandboxHandle, image_dir: str) -> None:
        """Write the sandbox's whole state (processes, memory, open files, its /tmp) into
        ``image_dir``; the sandbox then exits (``wait`` returns) and its teardown frees the rest."""
        raise BackendError(f"the {self.name} substrate cannot suspend a sandbox: {self.suspend_refusal}",
                           code="backend.suspend-unsupported",
                           hint="use `agentvm pause NAME` (memory kept, CPU zero) or run the agent on the gvisor "
                                "substrate (`substrate: gvisor`), which can checkpoint")

    def restoring(self, plan: LaunchPlan, image_dir: str) -> LaunchPlan:
        """``plan`` changed so that ``launch`` restores the checkpoint in ``image_dir`` instead of
        starting the command afresh."""
        raise BackendError(f"the {self.name} substrate cannot resume a sandbox: {self.suspend_refusal}",
                           code="backend.suspend-unsupported",
                           hint="use `agentvm pause NAME` or the gvisor substrate")

    def reap_stale(self) -> list[str]:
        """Tear down what sandboxes of a dead supervisor left behind; returns what was reaped."""
        return []
