"""The one lifecycle driver: how any sandbox goes from a policy to a verified teardown.

    prepare -> attach to the gate -> launch -> wait | stop -> destroy (verified) -> release

``agentvm run`` (embedded, with a gate in a thread of its own process) and the daemon (its
persistent and ephemeral sandboxes, and ``agentvm run`` through it, all on the daemon's one
gate) drive these same steps; only the gate host differs. Every step goes through the
``Backend`` protocol, never around it. Each session is on the audit chain: ``run.started``
before launch (a run that cannot be recorded does not start), ``run.exited`` after teardown,
``run.refused`` when preflight says no.
"""

from __future__ import annotations

import os
import time
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentvm.backends.base import ExitStatus, TeardownReport
from agentvm.errors import EXIT_BACKEND, AgentVMError, BackendError


@dataclass
class RunResult:
    """The outcome of one run, as the CLI reports it and the audit trail records it."""
    sandbox_id: str
    agent: str
    exit_code: int
    duration: float
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    signal: int | None = None
    setup_error: dict | None = None
    teardown: dict = field(default_factory=dict)
    degraded: list[str] = field(default_factory=list)
    host_uid: int | None = None
    policy_digest: str = ""
    memory_peak: int | None = None
    limits: dict = field(default_factory=dict)  # the limits in force (memory, pids, timeout...), for the hints
    egress: dict | None = None  # gate summary: allowed, denied [{rule, target, count}], bytes, log
    substrate: str = ""
    cpu_time: float | None = None  # seconds of CPU the whole sandbox used (host-side, its cgroup)
    disk: dict | None = None  # a pool workspace's disk at release (WorkspaceLease.disk): used, limit, limit_hit, pool_full

    @property
    def limits_hit(self) -> list[str]:
        out = []
        if self.timed_out:
            out.append("timeout")
        if self.oom_killed:
            out.append("memory")
        if self.pids_limit_hit:
            out.append("pids")
        if self.disk:
            if self.disk.get("limit_hit"):
                out.append("disk")
            if self.disk.get("pool_full"):
                out.append("workspace-pool-full")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["limits_hit"] = self.limits_hit
        d["teardown_verified"] = bool(self.teardown.get("verified"))
        return d


_EXPIRED = 1e-6  # a wait whose timeout has already run out (Backend.wait: kill, then 124)

NO_TRAFFIC = {"allowed": 0, "denied": [], "bytes_out": 0, "bytes_in": 0, "alerts": 0, "log": None}


def egress_summary(endpoint) -> dict:
    """What a sandbox's gate endpoint saw, for the run's result."""
    return {
        "allowed": endpoint.allowed,
        "denied": [_denial(r, t, n, *endpoint.denial_reasons.get((r, t), ("", None)))
                   for (r, t), n in sorted(endpoint.denials.items())],
        "bytes_out": endpoint.bytes_out,
        "bytes_in": endpoint.bytes_in,
        "alerts": endpoint.alerts,
        "log": str(endpoint.log_path),
    }


def _denial(rule: str, target: str, count: int, reason: str, allow: str | None) -> dict:
    d = {"rule": rule, "target": target, "count": count, "reason": reason}
    if allow:
        d["how_to_allow"] = allow
    return d


