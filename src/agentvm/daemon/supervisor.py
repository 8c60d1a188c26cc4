"""Supervision: a managed sandbox's runs (one lifecycle sequence each, ``Lifecycle.run_to_end``),
restarts of a persistent worker with backoff, its TTL and idle timeout, its stop, and the
recovery at ``agentvm up`` of what the last daemon left.

:class:`Supervisor` is a part of :class:`agentvm.daemon.control.ControlPlane` (it reads the
control plane's ``state``, ``managed``, ``stopping``, records, its lifecycle driver and the
effective policy of a row).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from pathlib import Path

from agentvm.daemon.events import refuse
from agentvm.daemon.gatehost import apply_live
from agentvm.errors import AgentVMError
from agentvm.policy_patch import LivePolicy

log = logging.getLogger("agentvm.daemon")

ACTIVITY_SAVE = 5.0  # seconds between writes of a busy sandbox's last activity to its row
ACTIVITY_RETRY = 30.0  # seconds before a failed write of it is tried again
STOP_GRACE = 2.0  # seconds a stopped sandbox has to exit
IDLE_RETRY = 30.0  # seconds before a failed idle action (a busy sandbox) is tried again
_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _clock() -> float:
    """Seconds on the clock of TTLs, idle timeouts and backoff: CLOCK_BOOTTIME - never stepped
    with the wall clock, and unlike CLOCK_MONOTONIC it runs on while the host is suspended (a
    TTL that ran out during a suspend has run out at the wake)."""
    return time.clock_gettime(_CLOCK)


class Managed:
    """A sandbox the daemon supervises (its live parts; the row in State is the truth)."""

    def __init__(self, name: str):
        self.name = name
        self.last_error: dict | None = None  # why its last start failed (the error object)
        self.task: asyncio.Task | None = None
        self.session = None  # the lifecycle driver's Session while it runs
        self.policy = None
        self.starts_again = 0  # starts redone in a row (StartAgain)
        self.stop_requested = asyncio.Event()
        self.started_at = 0.0
        # its last gate decision or exec: kept here, per request - on _clock for the idle
        # timeout, as wall time for its row, written there at most every ACTIVITY_SAVE seconds
        # (a SQLite commit per request cost more than the gate's whole decision, on the loop
        # every sandbox shares)
        self.activity_clock = 0.0
        self.activity = 0.0
        self.activity_saved = 0.0
        self.activity_save_failed = False
        self.activity_retry_at = 0.0  # (_clock)
        self.read_failed = False
        # its TTL or idle timeout ran out: it is not to run again, also if the disk refused to
        # record desired=stopped (cleared by the next start)
        self.expired = False
        self.suspending = False  # its run ends in a checkpoint, not an exit (issue 37)
        self.restore = None  # agentvm.checkpoint.Checkpoint: its next start restores this
        # (a snapshot's tar file, its sha256, replace): its next start's workspace
        self.seed: tuple[Path, str, bool] | None = None
        self.idle_action: str | None = None  # lifecycle.idle ran out with this action (suspend|pause)

    def active(self, t: float) -> None:
        """Activity at wall time ``t`` (an allowed gate decision, an exec): in memory only."""
        self.activity_clock = _clock()
        self.activity = max(self.activity, t)

    def touch(self, state, t: float) -> None:
        """Activity the daemon saw itself (an exec): in memory, and on the row at once (a row
        that cannot be written only loses what it shows; the idle clock is memory)."""
        self.active(t)
        try:
            state.touch(self.name, t)
        except (sqlite3.Error, OSError) as exc:
            log.warning("cannot save the last activity of %s: %s", self.name, exc)
            return
        self.activity_saved = max(self.activity_saved, t)

    def save_activity(self, state, *, now: float | None = None) -> None:
        """Write ``activity`` to the row if it moved (and, given ``now``, if the last write is
        ACTIVITY_SAVE old). The row never moves back (State.touch): a later exec stays."""
        if self.activity > self.activity_saved and (now is None or now - self.activity_saved >= ACTIVITY_SAVE):
            state.touch(self.name, self.activity)
            self.activity_saved = self.activity

    @property
    def handle(self):
        return self.session.handle if self.session is not None else None

    @property
    def endpoint(self):
        return self.session.endpoint if self.session is not None else None

    @property
    def backend(self):
        return self.session.backend if self.session is not None else None


def idle_policy(row):
    """The agent file's ``lifecycle.idle`` (None without one, or for a file that no longer parses)."""
    from agentvm.spec.loader import load_agent_text

    try:
        return getattr(load_agent_text(row.spec_text, row.spec_file).spec.spec, "idle", None)
    except Exception:  # noqa: BLE001 - its start parsed it; an idle policy is never a reason to fail
        return None


