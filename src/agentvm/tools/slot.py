"""What a sandbox's gate endpoint carries beyond egress: its tool gateway and approvals.

Kept free of the ``mcp`` SDK: importing it costs about a second, so it is imported in a
worker thread when an endpoint with tools opens (never on the gate's loop, never for a
sandbox without tools), and the gateway itself is built on the first ``/mcp`` request.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EndpointExtras:
    """What a gate endpoint needs besides its egress policy: tools, approvals, budget."""
    tools: object  # agentvm.tools.policy.ToolPolicy | None
    approval_timeout: float
    policy_digest: str
    run_dir: Path
    env: tuple = ()  # where agent-vm lives (AGENTVM_HOME...): a local tool server's `agentvm run` uses the same
    webhook: str | None = None
    budget: object = None  # agentvm.gate.budget.BudgetSpec | None
    budget_db: Path | None = None  # <home>/budgets.db: the agent's counters, kept across runs

    @classmethod
    def of(cls, policy, run_dir: Path, digest: str, paths=None) -> "EndpointExtras":
        env = ()
        if paths is not None:
            env = (("AGENTVM_HOME", str(paths.home)), ("AGENTVM_RUNTIME_DIR", str(paths.runtime)))
        budget = getattr(policy.limits, "budget", None)
        return cls(policy.tools, policy.approval_timeout, digest, Path(run_dir), env,
                   getattr(policy, "approval_webhook", None), budget,
                   (paths.home / "budgets.db") if paths is not None and budget is not None else None)

    def attach(self, ep) -> None:
        ep.approval_timeout = self.approval_timeout
        ep.approval_webhook = self.webhook
        ep.policy_digest = self.policy_digest
        if self.tools is not None and self.tools.servers:
            ep.tools = ToolsSlot(ep, self.tools, self.policy_digest, self.run_dir, dict(self.env))
        if self.budget is not None:
            from agentvm.gate.budget import Budget, BudgetStore

            ep.budget = Budget(ep.agent, self.budget, BudgetStore(self.budget_db) if self.budget_db else None)


def _import_gateway():
    return importlib.import_module("agentvm.tools.gateway")


class ToolsSlot:
    """The endpoint's tool gateway, built when first asked for."""

    def __init__(self, ep, policy, digest: str, run_dir: Path, env: dict | None = None) -> None:
        self.ep, self.policy, self.digest, self.run_dir = ep, policy, digest, run_dir
        self.env = env or {}
        self._gw = None
        import asyncio  # here, not at the top: every run's gate endpoint imports this module

        self._lock = asyncio.Lock()
        self._closed = False
        self._warm = asyncio.get_running_loop().run_in_executor(None, _import_gateway)

    async def gateway(self):
        async with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox's endpoint is closing")
            if self._gw is None:
                mod = await self._warm
                ep = self.ep
                self._gw = mod.ToolGateway(sandbox_id=ep.sandbox_id, agent=ep.agent, policy=self.policy,
                                           policy_digest=self.digest, run_dir=self.run_dir, log=ep.log,
                                           approvals=ep.gate.approval_store(), env=self.env, gate=ep.gate,
                                           endpoint=ep)
            return self._gw

    def set_policy(self, policy, digest: str) -> None:
        self.policy, self.digest = policy, digest
        if self._gw is not None:
            self._gw.set_policy(policy, digest)

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            gw, self._gw = self._gw, None
        if gw is not None:
            await gw.close()