class EmbeddedGateHost:
    """The gate in a thread of this process (``agentvm run`` without a daemon): the socket is
    bound before launch, the gate itself starts on the first connection."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def open(self, sandbox_id: str, agent: str, egress, attachment, uid: int | None, creds, extras=None):
        if attachment.kind != "unix":
            raise BackendError(f"the embedded gate cannot serve a {attachment.kind!r} attachment")
        return self.runtime.embedded_gate().open(sandbox_id, agent, egress, Path(attachment.address), uid, creds=creds,
                                                 extras=extras, bridge_key=attachment.key)

    def close(self, sandbox_id: str, pending) -> dict:
        gate = self.runtime.embedded_gate()
        placed = getattr(gate, "placement", lambda _sid: None)(sandbox_id)  # where it ran (confined, uid)
        if pending.abandon_if_unused():
            return dict(NO_TRAFFIC)  # the sandbox never connected: no need to wait for the gate
        ep = pending.result()  # raises when the gate never served (every connection refused)
        gate.close(sandbox_id)
        summary = egress_summary(ep)
        if placed is not None:
            summary["gate"] = placed
        return summary


def _no_warmup() -> None:
    return None


def _prewarm(rt, policy):
    """The backend's launch warm-up, started (``prewarm_launch``, bwrap's: the first cgroup
    migration's grace period paid while the run is prepared) -> its stop function. Nothing
    when the backend has none or cannot be had (preflight says why, as ever)."""
    try:
        start = getattr(rt.backend_for(policy), "prewarm_launch", None)
        return start() if start is not None else _no_warmup
    except Exception:  # noqa: BLE001 - an optimisation only: never a reason to refuse or fail
        return _no_warmup


@dataclass
class Session:
    """One sandbox on its way through the lifecycle."""

    policy: object
    backend: object
    plan: object
    res: object  # the runtime's host resources (uid lease, workspace, credentials), released last
    degrade: tuple[str, ...] = ()
    endpoint: object = None  # the gate host's token for this sandbox's endpoint
    handle: object = None
    status: ExitStatus | None = None
    report: TeardownReport | None = None
    egress: dict | None = None
    gate_error: AgentVMError | None = None
    torn_down: bool = False
    trace: object = None  # observe.tracing.SessionTrace when the daemon exports traces
    began: float = 0.0
    disk: dict | None = None  # the workspace's disk at release (a pool workspace: WorkspaceLease.disk)
    warm: object = _no_warmup  # stops the backend's launch warm-up (agentvm.backends.bwrap.MigrationWarmup)

    @property
    def sandbox_id(self) -> str:
        return self.plan.sandbox_id


class Lifecycle:
    def __init__(self, runtime, gate, tracing=None) -> None:
        """``gate``: the gate host - ``open(sandbox_id, agent, egress, attachment, uid, creds)``
        returns a token, ``close(sandbox_id, token)`` the egress summary (it raises when the
        gate never served). ``tracing``: an ``observe.tracing.Tracing`` (the daemon's, when it
        exports traces), else None."""
        self.runtime = runtime
        self.gate = gate
        self.tracing = tracing

    # ---------------------------------------------------------------- prepare
    def prepare(self, policy, *, degrade: tuple[str, ...] = (), tty: bool = False, notes=None,
                placeholders: dict | None = None) -> Session:
        """Preflight (fail closed), host resources, compile - and ``run.started`` on the chain.
        ``placeholders``: credential placeholders to keep (a resumed sandbox's processes hold them)."""
        rt = self.runtime
        began = time.time()
        trace = self.tracing.begin(policy) if self.tracing is not None else None
        warm = _prewarm(rt, policy)
        try:
            policy = rt.resolve_image(policy)  # a name -> the digest that runs (and its signature, if required)
            plan, res = rt.prepare(policy, degrade=degrade, tty=tty, session_env=trace.env() if trace else (),
                                   telemetry=trace is not None and getattr(self.gate, "relays_telemetry", False),
                                   **({"placeholders": placeholders} if placeholders else {}))
        except BaseException as exc:
            warm()
            if isinstance(exc, AgentVMError):
                rt.record("run.refused", agent=policy.name, code=exc.code, message=exc.message[:500])
                if trace is not None:
                    trace.end(error=f"refused: {exc.code}")
            raise
        s = Session(policy, rt.backend_for(policy), plan, res, tuple(degrade))
        s.trace, s.began, s.warm = trace, began, warm
        if trace is not None:
            trace.bind(plan.sandbox_id, substrate=plan.substrate, policy=plan.policy_digest)
        ws_notes = list(res.workspace.notes) if res.workspace is not None else []
        if notes is not None:
            for n in ws_notes:
                notes(n)
        try:  # no run that is not on the audit chain: a chain that cannot be written refuses the run
            rt.record("run.started", sandbox=plan.sandbox_id, agent=policy.name, command=_shown_argv(policy.command),
                      policy=plan.policy_digest, substrate=plan.substrate, identity=plan.identity,
                      host_uid=res.host_uid, degraded=list(degrade), network=policy.network,
                      grants=[f"{m.host}:{m.path}:{_grant_mode(m)}" for m in policy.mounts],
                      **({"image": policy.image} if policy.image else {}),
                      **({"notes": ws_notes} if ws_notes else {}))
        except Exception as exc:
            warm()
            res.release()
            from agentvm.errors import disk_full_error

            if isinstance(exc, AgentVMError):  # a broken chain (audit.broken-chain), a lost one: as they are
                raise
            full = disk_full_error(exc, where=rt.paths.audit_dir)
            if full is not None:
                raise full from exc
            raise BackendError(f"cannot write the audit chain ({type(exc).__name__}: {exc}); refusing to run unrecorded",
                               hint=f"check {rt.paths.audit_dir} (free space, permissions), then `agentvm audit verify`") from exc
        return s

    # ---------------------------------------------------------------- attach, launch, wait, stop
    def attach(self, s: Session) -> None:
        """The gate listens before the sandbox exists: no window without it."""
        if s.policy.egress is None:
            return
        run_dir = self.runtime.paths.sandboxes / s.sandbox_id
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, 0o711)
        from agentvm.tools.slot import EndpointExtras

        s.endpoint = self.gate.open(s.sandbox_id, s.policy.name, s.policy.egress, s.res.gate,
                                    s.res.host_uid if s.res.host_uid else None, s.res.creds,
                                    extras=EndpointExtras.of(s.policy, run_dir, s.plan.policy_digest,
                                                             self.runtime.paths))

    def launch(self, s: Session, stdio=None) -> None:
        try:
            s.handle = s.backend.launch(s.plan, stdio=stdio)
        except AgentVMError as exc:
            if s.trace is not None:
                s.trace.span("launch", s.began, attributes={"agentvm.substrate": s.plan.substrate}, error=exc.message)
            raise
        finally:
            s.warm()  # the helper has moved into the sandbox's cgroups (or never will)
        if s.trace is not None:
            s.trace.span("launch", s.began, attributes={"agentvm.substrate": s.plan.substrate,
                                                        "agentvm.policy": s.plan.policy_digest})

    def wait(self, s: Session, timeout: float | None = None) -> ExitStatus:
        s.status = s.backend.wait(s.handle, (s.plan.timeout or None) if timeout is None else timeout)
        return s.status

    async def wait_async(self, s: Session) -> ExitStatus:
        s.status = await s.backend.wait_async(s.handle)
        return s.status

    def stop(self, s: Session, grace: float = 2.0) -> None:
        if s.handle is not None:
            s.backend.stop(s.handle, grace)

    # ---------------------------------------------------------------- the whole sequence
    async def run_to_end(self, policy, *, stdio=None, tty: bool = False, notes=None, degrade: tuple[str, ...] = (),
                         timed: bool = False, stop=None, watch=None, grace: float = 2.0, on_session=None,
                         attached=None, launched=None, before_teardown=None, after_teardown=None,
                         placeholders: dict | None = None) -> RunResult:
        """prepare -> attach -> launch -> wait (or stop) -> teardown -> result, on the caller's
        loop: each blocking step runs in a worker thread only while it lasts, and the wait holds
        none (``Backend.wait_async``) - a thousand running sandboxes are not a thousand threads.

        ``stdio``: the launch's (stdin, stdout, stderr), or a function returning them (called
        once it is prepared). ``timed``: the plan's timeout holds (past it, the backend's own
        timeout path ends the sandbox: exit 124, ``timed_out``). ``stop``: an
        ``asyncio.Event`` - set, the sandbox is stopped (``grace`` seconds to exit).
        ``watch(session)``: a coroutine run beside the wait; when it ends (a TTL, an idle
        timeout) the sandbox is stopped. Hooks, each with the Session: ``on_session`` once it
        is prepared, ``attached`` (async) once its gate endpoint is open - it may still raise,
        and the sandbox never launches - ``launched`` once it runs, ``before_teardown`` and
        ``after_teardown`` around its teardown (which always happens once it is prepared)."""
        import asyncio

        s = await asyncio.to_thread(self.prepare, policy, degrade=degrade, tty=tty, notes=notes, placeholders=placeholders)
        if on_session is not None:
            on_session(s)
        try:
            await asyncio.to_thread(self.attach, s)
            if attached is not None:
                await attached(s)
            await asyncio.to_thread(self.launch, s, stdio() if callable(stdio) else stdio)
            if launched is not None:
                launched(s)
            await self._wait_or_stop(s, (s.plan.timeout or None) if timed else None, stop, watch, grace)
        finally:
            try:
                if before_teardown is not None:
                    before_teardown(s)
            finally:
                try:
                    await asyncio.to_thread(self.teardown, s)
                finally:
                    if after_teardown is not None:
                        after_teardown(s)
        return await asyncio.to_thread(self.result, s)

    async def _wait_or_stop(self, s: Session, timeout, stop, watch, grace: float) -> ExitStatus:
        import asyncio
        import logging

        waiter = asyncio.ensure_future(s.backend.wait_async(s.handle))
        stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
        watcher = asyncio.ensure_future(watch(s)) if watch is not None else None
        try:
            done, _ = await asyncio.wait({t for t in (waiter, stopper, watcher) if t is not None},
                                         timeout=timeout or None, return_when=asyncio.FIRST_COMPLETED)
            if watcher is not None and watcher in done and not watcher.cancelled() and watcher.exception() is not None:
                logging.getLogger("agentvm.daemon").error("the watch of %s failed: the sandbox is stopped",
                                                          s.policy.name, exc_info=watcher.exception())
            if not done and not s.backend.poll(s.handle):
                # its time is up: the backend's own timeout path (kill, then its status: 124)
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
                if waiter.cancelled():
                    s.status = await asyncio.to_thread(s.backend.wait, s.handle, _EXPIRED)
                    return s.status
            elif done and waiter not in done:
                await asyncio.to_thread(self.stop, s, grace)
            s.status = await waiter
            return s.status
        finally:  # (also when stopping failed: no watch outlives its run)
            for t in (stopper, watcher):
                if t is not None:
                    t.cancel()

    # ---------------------------------------------------------------- teardown
    def teardown(self, s: Session) -> None:
        """Destroy (verified), release host resources, close the gate endpoint. Idempotent."""
        if s.torn_down:
            return
        s.torn_down = True
        s.warm()  # (a session that never launched: its warm-up ends here, not at WARM_MAX)
        began = time.time()
        try:
            self._teardown(s)
        finally:
            if s.trace is not None:
                verified = bool(s.report.verified) if s.report is not None else None
                s.trace.span("teardown", began, attributes={"agentvm.teardown.verified": verified},
                             error=None if verified is not False else "teardown not verified")
                if s.status is None:  # it never ran to an exit (a failed attach or launch): no result() follows
                    s.trace.end(error="the sandbox did not run to an exit")

    def _teardown(self, s: Session) -> None:
        if s.handle is not None:
            s.report = s.backend.destroy(s.handle)
        else:
            # the sandbox never started (e.g. the gate could not open): leave nothing behind
            run_dir = self.runtime.paths.sandboxes / s.sandbox_id
            if run_dir.exists():
                shutil.rmtree(run_dir, ignore_errors=True)
        ws = s.res.workspace  # (release drops the lease; its disk at the end is read by its release)
        s.res.release(s.report)
        if ws is not None:
            s.disk = getattr(ws, "disk", None)
        if s.endpoint is not None:
            try:
                s.egress = self.gate.close(s.sandbox_id, s.endpoint)
            except AgentVMError as exc:
                s.gate_error = exc
        elif s.policy.egress is not None:
            s.egress = None

    def result(self, s: Session) -> RunResult:
        """The run's result, recorded as ``run.exited`` (a record that cannot be written is
        warned about: the run happened and its result is not lost)."""
        status, report, plan, policy = s.status, s.report, s.plan, s.policy
        result = RunResult(
            sandbox_id=plan.sandbox_id,
            agent=policy.name,
            exit_code=status.exit_code if status else EXIT_BACKEND,
            duration=status.duration if status else 0.0,
            timed_out=status.timed_out if status else False,
            oom_killed=status.oom_killed if status else False,
            pids_limit_hit=status.pids_limit_hit if status else False,
            signal=status.signal if status else None,
            setup_error=status.setup_error if status else None,
            teardown=report.to_dict() if report else {"verified": False},
            degraded=list(s.degrade),
            host_uid=s.res.host_uid,
            policy_digest=plan.policy_digest,
            memory_peak=status.memory_peak if status else None,
            egress=s.egress,
            limits={"memory": policy.limits.memory, "pids": policy.limits.pids, "timeout": policy.limits.timeout,
                    "tmp": policy.limits.tmp, "shm": policy.limits.shm},
            substrate=plan.substrate,
            cpu_time=status.cpu_time if status else None,
            disk=s.disk,
        )
        if s.gate_error is not None:
            result.setup_error = result.setup_error or {"step": "gate", "errno": 0, "message": s.gate_error.message}
            result.exit_code = EXIT_BACKEND
        if report is not None and not report.verified:
            result.exit_code = EXIT_BACKEND if result.exit_code == 0 else result.exit_code
        eg = result.egress or {}
        if s.trace is not None:
            s.trace.end(exit_code=result.exit_code)
        try:
            self.runtime.record(
                "run.exited", sandbox=result.sandbox_id, agent=result.agent, exit_code=result.exit_code,
                duration=round(result.duration, 3), timed_out=result.timed_out, limits_hit=result.limits_hit,
                setup_error=(result.setup_error or {}).get("step"), teardown_verified=bool(report and report.verified),
                egress={"allowed": eg.get("allowed", 0), "denied": sum(d["count"] for d in eg.get("denied", [])),
                        "denied_hosts": sorted({d["target"] for d in eg.get("denied", [])})[:10],
                        "bytes_out": eg.get("bytes_out", 0), "bytes_in": eg.get("bytes_in", 0), "log": eg.get("log")}
                if eg else None, **({"disk": result.disk} if result.disk else {}))
        except Exception as exc:  # the run happened: its result is not lost for want of a record
            import sys

            print(f"agentvm: warning: the run's exit could not be written to the audit chain: {exc}", file=sys.stderr)
        return result


def _grant_mode(m) -> str:
    """A grant's mode as recorded: review (writes held in a layer until accepted), rw or ro."""
    return "review" if getattr(m, "review", False) else ("rw" if m.writable else "ro")


def _shown_argv(argv) -> list[str]:
    """The command as recorded: bounded (an audit record is not a data store)."""
    out = [a if len(a) <= 200 else a[:200] + "..." for a in argv[:32]]
    return out + ([f"... ({len(argv) - 32} more)"] if len(argv) > 32 else [])