class StartAgain(Exception):
    """A start that must be redone from the sandbox's row (nothing of it has run yet)."""

    TRIES = 3

    def tries_left(self, m) -> bool:
        m.starts_again += 1
        return m.starts_again <= self.TRIES


class Supervisor:
    """Runs, restarts, TTLs and stops of managed sandboxes (a part of the ControlPlane)."""

    async def start(self, name: str, *, actor: str = "operator") -> None:
        """Start supervising ``name`` (returns at once; its state moves on in the background)."""
        row = self.state.get(name)
        if row is None:
            raise refuse("sandbox.not-found", f"no sandbox named {name!r}")
        m = self.managed.setdefault(name, Managed(name))
        if m.task is not None and not m.task.done():
            raise refuse("sandbox.already-running", f"{name} is already running")
        self.state.update(name, desired="running", state="starting")
        m.stop_requested = asyncio.Event()
        m.expired = False
        m.task = asyncio.ensure_future(self._supervise(m))
        self.record("lifecycle.start-requested", actor=actor, sandbox=name)

    async def _supervise(self, m: Managed) -> None:
        """Run the sandbox; restart a persistent worker with backoff; enforce TTL/idle."""
        backoff = 1.0
        while not m.stop_requested.is_set() and not self.stopping.is_set():
            row = self.state.get(m.name)
            if row is None:
                return
            if row.state != "starting":
                self.state.update(m.name, state="starting")
                row = self.state.get(m.name)
            try:
                code = await self._run_once(m, row)
            except StartAgain as again:
                if again.tries_left(m):
                    self.record("lifecycle.start-again", sandbox=m.name, reason=str(again))
                    continue
                m.last_error = {"error": "start-again", "message": str(again), "exit_code": 125,
                                "hint": f"start it again: `agentvm start {m.name}`"}
                self.state.update(m.name, state="failed", exit_code=None)
                self.record("lifecycle.failed", sandbox=m.name, error="start-again", message=str(again))
                return
            except AgentVMError as exc:
                m.last_error = exc.to_dict()
                self.state.update(m.name, state="failed", exit_code=None)
                self.record("lifecycle.failed", sandbox=m.name, error=exc.code, message=exc.message)
                return
            except Exception as exc:  # noqa: BLE001 - report, never crash the daemon
                m.last_error = {"error": "internal", "message": f"{type(exc).__name__}: {exc}",
                                "hint": "a bug in agent-vm: the daemon's log has the traceback", "exit_code": 125}
                self.state.update(m.name, state="failed")
                self.record("lifecycle.failed", sandbox=m.name, error="internal", message=f"{type(exc).__name__}: {exc}")
                return
            if m.suspending:  # checkpointed and torn down: it stays desired=running, resumable
                m.suspending = False
                self.state.update(m.name, state="suspended", exit_code=None)
                return
            if m.stop_requested.is_set() or self.stopping.is_set():
                break
            row = self.state.get(m.name)
            if row is None or row.lifecycle != "persistent" or row.desired != "running" or m.expired:
                self.state.update(m.name, state="exited", desired="stopped", exit_code=code)
                return
            ran = _clock() - m.started_at
            backoff = 1.0 if ran > 60 else min(backoff * 2, 60.0)
            self.state.update(m.name, state="backoff", restarts=row.restarts + 1, exit_code=code)
            self.record("lifecycle.restart-scheduled", sandbox=m.name, exit_code=code, backoff=backoff)
            try:
                await asyncio.wait_for(m.stop_requested.wait(), backoff)
            except asyncio.TimeoutError:
                pass
        if self.stopping.is_set() and not m.expired:
            # the daemon is going down (`agentvm down`, SIGTERM), not the sandbox: it stays
            # desired=running, and the next `up` brings it back (unless `up --no-resume`)
            self.state.update(m.name, state="stopped")
            self.record("lifecycle.stopped-with-daemon", sandbox=m.name)
        else:
            self.state.update(m.name, state="stopped", desired="stopped")

    async def _run_once(self, m: Managed, row) -> int:
        """One run of a supervised sandbox: the lifecycle sequence, on the daemon's gate."""
        policy = self.effective_policy(row)
        lc = self._lifecycle()
        log_path = self.paths.home / "logs" / f"{m.name}.log"
        fds: list[int] = []

        def stdio():
            log_path.parent.mkdir(parents=True, exist_ok=True)
            fds.append(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600))
            fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            return fds[1], fds[0], fds[0]

        def prepared(s):
            m.session, m.policy = s, policy
            if s.res.creds is not None:  # a fork: its ancestors' placeholders are leaks here
                ancestors = self.snapshots.lineage(m.name) if self._has_snapshots() else []
                if ancestors:
                    from agentvm import snapshot

                    s.res.creds = snapshot.with_ancestors(s.res.creds, tuple(s.policy.credentials), ancestors,
                                                          self.runtime.vault_dir, s.sandbox_id)

        restore, m.restore = m.restore, None
        seed, m.seed = m.seed, None

        async def attached(s):
            if s.endpoint is not None:
                await self._sync_endpoint(m, row, s.endpoint)
            if seed is not None:  # fork / restore: the workspace from a (verified) snapshot, before launch
                from agentvm import snapshot

                ws = s.res.workspace
                if ws is None:
                    raise refuse("config.invalid", f"{m.name} has no workspace to put a snapshot in")
                # extracted beside the current content, swapped in only when whole (a failure
                # leaves the workspace as it was: snapshot.no-room, checkpoint.tampered)
                await asyncio.to_thread(snapshot.untar_into, seed[0], seed[1], Path(ws.host_dir), s.res.host_uid,
                                        s.res.host_uid, replace=seed[2])
            if restore is not None:  # resume: the plan restores the checkpoint (checked again here)
                from agentvm import checkpoint

                await asyncio.to_thread(checkpoint.verify, restore, m.name, s.plan.policy_digest)
                s.plan = s.backend.restoring(s.plan, restore.dir)

        def launched(s):
            m.started_at = m.activity_clock = _clock()  # the TTL and idle clocks start here
            m.activity = m.activity_saved = now = time.time()
            self.state.update(m.name, state="running", sandbox_id=s.sandbox_id, started=now, last_activity=now)
            if restore is not None:
                self.record("lifecycle.resumed", sandbox=m.name, sandbox_id=s.sandbox_id, restored=restore.sandbox_id,
                            binding=restore.binding)
            self.record("lifecycle.running", sandbox=m.name, sandbox_id=s.sandbox_id, uid=s.res.host_uid,
                        substrate=s.plan.substrate, identity=s.plan.identity, policy=s.plan.policy_digest,
                        **({"gate": s.endpoint.placement} if s.endpoint is not None else {}))
            m.starts_again = 0
            # the sandbox holds its own copies of its stdio now: an idle worker costs the daemon
            # no descriptor for its log or for /dev/null
            for fd in fds:
                os.close(fd)
            fds.clear()

        def before_teardown(s):
            try:
                m.save_activity(self.state)  # the row keeps the last activity of a run that ended
            except Exception:  # noqa: BLE001 - a full disk must not keep a sandbox from being torn down
                log.exception("cannot save the last activity of %s", m.name)

        def after_teardown(s):
            for fd in fds:
                os.close(fd)
            fds.clear()
            m.session = None

        notes = lambda n: self._in_loop(lambda: self.record("lifecycle.workspace-repaired", sandbox=m.name,  # noqa: E731
                                                            note=n))
        try:
            # a resume keeps the placeholders its restored processes hold (a memory fork's
            # checkpoint carries none: a fork's are fresh, its parent's refused as leaks)
            keep = restore.placeholder_map() if restore is not None else None
            result = await lc.run_to_end(policy, stdio=stdio, notes=notes, stop=m.stop_requested, placeholders=keep,
                                         watch=lambda s: self._watch(m, row), grace=STOP_GRACE, on_session=prepared,
                                         attached=attached, launched=launched, before_teardown=before_teardown,
                                         after_teardown=after_teardown)
        finally:
            for fd in fds:  # (a failure before its teardown: opened, never launched)
                os.close(fd)
        self.state.update(m.name, exit_code=result.exit_code)
        self.record("lifecycle.exited", sandbox=m.name, sandbox_id=result.sandbox_id, exit_code=result.exit_code,
                    teardown_verified=bool(result.teardown.get("verified")))
        return result.exit_code

    async def _sync_endpoint(self, m: Managed, row, ep) -> None:
        """A just-opened endpoint gets the row's live changes (a change made while the sandbox
        was prepared is stored on the row but reached no endpoint: this one did not exist)."""
        try:
            fresh = self.state.get(m.name) or row
        except Exception:  # noqa: BLE001 - (a locked database: the row read at the start rules)
            log.warning("could not read %s's row again after attaching it", m.name, exc_info=True)
            fresh = row
        live = LivePolicy.from_json(fresh.policy_patch)
        if fresh.policy_patch != row.policy_patch:
            fresh_policy = self.effective_policy(fresh)
            if fresh_policy.limits.budget is not None and not ep.can_meter:
                # its gate (a worker) cannot meter it: this start is redone (nothing has run
                # yet), placed on the daemon's gate from the row that has it
                raise StartAgain("it was given an LLM budget while it started, which its gate worker cannot "
                                 "meter: started again on the daemon's gate")
            apply_live(ep, fresh_policy, live, self.paths)  # (its pause too)
            m.policy = fresh_policy
        else:
            ep.paused = live.is_paused
        ep.revoke(live.revoked_names)  # per-sandbox revocations survive restarts
        await ep.synced()  # (a gate worker: applied there before the launch)

    async def _watch(self, m: Managed, row) -> None:
        """TTL and idle timeout, on _clock (a wall clock set back or forward stretches or cuts
        neither); the row gets the last activity's wall time. A state database that fails
        (locked, full, read-only) ends neither the watch nor the sandbox: the last row read
        still rules, and each kind of failure is said once."""
        r = row
        idle = idle_policy(row)
        while True:
            await asyncio.sleep(0.5)
            clock = _clock()
            try:
                fresh = self.state.get(m.name)
            except (sqlite3.Error, OSError) as exc:
                if not m.read_failed:
                    log.warning("cannot read the row of %s (its TTL and idle timeout still hold): %s", m.name, exc)
                m.read_failed = True
            else:
                m.read_failed = False
                if fresh is None:
                    return
                r = fresh
            if clock >= m.activity_retry_at:
                try:
                    m.save_activity(self.state, now=time.time())
                except (sqlite3.Error, OSError) as exc:
                    # tried again after ACTIVITY_RETRY: a locked database blocks for its busy timeout
                    if not m.activity_save_failed:
                        log.warning("cannot save the last activity of %s: %s", m.name, exc)
                    m.activity_save_failed = True
                    m.activity_retry_at = clock + ACTIVITY_RETRY
                else:
                    m.activity_save_failed = False
            # either ends the sandbox for good: a persistent worker is not restarted after it
            if r.ttl and clock - m.started_at > r.ttl:
                self._expired(m, "lifecycle.ttl-expired", ttl=r.ttl)
                return
            if r.idle_timeout and clock - max(m.activity_clock, m.started_at) > r.idle_timeout:
                self._expired(m, "lifecycle.idle-timeout", idle_timeout=r.idle_timeout)
                return
            if (idle is not None and r.state == "running" and m.idle_action is None
                    and clock - max(m.activity_clock, m.started_at) > idle.after):
                if idle.action == "stop":
                    self._expired(m, "lifecycle.idle-timeout", idle_timeout=idle.after, action="stop")
                    return
                m.idle_action = idle.action  # (once: its own task, which this watch must not wait for)
                asyncio.ensure_future(self._idle_act(m, idle.action, idle.after))

    async def _idle_act(self, m: Managed, action: str, after: float) -> None:
        """lifecycle.idle ran out: pause or suspend it (recorded; a failure is said, the agent runs on)."""
        try:
            self.record("lifecycle.idle", sandbox=m.name, action=action, after=after)
            await (self.pause if action == "pause" else self.suspend)(m.name, actor="idle")
        except Exception as exc:  # noqa: BLE001 - the agent runs on, and the chain says why
            log.warning("the idle %s of %s failed: %s", action, m.name, exc)
            self.record("lifecycle.idle-failed", sandbox=m.name, action=action,
                        error=getattr(exc, "code", type(exc).__name__), message=str(exc)[:300])
            await asyncio.sleep(IDLE_RETRY)  # (not tried again at every tick of the watch)
        finally:
            m.idle_action = None

    def _expired(self, m: Managed, kind: str, **data) -> None:
        """A TTL or idle timeout ran out: recorded, and the sandbox is not to run again (the
        watch ends, and with it the run; ``expired`` keeps a persistent worker from being
        restarted even if the disk refuses to record desired=stopped)."""
        m.expired = True
        try:
            self.record(kind, sandbox=m.name, **data)
        except Exception:  # noqa: BLE001 - the sandbox is stopped all the same
            log.exception("cannot record %s of %s", kind, m.name)
        try:
            self.state.update(m.name, desired="stopped")
        except (sqlite3.Error, OSError) as exc:
            log.warning("cannot mark %s as stopped after its %s (it is stopped all the same): %s", m.name,
                        kind.rsplit(".", 1)[-1], exc)

    async def stop(self, name: str, *, actor: str = "operator") -> None:
        """Stop first, write after: a full or read-only disk never keeps a sandbox running."""
        row = self.state.get(name)
        if row is None:
            raise refuse("sandbox.not-found", f"no sandbox named {name!r}")
        m = self.managed.get(name)
        if m is not None and m.task is not None and not m.task.done():
            if m.handle is not None and row.state == "paused":  # thawed first: a frozen sandbox cannot exit
                try:
                    await asyncio.to_thread(m.backend.unpause, m.handle)
                except AgentVMError:
                    log.warning("cannot thaw %s before stopping it (its cgroup is killed all the same)", name)
            m.stop_requested.set()
            await asyncio.gather(m.task, return_exceptions=True)
        if row.state == "suspended" or self.checkpoints.get(name) is not None:
            self.checkpoints.drop(name)  # stopped for good: its checkpoint goes
            self.record("lifecycle.checkpoint-dropped", actor=actor, sandbox=name)
        self.record("lifecycle.stopped", actor=actor, sandbox=name)
        self._save(self.state.update, name, desired="stopped", state="stopped")

    async def wait_state(self, name: str, states: tuple, timeout: float) -> None:
        """Until ``name``'s row is in one of ``states`` (or gone), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.state.get(name)
            if r is None or r.state in states:
                return
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ recovery
    def _record_lost_runs(self) -> list[str]:
        """The runs and sessions an earlier daemon started and never saw end (it was killed,
        or the host went down): their sandboxes died with it (and were just reaped), so each
        gets its end on the chain - ``run.exited`` / ``lifecycle.exited`` with reason
        ``daemon-lost`` and no exit code - and `agentvm runs` never lists one as running
        forever. Only the daemon's own (actor ``agentvm``); embedded runs are their caller's."""
        from agentvm.audit import RUN_KINDS, fold_runs

        try:
            runs = fold_runs(self.audit.records(kinds=RUN_KINDS))
        except Exception:  # noqa: BLE001 - a chain that cannot be read is check_chain's to report
            return []
        lost = [r for r in runs if r.get("actor") == "agentvm" and r["duration"] is None]
        why = "the daemon that ran it stopped without seeing it end (killed, or the host went down)"
        for r in lost:
            if r["via"] == "run":
                self.record("run.exited", sandbox=r["run"], agent=r["agent"], exit_code=None, reason="daemon-lost",
                            detail=why)
            else:
                self.record("lifecycle.exited", sandbox=r["agent"], sandbox_id=r["run"], exit_code=None,
                            reason="daemon-lost", detail=why)
        return sorted(r["run"] for r in lost)

    async def recover(self, *, resume: bool = True) -> dict:
        """At `up` (after `down` or a crash): reap what the last daemon left, and restart the
        persistent workers that should run (``resume=False``: leave them stopped, recorded)."""
        from agentvm.runtime import gc_stale

        reaped = await asyncio.to_thread(gc_stale, self.paths)
        lost = self._record_lost_runs()
        restarted: list[str] = []
        left: list[str] = []
        for row in self.state.all():
            if str(row.spec_file).endswith("(canary)"):
                # a fleet canary the dead daemon was checking: its apply was interrupted, it goes
                self.state.fleet_put(row.name, None, None)
                reaped = [*reaped, f"canary {row.name}"]
                continue
            if row.state == "suspended":  # its checkpoint outlives the daemon: resumed on demand
                continue
            if row.state in ("running", "starting", "backoff", "paused") or row.desired == "running":
                self.state.update(row.name, state="stopped")
                if row.desired == "running" and row.lifecycle == "persistent" and resume:
                    await self.start(row.name, actor="recovery")
                    restarted.append(row.name)
                else:
                    if row.desired == "running" and row.lifecycle == "persistent":
                        left.append(row.name)
                    self.state.update(row.name, desired="stopped")
        interrupted = self.state.promotions_interrupted()
        self.record("daemon.recovered", reaped=reaped, restarted=restarted,
                    **({"not_resumed": left} if left else {}), **({"runs_lost": lost} if lost else {}),
                    **({"interrupted_promotions": interrupted} if interrupted else {}))
        return {"reaped": reaped, "restarted": restarted, "not_resumed": left}
