"""The daemon's gate as the lifecycle driver's gate host: placement of each sandbox's endpoint
(a gate worker, or the daemon's own gate for what only it carries), its opening and closing
from the driver's threads, and a policy put onto a running endpoint.

Endpoints are used through ``agentvm.gate.endpoint.EndpointHandle`` only: the daemon never
asks which kind of gate serves one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

from agentvm.errors import AgentVMError


class DaemonGateHost:
    """The daemon's one gate, for the lifecycle driver: every sandbox of the daemon - supervised
    or ``agentvm run`` through it - is an endpoint of this gate (no second gate, no second
    compile). The driver calls it from worker threads; the gate lives on the daemon's loop."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon

    def _call(self, coro, timeout: float = 30.0, *, undo=None):
        """Run ``coro`` on the daemon's loop and wait for it (from a driver thread). Past
        ``timeout`` the wait ends in an AgentVMError; with ``undo`` (an async function of the
        result) the call is abandoned: cancelled, or - if it finishes anyway - its result undone
        on the loop (an endpoint opened for a sandbox whose start gave up is closed). Without
        ``undo`` (a close) it is left to finish."""
        loop = self.daemon.loop
        state: dict = {"abandoned": False, "task": None}

        async def run():
            state["task"] = asyncio.current_task()
            if state["abandoned"]:
                raise asyncio.CancelledError
            result = await coro
            if state["abandoned"] and undo is not None:  # (finished after the caller left)
                await undo(result)
                raise asyncio.CancelledError
            return result

        fut = asyncio.run_coroutine_threadsafe(run(), loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if undo is not None:
                def abandon():
                    state["abandoned"] = True
                    t = state["task"]
                    if t is None:
                        return
                    if not t.done():
                        t.cancel()
                    elif not t.cancelled() and t.exception() is None:
                        loop.create_task(undo(t.result()))
                loop.call_soon_threadsafe(abandon)
            raise AgentVMError(f"the daemon's gate did not answer within {timeout:g} s",
                               hint="the daemon's loop is overloaded or stuck; see its log", code="gate.timeout") from None

    @property
    def relays_telemetry(self) -> bool:
        return getattr(self.daemon.gate, "telemetry", None) is not None

    def open(self, sandbox_id: str, agent: str, egress, attachment, uid, creds, extras=None):
        if attachment.kind != "unix":
            raise AgentVMError(f"the daemon's gate cannot serve a {attachment.kind!r} attachment")
        workers = self.daemon.workers
        if workers is not None:
            from agentvm.gate.workers import unplaceable

            # (with tools too: its /mcp requests are parsed by the worker, answered by its tool
            # gateway here - agentvm.gate.workers._RemoteTools / WorkerPool._q_tools)
            why = unplaceable(egress, extras, creds, tools=workers.host_gate is not None)
            if why is None:  # a gate worker serves it (agentvm.gate.workers): held requests and budgets too
                from agentvm.gate.workers import START_TIMEOUT

                # (a per-agent worker may be started for it first: its start's time allowed)
                return self._call(workers.open(sandbox_id, agent, egress, Path(attachment.address), uid=uid,
                                               creds=creds, extras=extras, bridge_key=attachment.key),
                                  START_TIMEOUT + 30.0, undo=workers.close)
            # the daemon's own gate (root, not contained) parses this sandbox's bytes: recorded
            # as such, with the reason (docs/threat-model.md: what remains of issue 43)
            self.daemon._in_loop(lambda: self.daemon.record("gate.placement", sandbox_id=sandbox_id, gate="daemon",
                                                            reason=why, confined=False))
        gate = self.daemon.gate

        async def undo(ep):
            await gate.close_endpoint(ep.sandbox_id)

        return self._call(gate.open_endpoint(sandbox_id, agent, egress, Path(attachment.address),
                                             uid=uid, creds=creds, extras=extras, bridge_key=attachment.key), undo=undo)

    def close(self, sandbox_id: str, ep) -> dict:
        from agentvm.lifecycle import egress_summary

        if ep.placement == "daemon":
            self._call(self.daemon.gate.close_endpoint(sandbox_id))
        else:
            self._call(self.daemon.workers.close(ep))
        self.daemon._in_loop(lambda: self.daemon._count_bytes(ep, final=True))
        summary = egress_summary(ep)
        if ep.counts_lost:  # (the decision log and the audit chain still have every record)
            summary["incomplete"] = ("a gate worker serving this sandbox died and was replaced: these counts "
                                     "leave out what it had counted (its records are in the decision log)")
        return summary


def budget_store(paths):
    from agentvm.gate.budget import BudgetStore

    return BudgetStore(paths.home / "budgets.db")


def apply_live(ep, policy, live, paths) -> None:
    """A sandbox's policy (its file's, with the live changes in ``live``, a LivePolicy) onto its
    running endpoint: the next request is decided under it. (Revocations are the caller's.)"""
    if policy.egress is not None:
        ep.set_policy(policy.egress)
    ep.paused = live.is_paused
    if ep.tools is not None and policy.tools is not None:
        ep.tools.set_policy(policy.tools, policy.digest())  # the next tool call is decided under it
    if policy.limits.budget is not None:  # the next request is checked against it
        if ep.budget is not None:
            ep.budget.set_spec(policy.limits.budget)
        elif ep.can_meter:
            from agentvm.gate.budget import Budget

            ep.set_budget(Budget(ep.agent, policy.limits.budget, budget_store(paths)))
        # (every endpoint meters: a gate worker's budget is kept by the daemon, which the
        # worker asks before each metered request)
