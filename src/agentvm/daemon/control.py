"""The control plane as a typed service: every operation on the daemon's sandboxes, runs,
live policy, approvals, audit chain and fleet - no HTTP, no request dicts, and only
:class:`~agentvm.errors.AgentVMError` (by its registered code) for a refusal.

The HTTP API (``agentvm.daemon.router`` over ``agentvm.daemon.http``), the web console
(``agentvm.console``) and through them the SDK and the CLI are adapters over it; tests drive it
directly (``tests/unit/test_control_plane.py``).

    ControlPlane
      Events      events, the audit chain and its queue           (daemon/events.py)
      Supervisor  runs, restarts, TTLs, stops, recovery            (daemon/supervisor.py)
      FleetOps    fleet plan, apply, rollback, status              (daemon/fleetops.py)
      Commands    exec, run, cp                                    (daemon/commands.py)
      StateControl pause, suspend, resume, wake, snapshot, fork    (daemon/statectl.py)
      + here: sandboxes (create, start, stop, remove, logs), live policy, approvals, audit
    DaemonGateHost  the gate's placement and endpoints             (daemon/gatehost.py)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

from agentvm.audit import AuditLog
from agentvm.daemon.commands import Commands, RunRequest  # noqa: F401 (RunRequest: run()'s argument)
from agentvm.daemon.events import Events, make_reserve, refuse
from agentvm.daemon.fleetops import FleetOps, Replay  # noqa: F401 (Replay: the fleet_plan argument's type)
from agentvm.daemon.gatehost import DaemonGateHost, apply_live, budget_store
from agentvm.daemon.state import State
from agentvm.daemon.statectl import StateControl
from agentvm.daemon.supervisor import Managed, Supervisor
from agentvm.errors import AgentVMError, PolicyDenied
from agentvm.paths import Paths
from agentvm.policy_patch import (BudgetChange, LimitsApplied, LimitsChange, LivePolicy, PolicyPatch, RemoveRule,
                                  SetCredential, ToolChange, apply, check_limits, detail_of, fold, op_of)

log = logging.getLogger("agentvm.daemon")

START_WAIT = 30.0  # seconds a start (through the API) waits for the sandbox to run, exit or fail


class ControlPlane(Events, Supervisor, StateControl, FleetOps, Commands):
    """The daemon's state, gate, supervision and audit chain, and every operation on them."""

    def __init__(self, paths: Paths, *, backend=None, tracing=None, gate_workers: int | str = "agent",
                 resume: bool = True) -> None:
        from agentvm.gate.server import Gate
        from agentvm.runtime import Runtime

        self.resume = resume  # bring back the persistent workers the last daemon left running
        self.paths = paths.ensure()
        self.runtime = Runtime(self.paths, backend, record=self._record_from_driver)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.state = State(self.paths.home / "daemon.db")
        # a short wait for the chain's lock: the daemon's loop must not stall behind a process
        # stopped mid-append (records wait in the queue instead)
        self.audit = AuditLog(self.paths.audit_dir / "audit.db", lock_timeout=0.5)
        self._audit_queue: list = []  # records the disk did not take yet (see record)
        self._audit_stalled = False
        self._reserve = self.paths.home / ".reserve"
        make_reserve(self._reserve)
        self._fleet_lock = asyncio.Lock()  # one apply or rollback at a time, from its plan to its end
        self.gate = Gate(self.paths.home / "gate", self.paths.home / "logs")
        self.gate.subscribers.append(self._on_decision)
        self.gate.approvals_factory = self._approval_store
        # who parses the sandboxes' bytes (docs/daemon.md, docs/threat-model.md): "agent" - confined
        # gate workers, one per running agent (the default); N - N confined workers shared by
        # every agent; 0 - the gate above, in this root process (an audited opt-in, not contained)
        self.gate_workers = "agent" if gate_workers in (None, "agent") else int(gate_workers)
        self.workers = None  # agentvm.gate.workers.WorkerPool, started by open()
        self.managed: dict[str, Managed] = {}
        self.subscribers: set[asyncio.Queue] = set()
        self.stopping = asyncio.Event()
        from agentvm.observe.metrics import CachedVerify, Observer

        self._bytes_seen: dict[str, tuple[int, int]] = {}  # sandbox id -> (out, in) counted to /metrics
        self.observer = Observer(sandboxes_by_state=self._by_state, approvals_pending=self._pending_count,
                                 audit_status=CachedVerify(self._verify_readonly, self.audit.length),
                                 workspace_dir=self.paths.workspaces)
        self.tracing = tracing  # observe.tracing.Tracing when an OTLP collector is configured
        self._flush_task = None
        if tracing is not None:
            from agentvm.gate.telemetry import TelemetryRelay

            self.gate.telemetry = TelemetryRelay(tracing.endpoint)

    # ------------------------------------------------------------------ open and close
    async def open(self) -> None:
        """On the running loop: the audit flusher, the gate workers, and the recovery of what
        the last daemon left (before anyone is answered: a client sees a clean state)."""
        self.loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._flush_task = asyncio.ensure_future(self._flusher())
        await self._open_gate()  # before recover(): it starts persistent sandboxes
        self.checkpoints  # its table made now, while there is room: stop and rm read it on a full disk
        if self.workers is not None and self.workers.spare and self.resume:
            # a spare per sandbox recover() restarts: none of them waits for a worker's start
            n = sum(1 for r in self.state.all() if r.desired == "running"
                    or r.state in ("running", "starting", "backoff", "paused"))
            if n > 1:
                await self.workers.prestart(n)
                # (the spares left unclaimed once those starts are done: retired)
                pool = self.workers
                asyncio.get_running_loop().call_later(60, lambda: asyncio.ensure_future(pool.trim_spares()))
        await self.recover(resume=self.resume)

    async def _open_gate(self) -> None:
        """The sandboxes' gate: confined workers (per agent by default), or - opted into - this
        process's own gate, which is then on the audit chain as a security alert and warned of
        by ``agentvm doctor`` and ``agentvm status`` (:meth:`gate_mode`)."""
        if self.gate_workers == 0:
            log.warning("the gate runs in the daemon's own process (--gate-workers 0): every sandbox's bytes are "
                        "parsed by root, not contained (docs/threat-model.md)")
            self.record("gate.unconfined", alert="security", pid=os.getpid(), uid=os.geteuid(),
                        reason="the operator started the daemon with its gate in its own process (--gate-workers 0 "
                               "/ --unconfined-gate): every sandbox's egress is parsed by this process "
                               f"({'root' if os.geteuid() == 0 else 'the operator'}), not by confined gate workers")
            self._write_gate_mode()
            return
        from agentvm.gate.workers import RETIRE_AFTER, WorkerPool

        per_agent = self.gate_workers == "agent"
        self.workers = WorkerPool(0 if per_agent else self.gate_workers, self.gate.state_dir, self.gate.log_dir,
                                  on_record=self._on_decision, on_event=self._worker_event,
                                  telemetry=self.tracing.endpoint if self.tracing is not None else None,
                                  isolate="agent" if per_agent else None, approvals=self.gate.approval_store,
                                  retire=RETIRE_AFTER if per_agent else None, on_bytes=self._count_bytes,
                                  spare=1 if per_agent else 0,  # (an agent's first sandbox waits for no start)
                                  host_gate=self.gate)
        await self.workers.start()
        self.record("gate.workers", count=0 if per_agent else self.gate_workers, pids=self.workers.pids(),
                    mode="per-agent" if per_agent else "shared", confined=self.workers.confine)
        self._write_gate_mode()

    def gate_mode(self) -> dict:
        """Who parses the sandboxes' bytes: ``mode`` per-agent | shared | unconfined, whether it
        is contained, the workers running now; ``warning`` when it is not contained."""
        w = self.workers
        if w is None:
            return {"mode": "unconfined", "contained": False, "pid": os.getpid(), "uid": os.geteuid(),
                    "warning": "the gate runs in the daemon's own process (--gate-workers 0): a parser bug exploited "
                               "by an agent is code running as the daemon; restart the daemon without "
                               "--gate-workers 0 / --unconfined-gate"}
        d = {"mode": "per-agent" if w.isolate == "agent" else "shared", "contained": w.confine == "full",
             "confined": w.confine, "pid": os.getpid(), "workers": w.serving()}
        if w.confine != "full":
            d["warning"] = ("the gate workers cannot switch to a uid of their own nor make their mount namespace (the "
                            "daemon is not root): Landlock, seccomp and no_new_privs only")
        elif w.isolate != "agent":
            d["warning"] = ("the gate workers are shared by all agents (--gate-workers N): a worker compromised by one "
                            "agent holds the credentials of the others it serves; the default is one per agent")
        return d

    def _gate_mode_path(self) -> Path:
        return self.paths.runtime / "gate-mode.json"

    def _write_gate_mode(self) -> None:
        """For ``agentvm doctor`` (which runs without asking the daemon): the gate's mode, with
        the daemon's pid (a file a dead daemon left is told apart)."""
        import json

        d = self.gate_mode()
        d.pop("workers", None)
        try:
            tmp = self._gate_mode_path().with_suffix(".tmp")
            tmp.write_text(json.dumps(d, sort_keys=True) + "\n")
            tmp.replace(self._gate_mode_path())
        except OSError as exc:
            log.warning("the gate's mode could not be written for `agentvm doctor`: %s", exc)

    def fleet_status(self) -> dict:
        d = super().fleet_status()
        d["gate"] = self.gate_mode()  # (`agentvm status` warns when the gate is not contained)
        return d

    async def close(self) -> None:
        """Stop every supervised sandbox (they stay desired=running: the next `up` resumes
        them), the gate workers and the live readers; the last records."""
        if self._flush_task is not None:
            self._flush_task.cancel()
        tasks = []
        for m in self.managed.values():
            if m.task is not None and not m.task.done():
                m.stop_requested.set()
                tasks.append(m.task)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        if self.workers is not None:
            await self.workers.stop()
        self._gate_mode_path().unlink(missing_ok=True)
        for q in list(self.subscribers):
            q.put_nowait(None)
        self.record("daemon.stopped", pid=os.getpid())
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans reach the collector
        if self._audit_queue:
            self._log_unwritten()

    def request_shutdown(self, *, actor: str = "operator") -> None:
        self.record("daemon.shutdown-requested", actor=actor)
        self.stopping.set()

    # ------------------------------------------------------------------ parts
    def _approval_store(self):
        from agentvm.approvals import open_store

        def record(kind, *, actor, sandbox, **data):
            # on the daemon's chain under the sandbox's name (as its other records), the run's id kept
            name = self._name_of(sandbox)
            extra = {"sandbox_id": sandbox} if name != sandbox else {}
            self.record(kind, actor=actor, sandbox=name, **extra, **data)

        return open_store(self.paths, record)

    def _name_of(self, sandbox_id: str | None) -> str | None:
        for name, m in self.managed.items():
            if m.session is not None and m.session.plan.sandbox_id == sandbox_id:
                return name
        return sandbox_id

    def _by_state(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.state.all():
            out[row.state] = out.get(row.state, 0) + 1
        return out

    def _pending_count(self) -> int | None:
        store = self.gate.approval_store()
        return None if store is None else len(store.list(("pending",)))

    def _verify_readonly(self):
        # its own read-only connection: the walk runs in a worker thread, beside the loop's appends
        return AuditLog.open_readonly(self.audit.path).verify()

    def _lifecycle(self):
        from agentvm.lifecycle import Lifecycle

        return Lifecycle(self.runtime, DaemonGateHost(self), self.tracing)

    # ------------------------------------------------------------------ policies
    def base_policy(self, row):
        """A sandbox's policy as its agent file declares it (no live changes)."""
        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent_text

        return compile_policy(load_agent_text(row.spec_text, row.spec_file).spec)

    def effective_policy(self, row):
        """The policy a sandbox's gate enforces: its agent file's, with its live changes."""
        return apply(self.base_policy(row), LivePolicy.from_json(row.policy_patch))

    # ------------------------------------------------------------------ sandboxes
    def row(self, name: str):
        row = self.state.get(name)
        if row is None:
            raise refuse("sandbox.not-found", f"no sandbox named {name!r}")
        return row

    def describe(self, row) -> dict:
        """A sandbox's row as the API shows it (with its substrate and identity while it runs)."""
        d = row.public()
        m = self.managed.get(row.name)
        if m is not None and m.handle is not None:
            d["substrate"] = m.session.plan.substrate
            d["identity"] = m.session.plan.identity
        return d

    def sandboxes(self) -> list[dict]:
        return [self.describe(r) for r in self.state.all()]

    def sandbox(self, name: str) -> dict:
        return self.describe(self.row(name))

    def names(self) -> list[str]:
        return [r.name for r in self.state.all()]

    async def create(self, spec: str, file: str = "<api>", *, ttl: float | None = None,
                     idle_timeout: float | None = None, actor: str = "operator") -> dict:
        """Declare a sandbox from an agent file's text (it is not started)."""
        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent_text

        loaded = load_agent_text(spec, file)
        policy = compile_policy(loaded.spec)
        if policy.pending_features:
            raise PolicyDenied("the agent declares " + ", ".join(policy.pending_features) + ", which cannot be enforced yet")
        name = loaded.spec.metadata.name
        if self.state.get(name) is not None:
            raise refuse("sandbox.exists", f"a sandbox named {name!r} exists", hint=f"agentvm rm {name}")
        row = self.state.create(name, spec, file, policy.lifecycle, ttl, idle_timeout)
        self.record("lifecycle.created", actor=actor, sandbox=name, file=file, policy=policy.digest(),
                    lifecycle=policy.lifecycle)
        return self.describe(row)

    async def start_and_wait(self, name: str, *, actor: str = "operator") -> dict:
        """Start ``name`` and wait (START_WAIT at most) until it runs, exits or fails: a start
        that failed is its error, as an embedded run's would be."""
        m = self.managed.get(name)
        if m is not None:
            m.last_error = None
        await self.start(name, actor=actor)
        await self.wait_state(name, ("running", "exited", "failed", "stopped"), START_WAIT)
        m = self.managed.get(name)
        if self.row(name).state == "failed" and m is not None and m.last_error:
            e = m.last_error
            err = refuse(e["error"], f"{name} failed to start: {e['message']}", e.get("hint", ""))
            from agentvm.errorcodes import lookup

            if lookup(e["error"]) is None:  # ("internal", "start-again"): as the error said
                err.exit_code = e.get("exit_code", 125)
                err.status = 409 if err.exit_code in (77, 78) else 500
            raise err
        return self.sandbox(name)

    async def restart(self, name: str, *, actor: str = "operator") -> dict:
        await self.stop(name, actor=actor)
        return await self.start_and_wait(name, actor=actor)

    async def remove(self, name: str, *, keep_workspace: bool = False, actor: str = "operator") -> dict:
        """Stop, then remove the agent's workspace (unless kept: ``keep_workspace`` or the
        agent file's ``workspace.keep``; recorded before it is removed), then its row: a
        workspace refused as in use leaves the agent registered, so ``rm`` can be retried.
        Returns what became of the workspace."""
        from agentvm import workspace

        row = self.row(name)
        await self.stop(name, actor=actor)
        ws = workspace.on_agent_removed(
            self.paths.workspaces, name, keep=keep_workspace, spec_text=row.spec_text, runtime=self.paths.runtime,
            record=lambda kind, data: self.record(kind, actor=actor, sandbox=name, **data))
        review = None if keep_workspace else await asyncio.to_thread(self._drop_review_layer, name, actor)
        self.checkpoints.drop(name)  # (stop dropped a suspended one's; nothing else keeps it)
        if self._has_snapshots():
            self.snapshots.drop_lineage(name)  # (its snapshots stay: `agentvm snapshot rm`)
        self._save(self.state.delete, name)
        self.managed.pop(name, None)
        self.record("lifecycle.removed", actor=actor, sandbox=name, workspace=ws,
                    **({"review_layer": review} if review else {}))
        return ws

    def _drop_review_layer(self, name: str, actor: str) -> str | None:
        """rm takes the agent's review layer (its unaccepted writes) with it; recorded."""
        from agentvm import review

        if not review.layer_dir(self.paths.home, "agents", name).is_dir():
            return None
        got = review.discard(self.paths.home, name, record=lambda kind, data: self.record(kind, actor=actor, sandbox=name,
                                                                                          **data))
        return got["discarded"]

    async def logs(self, name: str, tail: int | None = None) -> str:
        """The last ``tail`` bytes (1 MiB by default, 16 MiB at most) of a sandbox's output log."""
        path = self.paths.home / "logs" / f"{name}.log"
        self.row(name)
        n = min(tail if tail is not None else 1 << 20, 16 << 20)
        data = await asyncio.to_thread(_tail, path, n)
        return data.decode(errors="replace")

    def usage(self, name: str) -> dict:
        """A running sandbox's pids, memory, CPU time and uptime (all None when it is not running)."""
        none = dict.fromkeys(("pids", "memory_peak", "memory_current", "cpu_time", "uptime"))
        m = self.managed.get(name)
        if m is None or m.handle is None:
            return none
        try:
            info = m.backend.inspect(m.handle)
        except Exception:  # noqa: BLE001 - a sandbox between states: no usage, not an error
            return none
        cg = info.get("cgroup") or {}
        return {"pids": len(info.get("pids") or ()), "memory_peak": cg.get("memory_peak"),
                "memory_current": cg.get("memory_current"), "cpu_time": cg.get("cpu_time"),
                "uptime": info.get("uptime")}

    # ------------------------------------------------------------------ live policy
    def policy_view(self, name: str) -> dict:
        """What a sandbox's gate enforces now: the agent file's rules with the live changes."""
        row = self.row(name)
        live = LivePolicy.from_json(row.policy_patch)
        policy = self.effective_policy(row)
        m = self.managed.get(name)

        def rule(r, kind):
            return {"id": r.id, "kind": kind, "host": r.host, "ports": list(r.ports) or "all",
                    **({"methods": list(r.methods)} if r.methods else {}), **({"paths": list(r.paths)} if r.paths else {})}

        eg = policy.egress
        return {"name": name, "network": policy.network, "live": m is not None and m.endpoint is not None,
                "paused": live.is_paused,
                "rules": ([rule(r, "deny") for r in eg.deny] + [rule(r, "allow") for r in eg.allow]) if eg else [],
                "revoked": list(live.revoked_names), "limits": {"memory": policy.limits.memory,
                                                                "pids": policy.limits.pids, "cpus": policy.limits.cpus},
                "tools": [{"server": sp.name, "allow": list(sp.allow), "approve": list(sp.approve), "deny": list(sp.deny)}
                          for sp in (policy.tools.servers if policy.tools else ())],
                "budget": self._budget_view(name, policy)}

    def credentials(self, name: str) -> list[dict]:
        """A sandbox's credentials by name, their hosts, and whether each is revoked."""
        row = self.row(name)
        policy = self.effective_policy(row)
        revoked = set(LivePolicy.from_json(row.policy_patch).revoked_names)
        return [{"name": b.name, "hosts": list(getattr(b, "hosts", ()) or ()), "revoked": b.name in revoked}
                for b in policy.credentials]

    def _budget_view(self, name: str, policy) -> dict | None:
        spec = policy.limits.budget
        if spec is None:
            return None
        m = self.managed.get(name)
        ep = m.endpoint if m else None
        usage = ep.budget.usage if ep is not None and ep.budget is not None else budget_store(self.paths).load(policy.name)
        return {"tokens": spec.tokens, "requests": spec.requests, "cost": spec.cost, "hosts": list(spec.hosts),
                "used": usage.to_dict(), "by_model": usage.by_model}

    async def change_policy(self, name: str, patch: PolicyPatch, *, actor: str = "operator") -> dict:
        """A live policy change (agentvm.policy_patch): checked first (a change that fails
        changes nothing), applied to the running endpoint at once, recorded, and kept for
        later starts. A suspended agent is resumed first (its checkpoint resumes only on the
        policy it was taken under); a paused one is unpaused."""
        self.row(name)
        await self.wake(name, actor=actor, why="policy")
        row = self.row(name)
        live = LivePolicy.from_json(row.policy_patch)
        m = self.managed.get(name)
        ep = m.endpoint if m else None
        t0 = time.perf_counter()
        if (isinstance(patch, BudgetChange) and ep is not None and not ep.can_meter  # (never now: workers meter)
                and any(v is not None for v in (patch.tokens, patch.requests, patch.cost))):
            # a gate worker cannot meter (the only live op that adds what a worker does not
            # carry: allow/deny/remove rules are never `action: ask`, tools ops change only a
            # tool gateway, which it has none of); refused before anything is changed
            raise refuse("policy.gate-worker", f"{name} is served by gate {ep.placement}, which cannot meter an LLM "
                         "budget (its counters, shared by an agent's sandboxes, live in the daemon)",
                         hint=f"nothing was changed; to set one, put it in the agent file and restart the sandbox "
                         f"(`agentvm restart {name}`): it is then served by the daemon's own gate")
        if isinstance(patch, LimitsChange):
            return await self._change_limits(name, m, live, patch, actor, t0)
        current = None
        if isinstance(patch, (RemoveRule, ToolChange)):
            current = self.effective_policy(row)
        elif isinstance(patch, SetCredential):
            current = m.policy if m and m.policy else self.effective_policy(row)
        new = fold(live, patch, current)
        if isinstance(patch, BudgetChange) and patch.reset:
            budget_store(self.paths).reset(self.effective_policy(row).name)
            if ep is not None and ep.budget is not None:
                ep.budget.reset()
        if isinstance(patch, SetCredential):
            self._revoke_live(m, ep, current, patch)
        policy = apply(self.base_policy(row), new)  # raises on anything invalid: nothing applied yet
        self.state.update(name, policy_patch=new.to_json())
        if ep is not None:
            apply_live(ep, policy, new, self.paths)
            await ep.synced()  # (a gate worker: applied there before this call returns)
        took = (time.perf_counter() - t0) * 1000
        self.record("policy.change", actor=actor, sandbox=name, op=op_of(patch), detail=detail_of(patch),
                    applied_live=ep is not None, ms=round(took, 3))
        return {"applied": True, "live": ep is not None, "ms": round(took, 3), "patch": new.to_dict()}

    def _revoke_live(self, m, ep, policy, patch: SetCredential) -> None:
        """A revocation (or its end) in the gate's memory - the very next request sees it -
        and, for a vault credential, in the vault, per session."""
        if ep is None or ep.creds is None:
            return
        ep.revoke([patch.name], patch.revoked)
        b = next(b for b in policy.credentials if b.name == patch.name)
        if b.ref.startswith("vault:"):
            from agentvm.vault import Vault

            v = Vault(self.runtime.vault_dir)
            (v.revoke if patch.revoked else v.restore)(b.ref[6:], m.session.sandbox_id)

    async def _change_limits(self, name: str, m, live: LivePolicy, patch: LimitsChange, actor: str, t0: float) -> dict:
        if m is None or m.handle is None:
            raise refuse("sandbox.not-running", "live limits need a running sandbox")
        mem, pids, cpus = check_limits(patch)
        try:
            applied = await asyncio.to_thread(m.backend.set_limits, m.handle, memory=mem, pids=pids, cpus=cpus)
        except AgentVMError as exc:
            raise refuse("limits.unsupported", exc.message) from None
        except (ValueError, KeyError) as exc:
            raise refuse("limits.invalid", str(exc)) from None
        except OSError as exc:  # (the cgroup's files: tighten() puts back what it wrote before failing)
            raise refuse("limits.invalid", f"the kernel refused the change ({exc.strerror}); nothing was changed") from None
        new = fold(live, LimitsApplied(tuple(applied.items())), None)  # and for every later start
        self.state.update(name, policy_patch=new.to_json())
        took = (time.perf_counter() - t0) * 1000
        self.record("policy.change", actor=actor, sandbox=name, op="limits", detail=applied, applied_live=True,
                    ms=round(took, 3))
        return {"applied": True, "live": True, "ms": round(took, 3), "limits": applied}

    # ------------------------------------------------------------------ approvals
    def _store(self):
        store = self.gate.approval_store()
        if store is None:
            raise refuse("approvals.unavailable", "the approvals queue cannot be opened")
        return store

    def approvals(self, *, all: bool = False) -> list[dict]:
        """The approvals queue's pending requests (``all``: answered and expired ones too)."""
        from agentvm.approvals import STATES

        return [r.to_dict() for r in self._store().list(STATES if all else ("pending",))]

    def approval(self, rid: str) -> dict:
        return self._approval_call(lambda store: store.get(rid))

    def answer_approval(self, rid: str, approve: bool, *, by: str, note: str | None = None,
                        digest: str | None = None) -> dict:
        """Approve or deny request ``rid`` (``digest``: of the request as it was shown - an
        approval of anything else is refused), answered by ``by``."""
        out = self._approval_call(lambda store: store.answer(rid, approve, by, note, digest))
        self._wake_for_approval(out, by)
        return out

    def _wake_for_approval(self, req: dict, by: str) -> None:
        """An answered approval wakes its paused agent (the held request's answer reaches it);
        a suspended one has no held request (its endpoint closed with it). Scheduled on the loop:
        the answer itself does not wait."""
        name = self._name_of(req.get("sandbox")) or req.get("agent")
        row = self.state.get(name) if name else None
        if row is None or row.state != "paused" or self.loop is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        asyncio.ensure_future(self.wake(name, actor=by, why="approval"))

    def _approval_call(self, fn) -> dict:
        from agentvm.approvals import ApprovalError

        store = self._store()
        try:
            return fn(store).to_dict()
        except ApprovalError as exc:
            if "no approval request" in exc.message:
                raise refuse("approvals.not-found", exc.message, exc.hint) from None
            raise

    # ------------------------------------------------------------------ audit
    def audit_records(self, *, since: float | None = None, sandbox: str | None = None, limit: int | None = None,
                      newest: bool = False) -> list[dict]:
        kw = {"limit": limit, "newest": newest} if limit is not None else {}
        return [r.to_dict() for r in self.audit.records(since=since, sandbox=sandbox, **kw)]

    def audit_verify(self) -> dict:
        return self.audit.verify().to_dict()

    def audit_verify_readonly(self) -> dict:
        """The chain's check on a read-only connection of its own (for a worker thread)."""
        return self._verify_readonly().to_dict()


def _tail(path: Path, n: int) -> bytes:
    """The last ``n`` bytes of a log, read from the end (the log may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - n, 0))
            return f.read(n)
    except FileNotFoundError:
        return b""
