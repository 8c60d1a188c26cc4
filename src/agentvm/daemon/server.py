"""The control-plane daemon: owns state, supervises sandboxes, hosts the egress gate, applies
policy live, records everything in the audit chain, and streams events.

API: HTTP/1.1 + JSON over a unix socket with owner-only permissions (``<runtime>/agentvm.sock``),
and optionally over TCP with a bearer token (``--listen HOST:PORT``). One request per
connection; streaming responses (``exec``, ``events``) are newline-delimited JSON.

    GET    /v1/sandboxes                      ps
    POST   /v1/sandboxes                      create  {"spec": "<yaml>", "file": "...", "ttl", "idle_timeout"}
    POST   /v1/sandboxes/NAME/start|stop|restart
    DELETE /v1/sandboxes/NAME                 rm
    POST   /v1/sandboxes/NAME/exec            {"argv": [...], "timeout": s}  -> NDJSON stream
    GET    /v1/sandboxes/NAME/logs
    PUT    /v1/sandboxes/NAME/files?path=P    cp into the workspace (body = bytes)
    GET    /v1/sandboxes/NAME/files?path=P    cp out of the workspace
    POST   /v1/sandboxes/NAME/policy          {"op": allow|deny|remove|pause|resume|revoke|restore, ...}
    GET    /v1/audit?since=&sandbox=          GET /v1/audit/verify
    GET    /v1/events                         NDJSON stream of decisions and lifecycle events
    GET    /v1/approvals[/ID], POST /v1/approvals/ID/approve|deny
    POST   /v1/console/login                  a one-time login link for the web console
    POST   /v1/fleet/plan|apply|rollback, GET /v1/fleet/status   promotion (agentvm.fleet)
    POST   /v1/shutdown
    GET    /metrics                           Prometheus exposition (agentvm.observe.metrics)
    *      everything else                    the web console (agentvm.console; its own sessions on TCP)
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextvars
import dataclasses
import hmac
import json
import logging
import math
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import h11

from agentvm.audit import AuditLog
from agentvm.daemon import api
from agentvm.daemon.state import State
from agentvm.errors import AgentVMError, ConfigError, PolicyDenied
from agentvm.paths import Paths

log = logging.getLogger("agentvm.daemon")

SOCKET_NAME = "agentvm.sock"
MAX_BODY = 64 * 1024 * 1024
LARGE_BODY = 1024 * 1024  # bodies above this (cp uploads) are buffered at most UPLOADS at a time
UPLOADS = 2
BODY_TIMEOUT = 30.0  # seconds a request body may stall between reads
HEAD_TIMEOUT = 30.0  # seconds a TCP client has to send a whole request head (before any auth)
TCP_CONNECTIONS = 256  # TCP connections open at once (the unix socket is the owner's only)
CONSOLE_BODY = 64 * 1024  # a console form (and anything else sent before the console's own check)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ACTIVITY_SAVE = 5.0  # seconds between writes of a busy sandbox's last activity to its row
ACTIVITY_RETRY = 30.0  # seconds before a failed write of it is tried again
RESERVE = 8 * 1024 * 1024  # disk space held back for the daemon's own state when the disk fills
_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _clock() -> float:
    """Seconds on the clock of TTLs, idle timeouts and backoff: CLOCK_BOOTTIME - never stepped
    with the wall clock, and unlike CLOCK_MONOTONIC it runs on while the host is suspended (a
    TTL that ran out during a suspend has run out at the wake)."""
    return time.clock_gettime(_CLOCK)


# the request's stream reader, for handlers that must notice the client hanging up mid-response
_CLIENT_READER: contextvars.ContextVar = contextvars.ContextVar("agentvm_client_reader", default=None)
# this connection's run streams frames (agentvm.cli.fastrun's thin client) instead of NDJSON
_FRAMED: contextvars.ContextVar = contextvars.ContextVar("agentvm_framed", default=False)
FRAMES_TYPE = "application/x-agentvm-frames"


def _tail(path: Path, n: int) -> bytes:
    """The last ``n`` bytes of a log, read from the end (the log may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - n, 0))
            return f.read(n)
    except FileNotFoundError:
        return b""


class ClientGone(ConnectionError):
    """The client of a streamed answer went away (not an error of the run itself)."""


def _refuse(code: str, message: str, hint: str = "") -> AgentVMError:
    """An error of the API's own, by its registered code (agentvm.errorcodes: its HTTP status
    and exit code)."""
    return AgentVMError(message, hint=hint, code=code)


class Managed:
    """A sandbox the daemon supervises (its live parts; the row in State is the truth)."""

    def __init__(self, name: str):
        self.name = name
        self.last_error: dict | None = None  # why its last start failed (the error object)
        self.task: asyncio.Task | None = None
        self.session = None  # the lifecycle driver's Session while it runs
        self.policy = None
        self.starts_again = 0  # starts redone in a row (_StartAgain)
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


def _on_worker(ep) -> bool:
    """Whether a sandbox's endpoint is served by a gate worker (a RemoteEndpoint of
    agentvm.gate.workers), not by the daemon's own gate."""
    return ep is not None and not ep.can_meter


class _StartAgain(Exception):
    """A start that must be redone from the sandbox's row (nothing of it has run yet)."""

    TRIES = 3

    def tries_left(self, m) -> bool:
        m.starts_again += 1
        return m.starts_again <= self.TRIES


class DaemonGateHost:
    """The daemon's one gate, for the lifecycle driver: every sandbox of the daemon - supervised
    or ``agentvm run`` through it - is an endpoint of this gate (no second gate, no second
    compile). The driver calls it from worker threads; the gate lives on the daemon's loop."""

    def __init__(self, daemon: "Daemon") -> None:
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

            why = unplaceable(egress, extras, creds)
            if why is None:  # a gate worker serves it (agentvm.gate.workers)
                return self._call(workers.open(sandbox_id, agent, egress, Path(attachment.address), uid=uid,
                                               creds=creds), undo=workers.close)
            self.daemon._in_loop(lambda: self.daemon.record("gate.placement", sandbox_id=sandbox_id, gate="daemon",
                                                            reason=why))
        gate = self.daemon.gate

        async def undo(ep):
            await gate.close_endpoint(ep.sandbox_id)

        return self._call(gate.open_endpoint(sandbox_id, agent, egress, Path(attachment.address),
                                             uid=uid, creds=creds, extras=extras), undo=undo)

    def close(self, sandbox_id: str, ep) -> dict:
        from agentvm.lifecycle import egress_summary

        if _on_worker(ep):
            self._call(self.daemon.workers.close(ep))
            self.daemon._in_loop(lambda: self.daemon._count_bytes(ep, final=True))
            summary = egress_summary(ep)
            if ep.counts_lost:  # (the decision log and the audit chain still have every record)
                summary["incomplete"] = ("a gate worker serving this sandbox died and was replaced: these counts "
                                         "leave out what it had counted (its records are in the decision log)")
            return summary
        self._call(self.daemon.gate.close_endpoint(sandbox_id))
        self.daemon._in_loop(lambda: self.daemon._count_bytes(ep, final=True))
        return egress_summary(ep)


class Daemon:
    def __init__(self, paths: Paths, *, backend=None, listen: str | None = None, tracing=None,
                 gate_workers: int = 0, resume: bool = True) -> None:
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
        _make_reserve(self._reserve)
        self._uploads = UPLOADS  # free slots for large request bodies
        self._fleet_lock = asyncio.Lock()  # one apply or rollback at a time, from its plan to its end
        self.gate = Gate(self.paths.home / "gate", self.paths.home / "logs")
        self.gate.subscribers.append(self._on_decision)
        self.gate.approvals_factory = self._approval_store
        self.gate_workers = gate_workers  # worker processes serving sandboxes' egress (0: the gate above only)
        self.workers = None  # agentvm.gate.workers.WorkerPool, started by serve()
        self.managed: dict[str, Managed] = {}
        self.subscribers: set[asyncio.Queue] = set()
        self._tcp_conns = 0  # TCP connections open now (capped: TCP_CONNECTIONS)
        self.listen = listen
        self.token = None
        self.servers: list[asyncio.AbstractServer] = []
        self.stopping = asyncio.Event()
        self.socket_path = self.paths.runtime / SOCKET_NAME
        from agentvm.observe.metrics import CachedVerify, Observer

        self._bytes_seen: dict[str, tuple[int, int]] = {}  # sandbox id -> (out, in) counted to /metrics
        self.observer = Observer(sandboxes_by_state=self._by_state, approvals_pending=self._pending_count,
                                 audit_status=CachedVerify(self._verify_readonly, self.audit.length),
                                 workspace_dir=self.paths.workspaces)
        self._console = None  # the web console's app, made on its first request
        self.tracing = tracing  # observe.tracing.Tracing when an OTLP collector is configured
        if tracing is not None:
            from agentvm.gate.telemetry import TelemetryRelay

            self.gate.telemetry = TelemetryRelay(tracing.endpoint)

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

    # ---------------------------------------------------------------- what /metrics reads
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

    # ---------------------------------------------------------------- events & audit
    def emit(self, kind: str, **data) -> None:
        """Fan one event out to metrics, spans and the live streams. Never raises: a broken
        exporter or a stalled reader must not cost an audit record or an operator's action."""
        self._fan_out({"time": time.time(), "kind": kind, **data})

    def _fan_out(self, rec: dict) -> None:
        for sink in (self.observer.observe, self.tracing.observe if self.tracing is not None else None):
            if sink is None:
                continue
            try:
                sink(rec)
            except Exception:  # noqa: BLE001 - observability is never allowed to break control
                log.exception("observer failed on a %s event", rec.get("kind"))
        for q in list(self.subscribers):
            if q.qsize() >= SUBSCRIBER_BACKLOG:
                # a reader this far behind is cut off, told so (never silently skipped): its
                # queue is unbounded, so these two puts cannot fail
                self.subscribers.discard(q)
                q.put_nowait({"time": rec["time"], "kind": "stream.lagged",
                              "reason": f"this reader fell {SUBSCRIBER_BACKLOG} events behind and was cut off; "
                                        "reconnect and read the audit trail for what was missed"})
                q.put_nowait(None)
                continue
            q.put_nowait(rec)

    def record(self, kind: str, *, actor: str = "agentvm", sandbox: str | None = None, **data) -> None:
        """On the audit chain - or, while the disk refuses writes (full, read-only), queued in
        memory and written as soon as it takes them again: an operator's stop never waits for
        the disk, and no record is dropped while the daemon lives."""
        self._audit_queue.append((kind, actor, sandbox, data, time.time()))
        self.flush_audit()  # on the chain first: the live views come second
        self.emit(kind, actor=actor, sandbox=sandbox, **data)

    def _record_from_driver(self, kind: str, sandbox: str | None = None, **data) -> None:
        """The lifecycle driver's run records (``run.started``...), usually from a worker
        thread: on the chain now (a run that cannot be recorded does not start), an event
        from the loop."""
        try:
            try:
                self.audit.append(kind, actor="agentvm", sandbox=sandbox, data=data)
            except (sqlite3.Error, OSError) as exc:
                if not self._use_reserve(exc):
                    raise
                self.audit.append(kind, actor="agentvm", sandbox=sandbox, data=data)
        except (sqlite3.Error, OSError):
            if kind == "run.started":
                raise
            # the run happened: its record waits in the queue with the daemon's others
            self._in_loop(lambda: self.record(kind, sandbox=sandbox, **data))
            return
        self._in_loop(lambda: self.emit(kind, actor="agentvm", sandbox=sandbox, **data))

    def _worker_event(self, kind: str, **data) -> None:
        """A gate worker lost, replaced, or not replaceable (agentvm.gate.workers): on the chain."""
        log.warning("%s: %s", kind, json.dumps(data, default=str))
        self.record(kind, **data)

    def _in_loop(self, fn) -> None:
        if self.loop is None or threading.get_ident() == self._loop_thread:
            fn()
        else:
            self.loop.call_soon_threadsafe(fn)

    def _lifecycle(self):
        from agentvm.lifecycle import Lifecycle

        return Lifecycle(self.runtime, DaemonGateHost(self), self.tracing)

    def flush_audit(self) -> bool:
        while self._audit_queue:
            kind, actor, sandbox, data, at = self._audit_queue[0]
            if time.time() - at > 1.0:
                data = {**data, "queued_since": at}  # written late: when it really happened
            try:
                self.audit.append(kind, actor=actor, sandbox=sandbox, data=data)
            except (sqlite3.Error, OSError) as exc:
                if self._use_reserve(exc):
                    continue
                if not self._audit_stalled:
                    log.error("audit records are queued in memory: the audit chain cannot be written (%s)", exc)
                self._audit_stalled = True
                return False
            self._audit_queue.pop(0)
        self._audit_stalled = False
        return True

    def _use_reserve(self, exc: BaseException) -> bool:
        """The space kept for exactly this (``<home>/.reserve``): freed when a write fails for
        want of space, so the records of the operator's own actions still fit."""
        try:
            self._reserve.unlink()
        except OSError:
            return False
        log.error("the disk under %s is full (%s): released the %d MiB reserve so the daemon can keep its state",
                  self.paths.home, exc, RESERVE >> 20)
        return True

    def _save(self, fn, *args, **kw):
        """A state write that may use the reserve once; anything else is the caller's error."""
        try:
            return fn(*args, **kw)
        except (sqlite3.Error, OSError) as exc:
            if not self._use_reserve(exc):
                raise _refuse("state.unwritable", f"agent-vm's state cannot be written: {exc}",
                               hint=f"free space on the filesystem of {self.paths.home} (or make it writable)") from None
            return fn(*args, **kw)

    def _count_bytes(self, ep, final: bool = False) -> None:
        """The gate's byte counters of ``ep`` since they were last counted, to /metrics: the
        same counters as the run report (so the two agree), counted as they move."""
        sid = ep.sandbox_id
        prev = self._bytes_seen.pop(sid, (0, 0)) if final else self._bytes_seen.get(sid, (0, 0))
        out, inn = ep.bytes_out, ep.bytes_in
        if out != prev[0] or inn != prev[1]:
            self.observer.count_bytes(ep.agent, out - prev[0], inn - prev[1])
            if not final:
                self._bytes_seen[sid] = (out, inn)

    def _on_decision(self, rec: dict) -> None:
        """Every gate decision is an event; denials, alerts and credential uses go to the audit chain."""
        self._fan_out({"time": rec.get("time") or time.time(), "kind": "egress", **rec})  # (emit's event, one copy)
        ep = self.gate.endpoints.get(rec.get("sandbox"))
        if ep is not None:
            self._count_bytes(ep)
        name = rec.get("agent")
        m = self.managed.get(name) if name else None
        if m is not None and rec.get("verdict") == "allow":
            m.active(rec.get("time") or time.time())  # (the row follows within ACTIVITY_SAVE: _watch)
        if rec.get("verdict") == "deny" or rec.get("alert") or rec.get("credentials"):
            data = {k: rec.get(k) for k in ("sandbox", "host", "port", "method", "path", "rule", "verdict", "reason",
                                            "alert", "credentials", "credential", "suppressed") if rec.get(k) is not None}
            self._audit_queue.append(("egress." + rec.get("verdict", "?"), "gate", name, data, time.time()))
            self.flush_audit()

    # ---------------------------------------------------------------- lifecycle
    def _policy_for(self, row):
        from agentvm.gate.policy import compile_egress
        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent_text

        loaded = load_agent_text(row.spec_text, row.spec_file)
        policy = compile_policy(loaded.spec)
        patch = json.loads(row.policy_patch or "{}")
        if patch.get("allow") or patch.get("deny") or patch.get("removed"):
            eg = policy.egress or compile_egress(None)
            extra = compile_egress(None, extra_allow=patch.get("allow", []))
            removed = set(patch.get("removed", []))
            allow = tuple(r for r in eg.allow + extra.allow if r.id not in removed)
            deny = tuple(r for r in eg.deny + tuple(_deny_rules(patch.get("deny", []))) if r.id not in removed)
            from agentvm.policy import _with_default_denies

            policy = dataclasses.replace(policy, egress=_with_default_denies(dataclasses.replace(eg, allow=allow, deny=deny)))
        if patch.get("tools") and policy.tools is not None:
            from agentvm.tools.policy import apply_live

            policy = dataclasses.replace(policy, tools=apply_live(policy.tools, patch["tools"]))
        from agentvm.policy import check_tier

        check_tier(policy)  # a live change may not widen past the agent's risk tier
        if patch.get("budget"):  # a budget changed live (raised, lowered, added) holds for later starts too
            from agentvm.gate.budget import BudgetSpec

            b = patch["budget"]
            cur = policy.limits.budget or BudgetSpec()
            spec = cur.with_limits(**{k: b[k] for k in ("tokens", "requests", "cost") if k in b})
            policy = dataclasses.replace(policy, limits=dataclasses.replace(policy.limits, budget=spec))
        lim = patch.get("limits") or {}
        if lim:  # live-tightened limits hold for every later start too (only ever lower)
            cur = policy.limits
            policy = dataclasses.replace(policy, limits=dataclasses.replace(
                cur,
                memory=min(cur.memory, int(lim.get("memory", cur.memory))),
                pids=min(cur.pids, int(lim.get("pids", cur.pids))),
                cpus=min(cur.cpus, float(lim.get("cpus", cur.cpus))),
            ))
        return policy

    async def start(self, name: str, *, actor: str = "operator") -> None:
        row = self.state.get(name)
        if row is None:
            raise _refuse("sandbox.not-found", f"no sandbox named {name!r}")
        m = self.managed.setdefault(name, Managed(name))
        if m.task is not None and not m.task.done():
            raise _refuse("sandbox.already-running", f"{name} is already running")
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
            except _StartAgain as again:
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
        """One run of a supervised sandbox, through the lifecycle driver, on the daemon's gate."""
        policy = self._policy_for(row)
        lc = self._lifecycle()
        s = await asyncio.to_thread(lc.prepare, policy, tty=False,
                                    notes=lambda n: self._in_loop(lambda: self.record(
                                        "lifecycle.workspace-repaired", sandbox=m.name, note=n)))
        m.session, m.policy = s, policy
        log_path = self.paths.home / "logs" / f"{m.name}.log"
        logfd = devnull = -1
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            logfd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            await asyncio.to_thread(lc.attach, s)
            if s.endpoint is not None:
                # the row again: a live change made while the sandbox was prepared is stored
                # there but reached no endpoint (this one did not exist yet)
                try:
                    fresh = self.state.get(m.name) or row
                except Exception:  # noqa: BLE001 - (a locked database: the row read at the start rules)
                    log.warning("could not read %s's row again after attaching it", m.name, exc_info=True)
                    fresh = row
                patch = json.loads(fresh.policy_patch or "{}")
                if fresh.policy_patch != row.policy_patch:
                    fresh_policy = self._policy_for(fresh)
                    if fresh_policy.limits.budget is not None and _on_worker(s.endpoint):
                        # a gate worker cannot meter it: this start is redone (nothing has run yet),
                        # placed on the daemon's gate from the row that has it
                        raise _StartAgain("it was given an LLM budget while it started, which its gate worker cannot "
                                          "meter: started again on the daemon's gate")
                    self._apply_live(s.endpoint, fresh_policy, patch)  # (its pause too)
                    m.policy = fresh_policy
                else:
                    s.endpoint.paused = bool(patch.get("paused"))
                if s.endpoint.creds is not None:  # per-sandbox revocations survive restarts
                    s.endpoint.creds.local_revoked.update(patch.get("revoked", []))
                if _on_worker(s.endpoint):  # on a gate worker: applied there before the launch
                    await s.endpoint.synced()
            await asyncio.to_thread(lc.launch, s, (devnull, logfd, logfd))
            m.started_at = m.activity_clock = _clock()  # the TTL and idle clocks start here
            m.activity = m.activity_saved = now = time.time()
            self.state.update(m.name, state="running", sandbox_id=s.sandbox_id, started=now, last_activity=now)
            self.record("lifecycle.running", sandbox=m.name, sandbox_id=s.sandbox_id, uid=s.res.host_uid, substrate=s.plan.substrate,
                        identity=s.plan.identity, policy=s.plan.policy_digest,
                        **({"gate": getattr(s.endpoint, "placement", "daemon")} if s.endpoint is not None else {}))
            m.starts_again = 0
            waiter = asyncio.ensure_future(lc.wait_async(s))
            watch = asyncio.ensure_future(self._watch(m, row))
            stop = asyncio.ensure_future(m.stop_requested.wait())
            try:
                done, _ = await asyncio.wait({waiter, stop, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done and not watch.cancelled() and watch.exception() is not None:
                    log.error("the watch of %s failed: the sandbox is stopped", m.name, exc_info=watch.exception())
                if waiter not in done:
                    await asyncio.to_thread(lc.stop, s, 2.0)
                await waiter
            finally:  # (also when stopping failed: no watch outlives its run)
                for t in (watch, stop):
                    t.cancel()
        finally:
            try:
                m.save_activity(self.state)  # the row keeps the last activity of a run that ended
            except Exception:  # noqa: BLE001 - a full disk must not keep a sandbox from being torn down
                log.exception("cannot save the last activity of %s", m.name)
            await asyncio.to_thread(lc.teardown, s)
            for fd in (logfd, devnull):
                if fd >= 0:
                    os.close(fd)
            m.session = None
        result = await asyncio.to_thread(lc.result, s)
        self.state.update(m.name, exit_code=result.exit_code)
        self.record("lifecycle.exited", sandbox=m.name, sandbox_id=s.sandbox_id, exit_code=result.exit_code,
                    teardown_verified=bool(result.teardown.get("verified")))
        return result.exit_code

    async def _watch(self, m: Managed, row) -> None:
        """TTL and idle timeout, on _clock (a wall clock set back or forward stretches or cuts
        neither); the row gets the last activity's wall time. A state database that fails
        (locked, full, read-only) ends neither the watch nor the sandbox: the last row read
        still rules, and each kind of failure is said once."""
        r = row
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
            raise _refuse("sandbox.not-found", f"no sandbox named {name!r}")
        m = self.managed.get(name)
        if m is not None and m.task is not None and not m.task.done():
            m.stop_requested.set()
            await asyncio.gather(m.task, return_exceptions=True)
        self.record("lifecycle.stopped", actor=actor, sandbox=name)
        self._save(self.state.update, name, desired="stopped", state="stopped")

    # ---------------------------------------------------------------- recovery
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
            if row.state in ("running", "starting", "backoff") or row.desired == "running":
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

    # ---------------------------------------------------------------- HTTP plumbing
    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            if self._audit_queue:
                self.flush_audit()

    async def serve(self) -> None:
        self.loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        # recover before answering anyone: a client that sees the socket sees a clean state
        self._flush_task = asyncio.ensure_future(self._flusher())
        if self.gate_workers:  # before recover(): it starts persistent sandboxes
            from agentvm.gate.workers import WorkerPool

            self.workers = WorkerPool(self.gate_workers, self.gate.state_dir, self.gate.log_dir,
                                      on_record=self._on_decision, on_event=self._worker_event,
                                      telemetry=self.tracing.endpoint if self.tracing is not None else None)
            await self.workers.start()
            self.record("gate.workers", count=self.gate_workers, pids=self.workers.pids())
        await self.recover(resume=self.resume)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()
        old = os.umask(0o177)
        try:
            srv = await asyncio.start_unix_server(self._conn, path=str(self.socket_path))
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self.servers.append(srv)
        if self.listen:
            host, _, port = self.listen.rpartition(":")
            tok = self.paths.home / "daemon.token"
            if not tok.exists():
                fd = os.open(tok, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=") + b"\n")
                os.close(fd)
            self.token = tok.read_text().strip()
            self.servers.append(await asyncio.start_server(lambda r, w: self._conn(r, w, tcp=True), host or "127.0.0.1",
                                                           int(port)))
        self.record("daemon.started", pid=os.getpid(), socket=str(self.socket_path), tcp=self.listen)
        await self.stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        if getattr(self, "_flush_task", None) is not None:
            self._flush_task.cancel()
        for srv in self.servers:
            srv.close()
        tasks = []
        for name, m in self.managed.items():
            if m.task is not None and not m.task.done():
                m.stop_requested.set()
                tasks.append(m.task)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        if self.workers is not None:
            await self.workers.stop()
        for q in list(self.subscribers):
            q.put_nowait(None)
        self.record("daemon.stopped", pid=os.getpid())
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans reach the collector
        if self._audit_queue:  # the disk never took them: at least the log shows what they were
            for kind, actor, sandbox, data, at in self._audit_queue:
                log.error("unwritten audit record: %s", json.dumps({"time": at, "kind": kind, "actor": actor,
                                                                    "sandbox": sandbox, "data": data}, default=str))
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, tcp: bool = False) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
        _CLIENT_READER.set(reader)
        held: list[bool] = []  # whether this request holds an upload slot
        if tcp:
            if self._tcp_conns >= TCP_CONNECTIONS:  # unauthenticated peers cannot hold the loop's sockets
                writer.close()
                return
            self._tcp_conns += 1
        try:
            req, body = await self._read_request(conn, reader, held, tcp)
            if req is None:
                return
            actor = "operator-tcp" if tcp else "operator"
            if req.method != b"GET":
                # a client that gave up (its timeout) while the daemon was stopped or busy must not
                # have its change applied late, unseen: a request whose connection is gone is dropped
                await asyncio.sleep(0)
                if reader.at_eof():
                    self.record("operator.request-dropped", actor=actor, method=req.method.decode(),
                                target=req.target.decode()[:200], reason="the client closed the connection first")
                    return
            if _is_console(req.target):
                return await self._serve_console(req, body, conn, writer, reader, tcp)
            await self._dispatch(req.method.decode(), req.target.decode(), body, conn, writer, actor)
        except AgentVMError as e:  # every refusal: its status and exit code from agentvm.errorcodes
            await self._fail(conn, writer, e.status, e.to_dict())
            if e.status in (408, 413, 429, 401):
                await _drain(reader, writer)  # a client still sending its body then reads our answer
        except h11.RemoteProtocolError as e:
            try:  # not HTTP: still an answer that says so, not a silently closed connection
                await self._fail(conn, writer, 400, _refuse("api.bad-request", f"not a valid HTTP request: {e}").to_dict())
            except Exception:
                pass
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        except Exception as e:  # noqa: BLE001
            log.exception("internal error serving a request")
            try:
                await self._fail(conn, writer, 500, {"error": "internal", "message": f"{type(e).__name__}: {e}",
                                                     "hint": "a bug in agent-vm: the daemon's log has the traceback",
                                                     "exit_code": 125})
            except Exception:
                pass
        finally:
            if tcp:
                self._tcp_conns -= 1
            if held:
                self._uploads += 1
            try:
                writer.close()
            except Exception:
                pass

    async def _read_request(self, conn, reader, held: list[bool], tcp: bool = False):
        """One request, its body bounded in size, in time (BODY_TIMEOUT between reads) and in
        how many large ones are buffered at once; on TCP the token is checked before a byte of
        the body is read."""
        req, body = None, bytearray()
        console_limit = False
        # a TCP peer (not yet authenticated) has HEAD_TIMEOUT for the whole head; the owner's
        # unix socket may idle before its first byte
        head_deadline = time.monotonic() + HEAD_TIMEOUT if tcp else None
        # a console body on TCP is read before its session is checked: all of it within one
        # deadline (no trickle of a byte per BODY_TIMEOUT can hold a connection slot)
        unauth_deadline = time.monotonic() + HEAD_TIMEOUT + BODY_TIMEOUT if tcp else None
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                if req is not None:
                    wait = BODY_TIMEOUT
                    if console_limit:
                        wait = min(wait, max(0.0, unauth_deadline - time.monotonic()))
                elif head_deadline is not None:
                    wait = max(0.0, head_deadline - time.monotonic())
                else:
                    wait = None
                try:
                    data = await asyncio.wait_for(reader.read(65536), wait)
                except asyncio.TimeoutError:
                    if req is None:
                        raise _refuse("api.timeout", f"no whole request head within {HEAD_TIMEOUT:g}s") from None
                    raise _refuse("api.timeout", f"the request body stalled for {BODY_TIMEOUT:g}s") from None
                conn.receive_data(data)
                if not data and req is None:
                    return None, b""
                continue
            if isinstance(ev, h11.Request):
                req = ev
                length = next((v for k, v in ev.headers if k.lower() == b"content-length"), b"0")
                size = int(length) if length.isdigit() else 0
                if tcp and _is_console(ev.target):
                    # the console checks its own sessions (a browser has a cookie, not the
                    # token); what it may be sent before that check is small
                    if size > CONSOLE_BODY:
                        raise _refuse("api.too-large", f"a console request over {CONSOLE_BODY} bytes")
                    console_limit = True
                elif tcp:
                    auth = next((v.decode("latin-1") for k, v in ev.headers if k.lower() == b"authorization"), "")
                    if not (self.token and auth.startswith("Bearer ") and hmac.compare_digest(auth[7:], self.token)):
                        raise _refuse("api.unauthorized", "a bearer token is required on the TCP listener")
                if size > MAX_BODY:
                    raise _refuse("api.too-large", f"request body of {size} bytes is over the limit of {MAX_BODY}")
                if size > LARGE_BODY:
                    self._take_upload_slot(held)
            elif isinstance(ev, h11.Data):
                body += ev.data
                if console_limit and len(body) > CONSOLE_BODY:
                    raise _refuse("api.too-large", f"a console request over {CONSOLE_BODY} bytes")
                if len(body) > MAX_BODY:
                    raise _refuse("api.too-large", "request body too large")
                if len(body) > LARGE_BODY and not held:  # a chunked body grew large: same rule
                    self._take_upload_slot(held)
            elif isinstance(ev, h11.EndOfMessage):
                return req, bytes(body)
            elif isinstance(ev, h11.ConnectionClosed):
                return None, b""

    def _take_upload_slot(self, held: list[bool]) -> None:
        # a large body is buffered whole: only a few at a time, the rest are told to retry
        if self._uploads <= 0:
            raise _refuse("api.busy", f"{UPLOADS} large uploads are already in progress",
                           hint="retry in a moment")
        self._uploads -= 1
        held.append(True)

    async def _json(self, conn, writer, status: int, doc) -> None:
        data = json.dumps(doc, sort_keys=True, default=str).encode()
        writer.write(conn.send(h11.Response(status_code=status, headers=[("content-type", "application/json"),
                                                                         ("content-length", str(len(data))),
                                                                         ("connection", "close")])))
        writer.write(conn.send(h11.Data(data=data)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    async def _raw(self, conn, writer, status: int, data: bytes, ctype: str) -> None:
        writer.write(conn.send(h11.Response(status_code=status, headers=[("content-type", ctype),
                                                                         ("content-length", str(len(data))),
                                                                         ("connection", "close")])))
        writer.write(conn.send(h11.Data(data=data)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    # ---------------------------------------------------------------- the web console
    def console(self):
        if self._console is None:
            from agentvm.console.app import Console

            self._console = Console(self)
        return self._console

    def _console_login(self, actor: str) -> dict:
        """A one-time login link for a browser (minted for whoever holds the API: the socket's
        owner or the token's holder)."""
        if not self.listen:
            raise _refuse("console.no-listener", "the console is served on the daemon's TCP listener, and this daemon "
                           "has none", hint="restart the daemon with `agentvm up --listen 127.0.0.1:7070`")
        from agentvm.console.app import CODE_TTL

        code = self.console().sessions.mint_code()
        self.record("console.login-link", actor=actor, expires_in=CODE_TTL)
        host, _, port = self.listen.rpartition(":")
        host = host or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return {"url": f"http://{host}:{port}/login?code={code}", "expires_in": CODE_TTL}

    async def _serve_console(self, req, body: bytes, conn, writer, reader, tcp: bool) -> None:
        """One request to the console app (ASGI, in-process), framed back through h11."""
        app = self.console()
        target = req.target.decode("ascii", "replace")
        path, _, query = target.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method.decode("ascii", "replace"), "scheme": "http", "path": path,
                 "raw_path": path.encode("ascii", "replace"), "query_string": query.encode("ascii", "replace"),
                 "root_path": "", "headers": [(bytes(k).lower(), bytes(v)) for k, v in req.headers],
                 "client": ("127.0.0.1", 0) if tcp else None, "server": None, "state": {},
                 "agentvm.transport": "tcp" if tcp else "unix"}
        delivered = False
        gone = asyncio.Event()

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not gone.is_set():  # until the browser goes away (a stream ends with it)
                try:
                    while await reader.read(65536):
                        pass
                except (ConnectionError, OSError):
                    pass
                gone.set()
            return {"type": "http.disconnect"}

        async def send(msg):
            kind = msg.get("type")
            if kind == "http.response.start":
                headers = [(k, v) for k, v in msg.get("headers", []) if k.lower() not in (b"connection",)]
                headers.append((b"connection", b"close"))
                status = int(msg["status"])
                writer.write(conn.send(h11.Response(status_code=status, headers=headers, reason=_phrase(status))))
            elif kind == "http.response.body":
                if msg.get("body"):
                    writer.write(conn.send(h11.Data(data=bytes(msg["body"]))))
                if not msg.get("more_body", False):
                    writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()

        await app(scope, receive, send)

    async def _fail(self, conn, writer, status: int, doc: dict) -> None:
        """One error path for every route: an error object (code, message, hint, exit code - what
        the embedded path prints), as the response, or as the last line of a response that is
        already streaming (a refusal found after a run's output began)."""
        if conn.our_state is h11.SEND_BODY:
            if _FRAMED.get():
                from agentvm.runreport import error_text

                text = error_text(str(doc.get("error", "daemon.error")), str(doc.get("message", "")),
                                  str(doc.get("hint") or ""))
                await self._stream_exit(conn, writer, doc.get("exit_code", 125), text)
            else:
                await self._stream_line(conn, writer, {"error": doc})
            await self._stream_end(conn, writer)
        elif conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._json(conn, writer, status, doc)

    async def _stream_start(self, conn, writer) -> None:
        ctype = FRAMES_TYPE if _FRAMED.get() else "application/x-ndjson"
        writer.write(conn.send(h11.Response(status_code=200, headers=[("content-type", ctype),
                                                                      ("connection", "close")])))
        await writer.drain()

    async def _stream_frame(self, conn, writer, kind: bytes, payload: bytes) -> None:
        """One frame of a framed run: ``KIND LENGTH\\n PAYLOAD`` (o: stdout, e: stderr, x: the end)."""
        writer.write(conn.send(h11.Data(data=kind + str(len(payload)).encode() + b"\n" + payload)))
        await writer.drain()

    async def _stream_exit(self, conn, writer, exit_code, text: str) -> None:
        """A framed run's last frame: its exit code, and what the client prints on stderr."""
        code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else 125
        await self._stream_frame(conn, writer, b"x", f"{code}\n{text}".encode("utf-8", "replace"))

    async def _stream_line(self, conn, writer, doc) -> None:
        writer.write(conn.send(h11.Data(data=json.dumps(doc, default=str).encode() + b"\n")))
        await writer.drain()

    async def _stream_end(self, conn, writer) -> None:
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    # ---------------------------------------------------------------- routes
    async def _dispatch(self, method: str, target: str, body: bytes, conn, writer, actor: str) -> None:
        u = urlsplit(target)
        parts = [p for p in u.path.split("/") if p]
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        doc = _json_body(body) if body and method in ("POST",) and parts[-1:] != ["files"] else None
        if parts == ["metrics"] and method == "GET":
            data = await asyncio.to_thread(self.observer.exposition)
            return await self._raw(conn, writer, 200, data, METRICS_TYPE)
        if parts[:1] != ["v1"]:
            raise _refuse("api.no-route", "unknown path")
        p = parts[1:]
        if p == ["openapi.json"] and method == "GET":
            from agentvm import __version__

            return await self._json(conn, writer, 200, api.openapi(__version__))
        if p[:1] == ["run"] and method == "POST" and isinstance(doc, dict) and "framing" in doc:
            # a client of this session's first framed runs: refused before anything runs
            raise _refuse("api.bad-request", "'framing' is not a field of /v1/run: the framed run is "
                           "POST /v1/run/frames", "reinstall agent-vm's client: bash scripts/install.sh")
        model = _body_model(method, p)
        if model is not None:  # typed, whole, before any handler reads it (a wrong type is a 400)
            doc = api.parse(model, doc).fields()
        query = _query_model(method, p)
        if query is not None:
            q = api.parse_query(query, q).fields()
        if p == ["sandboxes"] and method == "GET":
            return await self._json(conn, writer, 200, [self._public(r) for r in self.state.all()])
        if p == ["sandboxes"] and method == "POST":
            return await self._json(conn, writer, 201, self._public(await self._create(doc or {}, actor)))
        if len(p) >= 2 and p[0] == "sandboxes":
            name = p[1]
            action = p[2] if len(p) > 2 else None
            if action is None and method == "GET":
                return await self._json(conn, writer, 200, self._public(self._row(name)))
            if action is None and method == "DELETE":
                ws = await self._rm(name, actor, keep_workspace=q.get("keep_workspace") in ("1", "true"))
                return await self._json(conn, writer, 200, {"removed": name, "workspace": ws})
            if action in ("start", "stop", "restart") and method == "POST":
                if action in ("stop", "restart"):
                    await self.stop(name, actor=actor)
                if action in ("start", "restart"):
                    m = self.managed.get(name)
                    if m is not None:
                        m.last_error = None
                    await self.start(name, actor=actor)
                    await self._wait_state(name, ("running", "exited", "failed", "stopped"), 30)
                    m = self.managed.get(name)
                    if self._row(name).state == "failed" and m is not None and m.last_error:
                        # a start that failed is an error, with the reason, as an embedded run's
                        e = m.last_error
                        err = _refuse(e["error"], f"{name} failed to start: {e['message']}", e.get("hint", ""))
                        from agentvm.errorcodes import lookup

                        if lookup(e["error"]) is None:  # ("internal", "start-again"): as the error said
                            err.exit_code = e.get("exit_code", 125)
                            err.status = 409 if err.exit_code in (77, 78) else 500
                        raise err
                return await self._json(conn, writer, 200, self._public(self._row(name)))
            if action == "exec" and method == "POST":
                return await self._exec(name, doc or {}, conn, writer, actor)
            if action == "logs" and method == "GET":
                path = self.paths.home / "logs" / f"{name}.log"
                self._row(name)
                tail = min(q.get("tail", 1 << 20), 16 << 20)  # (api.LogsQuery: a whole number >= 0)
                data = await asyncio.to_thread(_tail, path, tail)
                return await self._json(conn, writer, 200, {"log": data.decode(errors="replace")})
            if action == "files":
                return await self._files(name, method, q.get("path", ""), body, conn, writer, actor,
                                         tar=q.get("tar") == "1")
            if action == "policy" and method == "POST":
                return await self._json(conn, writer, 200, await self._policy(name, doc or {}, actor))
        if p == ["console", "login"] and method == "POST":
            return await self._json(conn, writer, 200, self._console_login(actor))
        if p[:1] == ["approvals"]:
            return await self._approvals(method, p[1:], doc or {}, q, conn, writer, actor)
        if p[:1] == ["fleet"]:
            return await self._json(conn, writer, 200, await self._fleet(method, p[1:], doc or {}, actor))
        if p == ["run"] and method == "POST":
            return await self._run(doc or {}, conn, writer, actor)
        if p == ["run", "frames"] and method == "POST":
            # the thin client's: the same run, answered in frames (a daemon without this path
            # answers 404 before running anything, and the client takes the full path)
            _FRAMED.set(True)
            return await self._run(doc or {}, conn, writer, actor)
        if p == ["audit"] and method == "GET":
            recs = self.audit.records(since=_since(q["since"]) if "since" in q else None, sandbox=q.get("sandbox"))
            return await self._json(conn, writer, 200, [r.to_dict() for r in recs])
        if p == ["audit", "verify"] and method == "GET":
            return await self._json(conn, writer, 200, self.audit.verify().to_dict())
        if p == ["events"] and method == "GET":
            return await self._events(conn, writer)
        if p == ["shutdown"] and method == "POST":
            self.record("daemon.shutdown-requested", actor=actor)
            await self._json(conn, writer, 200, {"stopping": True})
            self.stopping.set()
            return
        raise _refuse("api.no-route", f"no route for {method} {u.path}")

    def _row(self, name: str):
        row = self.state.get(name)
        if row is None:
            raise _refuse("sandbox.not-found", f"no sandbox named {name!r}")
        return row

    def _public(self, row) -> dict:
        d = row.public()
        m = self.managed.get(row.name)
        if m is not None and m.handle is not None:
            d["substrate"] = m.session.plan.substrate
            d["identity"] = m.session.plan.identity
        return d

    async def _wait_state(self, name: str, states: tuple, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.state.get(name)
            if r is None or r.state in states:
                return
            await asyncio.sleep(0.01)

    async def _create(self, doc: dict, actor: str):
        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent_text

        text, fname = doc["spec"], doc.get("file", "<api>")  # (api.CreateSandbox)
        loaded = load_agent_text(text, fname)
        policy = compile_policy(loaded.spec)
        if policy.pending_features:
            raise PolicyDenied("the agent declares " + ", ".join(policy.pending_features) + ", which cannot be enforced yet")
        name = loaded.spec.metadata.name
        if self.state.get(name) is not None:
            raise _refuse("sandbox.exists", f"a sandbox named {name!r} exists", hint=f"agentvm rm {name}")
        row = self.state.create(name, text, fname, policy.lifecycle, doc.get("ttl"), doc.get("idle_timeout"))
        self.record("lifecycle.created", actor=actor, sandbox=name, file=fname, policy=policy.digest(),
                    lifecycle=policy.lifecycle)
        return row

    async def _rm(self, name: str, actor: str, keep_workspace: bool = False) -> dict:
        """Stop, then remove the agent's workspace (unless kept: ``--keep-workspace`` or the
        agent file's ``workspace.keep``; recorded before it is removed), then its row: a
        workspace refused as in use leaves the agent registered, so ``rm`` can be retried."""
        from agentvm import workspace

        row = self._row(name)
        await self.stop(name, actor=actor)
        ws = workspace.on_agent_removed(
            self.paths.workspaces, name, keep=keep_workspace, spec_text=row.spec_text, runtime=self.paths.runtime,
            record=lambda kind, data: self.record(kind, actor=actor, sandbox=name, **data))
        self._save(self.state.delete, name)
        self.managed.pop(name, None)
        self.record("lifecycle.removed", actor=actor, sandbox=name, workspace=ws)
        return ws

    async def _exec(self, name: str, doc: dict, conn, writer, actor: str) -> None:
        m = self.managed.get(name)
        if m is None or m.handle is None:
            raise _refuse("sandbox.not-running", f"{name} is not running", hint=f"agentvm start {name}")
        argv = doc["argv"]  # (api.Exec: a non-empty list of strings)
        m.touch(self.state, time.time())
        self.record("operator.exec", actor=actor, sandbox=name, argv=argv)
        backend = m.backend
        o_r, o_w = os.pipe2(os.O_CLOEXEC)
        e_r, e_w = os.pipe2(os.O_CLOEXEC)
        stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        fut = asyncio.ensure_future(asyncio.to_thread(backend.exec, m.handle, argv, stdio=(stdin, o_w, e_w),
                                                      timeout=doc.get("timeout")))
        began = time.time()
        await self._stream_start(conn, writer)
        status = await self._pump(conn, writer, {o_r: "stdout", e_r: "stderr"}, fut, (o_w, e_w, stdin))
        trace = m.session.trace if m.session is not None else None
        if trace is not None:
            trace.span("exec", began, attributes={"agentvm.exec.command": os.path.basename(argv[0])[:128],
                                                  "agentvm.exec.exit_code": status.exit_code,
                                                  "agentvm.exec.timed_out": bool(status.timed_out)})
        await self._stream_line(conn, writer, {"exit_code": status.exit_code, "timed_out": status.timed_out,
                                               "setup_error": status.setup_error})
        await self._stream_end(conn, writer)

    async def _pump(self, conn, writer, streams: dict[int, str], fut, our_ends: tuple[int, ...], on_gone=None):
        """Stream a command's output pipes to the client *while* it runs, then return its result.

        Back-pressure, not buffering: at most a few chunks are queued; when the client reads
        slowly the pipes stop being read, fill, and the writer inside the sandbox blocks - the
        root daemon's memory never grows with a command's output. ``our_ends`` (our copies of
        the child's stdio) are closed only once the blocking call is over, so no fd number is
        freed while another thread may still use it. A client that goes away stops receiving;
        the pipes are still drained until the command ends (``on_gone()`` may end it sooner)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=8)
        paused: set[int] = set()
        live = set(streams)

        def readable(fd):
            if queue.full():
                loop.remove_reader(fd)
                paused.add(fd)
                return
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
            queue.put_nowait((fd, data))

        for fd in streams:
            os.set_blocking(fd, False)
            loop.add_reader(fd, readable, fd)
        ends_open, client = True, True

        def gone() -> None:
            nonlocal client
            client = False
            if on_gone is not None:
                on_gone()

        creader = _CLIENT_READER.get()
        hangup = asyncio.ensure_future(creader.read(1)) if creader is not None else None
        try:
            while live:
                get = asyncio.ensure_future(queue.get())
                waits = {get, fut} if ends_open else {get}
                if hangup is not None and client:
                    waits.add(hangup)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if hangup is not None and client and hangup.done():
                    if hangup.cancelled() or hangup.exception() is not None or hangup.result() == b"":
                        gone()
                    hangup = None
                if ends_open and fut.done():
                    for fd in our_ends:
                        os.close(fd)
                    ends_open = False
                if not get.done():
                    get.cancel()
                    continue
                fd, data = get.result()
                if not data:
                    live.discard(fd)
                elif client:
                    try:
                        if _FRAMED.get():
                            await self._stream_frame(conn, writer, b"o" if streams[fd] == "stdout" else b"e", data)
                        else:
                            await self._stream_line(conn, writer, {"stream": streams[fd],
                                                                   "data": base64.b64encode(data).decode()})
                    except (ConnectionError, OSError):
                        gone()
                for p in paused:
                    if p in live:
                        loop.add_reader(p, readable, p)
                paused.clear()
        finally:
            if hangup is not None and not hangup.done():
                hangup.cancel()
            for fd in streams:
                loop.remove_reader(fd)
            if ends_open:
                await asyncio.wait({fut})
                for fd in our_ends:
                    os.close(fd)
            for fd in streams:
                os.close(fd)
        if not client:
            raise ClientGone("the client went away")
        return await fut

    async def _run(self, doc: dict, conn, writer, actor: str) -> None:
        """`agentvm run` through the daemon: one sandbox for one command, output streamed,
        the same policy semantics as the embedded path (the same library builds it)."""
        from agentvm.errors import HostEnvironmentError

        try:
            policy = self._run_policy(doc)
        except (PolicyDenied, HostEnvironmentError) as exc:
            # refused before the lifecycle's own preflight (a tier ceiling, an option): on the
            # chain all the same, as every refused run is
            self.record("run.refused", actor=actor, agent=_spec_name(doc.get("spec")), code=exc.code,
                        message=exc.message[:500])
            raise
        if not policy.command:
            raise _refuse("api.bad-request", "nothing to run")
        return await self._run_policy_streamed(policy, doc, conn, writer, actor)

    def _run_policy(self, doc: dict):
        """The policy of a run request (the same code as the embedded run builds it with)."""
        from agentvm.policy import MountGrant, Policy, compile_policy, with_overrides
        from agentvm.spec.loader import load_agent_text

        if doc.get("spec"):
            dirs = [Path(d) for d in doc["preset_dirs"]] if doc.get("preset_dirs") is not None else None
            policy = compile_policy(load_agent_text(doc["spec"], doc.get("file", "<api>"), preset_dirs=dirs).spec)
        else:
            net = (doc.get("cli") or {}).get("network") if isinstance(doc.get("cli"), dict) else doc.get("network")
            policy = Policy(name="run", network=net if net in ("gate", "none") else "gate")
        if isinstance(doc.get("cli"), dict):
            # the thin client's options as typed: parsed here by the same code as embedded runs
            from agentvm.overrides import from_cli

            policy = with_overrides(policy, **from_cli(doc["cli"], doc.get("command")))
        else:
            policy = with_overrides(
                policy,
                command=tuple(doc.get("command") or ()) or None,
                mounts=tuple(MountGrant(m["host"], m["path"], bool(m.get("writable"))) for m in doc.get("mounts", [])),
                env=doc.get("env") or {},
                timeout=doc.get("timeout"),
                memory=doc.get("memory"),
                allow=tuple(doc.get("allow") or ()),
                hosts=doc.get("hosts") or {},
                network=doc.get("network"),
                substrate=doc.get("substrate"),
            )
        return policy

    async def _run_policy_streamed(self, policy, doc: dict, conn, writer, actor: str) -> None:
        o_r, o_w = os.pipe2(os.O_CLOEXEC)
        e_r, e_w = os.pipe2(os.O_CLOEXEC)
        i_r, i_w = os.pipe2(os.O_CLOEXEC)
        stdin_data = base64.b64decode(doc.get("stdin") or "")

        def feed_stdin():
            try:
                if stdin_data:
                    os.write(i_w, stdin_data)
            except OSError:
                pass
            finally:
                os.close(i_w)

        self.record("operator.run", actor=actor, sandbox=policy.name, command=list(policy.command))
        lc = self._lifecycle()
        sess: list = []

        def run_blocking():
            # the same driver as the embedded run, on the daemon's own gate
            s = lc.prepare(policy, tty=False)
            sess.append(s)
            try:
                lc.attach(s)
                lc.launch(s, (i_r, o_w, e_w))
                lc.wait(s)
            finally:
                lc.teardown(s)
            return lc.result(s)

        fut = asyncio.ensure_future(asyncio.to_thread(run_blocking))

        def client_gone():
            # like Ctrl-C on an embedded run: the caller is gone, so is the run
            self.record("operator.run-abandoned", sandbox=policy.name, reason="the client went away")
            for s in sess:
                if s.handle is not None:
                    asyncio.ensure_future(asyncio.to_thread(lc.stop, s, 1.0))

        feeder = asyncio.ensure_future(asyncio.to_thread(feed_stdin))
        await self._stream_start(conn, writer)
        try:
            result = await self._pump(conn, writer, {o_r: "stdout", e_r: "stderr"}, fut, (o_w, e_w, i_r), client_gone)
        except ConnectionError as exc:
            if isinstance(exc, ClientGone):
                raise
            # the run's own failure (not the client's leaving): an answer, in the stream
            log.exception("a run failed")
            raise _refuse("internal.bug", f"the run failed: {type(exc).__name__}: {exc}",
                           "a bug in agent-vm: the daemon's log has the traceback") from exc
        finally:
            await feeder
        if _FRAMED.get():
            from agentvm.runreport import render

            await self._stream_exit(conn, writer, result.exit_code, render(result.to_dict()))
        else:
            await self._stream_line(conn, writer, {"result": result.to_dict()})
        await self._stream_end(conn, writer)

    def _workspace_dir(self, name: str) -> Path:
        m = self.managed.get(name)
        s = m.session if m is not None else None
        if s is None or s.res.workspace is None or s.handle is None:
            raise _refuse("sandbox.not-running", f"{name} is not running (its workspace is mounted only while it runs)")
        return Path(s.res.workspace.host_dir), s.res.host_uid

    async def _files(self, name, method, rel, body, conn, writer, actor, tar: bool = False):
        """cp: one file, or with ``tar`` a folder as a tar stream (files.write_tree_beneath /
        read_tree_beneath: the same path checks for every member)."""
        from agentvm.daemon import files

        self._row(name)  # 404 for a sandbox that does not exist, before "not running"
        root, uid = self._workspace_dir(name)
        if method == "PUT":
            if tar:
                got = await asyncio.to_thread(files.write_tree_beneath, root, rel, body, uid)
                self.record("operator.cp-in", actor=actor, sandbox=name, path=rel, folder=True, **got)
                return await self._json(conn, writer, 200, {"written": got["bytes"], "path": rel, **got})
            n = await asyncio.to_thread(files.write_beneath, root, rel, body, uid)
            self.record("operator.cp-in", actor=actor, sandbox=name, path=rel, bytes=n)
            return await self._json(conn, writer, 200, {"written": n, "path": rel})
        if method == "GET":
            if tar and await asyncio.to_thread(files.is_dir_beneath, root, rel):
                data, got = await asyncio.to_thread(files.read_tree_beneath, root, rel)
                self.record("operator.cp-out", actor=actor, sandbox=name, path=rel, folder=True, **got)
                return await self._json(conn, writer, 200, {"path": rel, "kind": "tar", **got,
                                                            "data": base64.b64encode(data).decode()})
            data = await asyncio.to_thread(files.read_beneath, root, rel)
            self.record("operator.cp-out", actor=actor, sandbox=name, path=rel, bytes=len(data))
            return await self._json(conn, writer, 200, {"path": rel, "kind": "file",
                                                        "data": base64.b64encode(data).decode()})
        raise _refuse("api.method-not-allowed", "use GET or PUT")

    def _policy_view(self, name: str, row, patch: dict) -> dict:
        """What a sandbox's gate enforces now: the agent file's rules with the live changes."""
        policy = self._policy_for(row)
        m = self.managed.get(name)
        live = m is not None and m.endpoint is not None

        def rule(r, kind):
            return {"id": r.id, "kind": kind, "host": r.host, "ports": list(r.ports) or "all",
                    **({"methods": list(r.methods)} if r.methods else {}), **({"paths": list(r.paths)} if r.paths else {})}

        eg = policy.egress
        return {"name": name, "network": policy.network, "live": live, "paused": bool(patch.get("paused")),
                "rules": ([rule(r, "deny") for r in eg.deny] + [rule(r, "allow") for r in eg.allow]) if eg else [],
                "revoked": patch.get("revoked", []), "limits": {"memory": policy.limits.memory, "pids": policy.limits.pids,
                                                                "cpus": policy.limits.cpus},
                "tools": [{"server": sp.name, "allow": list(sp.allow), "approve": list(sp.approve), "deny": list(sp.deny)}
                          for sp in (policy.tools.servers if policy.tools else ())],
                "budget": self._budget_view(name, policy)}

    def _budget_view(self, name: str, policy) -> dict | None:
        spec = policy.limits.budget
        if spec is None:
            return None
        m = self.managed.get(name)
        ep = m.endpoint if m else None
        if ep is not None and getattr(ep, "budget", None) is not None:
            usage = ep.budget.usage
        else:
            from agentvm.gate.budget import BudgetStore

            usage = BudgetStore(self.paths.home / "budgets.db").load(policy.name)
        return {"tokens": spec.tokens, "requests": spec.requests, "cost": spec.cost, "hosts": list(spec.hosts),
                "used": usage.to_dict(), "by_model": usage.by_model}

    async def _policy(self, name: str, doc: dict, actor: str) -> dict:
        """Live policy change: validated first (a failing change changes nothing), applied to
        the running endpoint at once, recorded, and kept for restarts."""
        from agentvm.gate.policy import compile_egress

        row = self._row(name)
        op = doc.get("op")
        patch = json.loads(row.policy_patch or "{}")
        m = self.managed.get(name)
        ep = m.endpoint if m else None
        t0 = time.perf_counter()
        if op == "budget" and _on_worker(ep) and any(
                doc.get(k) is not None for k in ("tokens", "requests", "cost")):
            # a gate worker cannot meter (the only live op that adds what a worker does not
            # carry: allow/deny/remove rules are never `action: ask`, tools ops change only a
            # tool gateway, which it has none of); refused before anything is changed
            raise _refuse("policy.gate-worker", f"{name} is served by gate {ep.placement}, which cannot meter an LLM "
                           "budget (its counters, shared by an agent's sandboxes, live in the daemon)",
                           hint=f"nothing was changed; to set one, put it in the agent file and restart the sandbox "
                           f"(`agentvm restart {name}`): it is then served by the daemon's own gate")
        if op in ("allow", "deny"):
            rules = doc.get("rules") or [doc["rule"]]  # (api.PolicyRule: one of them, strings)
            try:
                compile_egress(None, extra_allow=rules)  # validates
            except ValueError as exc:
                raise _refuse("policy.invalid-rule", str(exc)) from None
            patch.setdefault(op, []).extend(rules)
        elif op == "remove":
            rid = doc["rule_id"]  # (api.PolicyRemove)
            current = self._policy_for(row).egress
            ids = [r.id for r in (current.allow + current.deny)] if current is not None else []
            if rid not in ids:
                raise _refuse("policy.no-such-rule", f"{name} has no rule {rid!r}" + (f" (its rules: {', '.join(ids)})" if ids else ""),
                               hint=f"`agentvm policy {name} show` lists the rules and their ids")
            from agentvm.policy import default_deny_rules

            if rid in {r.id for r in default_deny_rules()}:
                raise _refuse("policy.rule-not-removable", f"{rid!r} is a deny rule every sandbox gets (DNS-over-HTTPS "
                               "endpoints): it cannot be removed")
            patch.setdefault("removed", []).append(rid)
        elif op == "tools":
            from agentvm.tools.policy import LIVE_ACTIONS, apply_live, split_name

            action, exposed = doc.get("action"), doc.get("tool")
            split = split_name(exposed) if isinstance(exposed, str) else None
            if action not in LIVE_ACTIONS or split is None:
                raise _refuse("api.bad-request", "tools needs an action (allow, deny, approve) and a tool as "
                               "SERVER__TOOL (a glob may follow the server: SERVER__read_*)")
            current = self._policy_for(row).tools
            if current is None:
                raise _refuse("tools.none-declared", f"{name} declares no tools (spec.tools)")
            change = {"action": action, "server": split[0], "tool": split[1]}
            try:
                apply_live(current, [change])
            except ValueError as exc:
                raise _refuse("tools.invalid-change", str(exc)) from None
            patch.setdefault("tools", []).append(change)
        elif op == "budget":
            change = {}
            for k, kind in (("tokens", int), ("requests", int), ("cost", float)):
                v = doc.get(k)
                if v is None:
                    continue
                try:
                    if isinstance(v, bool):
                        raise ValueError
                    v = kind(v)
                    if not math.isfinite(v) or v <= 0 or (kind is int and v != doc.get(k)):
                        raise ValueError
                except (TypeError, ValueError):
                    raise _refuse("budget.invalid", f"budget {k} is a positive {'whole ' if kind is int else ''}"
                                   f"number, not {doc.get(k)!r}") from None
                change[k] = v
            if not change and not doc.get("reset"):
                raise _refuse("api.bad-request", "budget: give --tokens, --requests, --cost and/or --reset")
            patch["budget"] = {**patch.get("budget", {}), **change}
            if doc.get("reset"):
                from agentvm.gate.budget import BudgetStore

                BudgetStore(self.paths.home / "budgets.db").reset(self._policy_for(row).name)
                if ep is not None and getattr(ep, "budget", None) is not None:
                    ep.budget.reset()
        elif op == "show":
            return self._policy_view(name, row, patch)
        elif op in ("pause", "resume"):
            patch["paused"] = op == "pause"
        elif op in ("revoke", "restore"):
            cred = doc.get("credential")
            policy = m.policy if m and m.policy else self._policy_for(row)
            b = next((b for b in policy.credentials if b.name == cred), None)
            if b is None:
                raise _refuse("policy.no-such-credential", f"{name} has no credential {cred!r}")
            # kept in the sandbox's state: a restart (which the agent can provoke by exiting)
            # starts with the credential still revoked
            revoked = set(patch.get("revoked", []))
            (revoked.add if op == "revoke" else revoked.discard)(cred)
            patch["revoked"] = sorted(revoked)
            if ep is not None and ep.creds is not None:
                # in the gate's memory: the very next request sees it
                (ep.creds.local_revoked.add if op == "revoke" else ep.creds.local_revoked.discard)(cred)
                if b.ref.startswith("vault:"):  # and recorded in the vault, per session
                    from agentvm.vault import Vault

                    v = Vault(self.runtime.vault_dir)
                    (v.revoke if op == "revoke" else v.restore)(b.ref[6:], m.session.sandbox_id)
        elif op == "limits":
            if m is None or m.handle is None:
                raise _refuse("sandbox.not-running", "live limits need a running sandbox")
            from agentvm.units import parse_size

            try:
                mem = parse_size(doc["memory"]) if doc.get("memory") is not None else None
                pids = int(doc["pids"]) if doc.get("pids") is not None else None
                cpus = float(doc["cpus"]) if doc.get("cpus") is not None else None
                if (mem is not None and mem < 16 * 1024**2) or (pids is not None and pids < 8) or (cpus is not None and cpus <= 0):
                    raise ValueError("below the minimum (16M memory, 8 pids, >0 cpus)")
                applied = await asyncio.to_thread(m.backend.set_limits, m.handle, memory=mem, pids=pids, cpus=cpus)
            except AgentVMError as exc:
                raise _refuse("limits.unsupported", exc.message) from None
            except (ValueError, KeyError) as exc:
                raise _refuse("limits.invalid", str(exc)) from None
            patch["limits"] = {**patch.get("limits", {}), **applied}  # and for every later start
            self.state.update(name, policy_patch=json.dumps(patch))
            took = (time.perf_counter() - t0) * 1000
            self.record("policy.change", actor=actor, sandbox=name, op="limits", detail=applied, applied_live=True,
                        ms=round(took, 3))
            return {"applied": True, "live": True, "ms": round(took, 3), "limits": applied}
        else:
            raise _refuse("api.bad-request", "op is one of show, allow, deny, remove, pause, resume, revoke, restore, "
                           "limits, tools, budget")
        new_row = dataclasses.replace(row, policy_patch=json.dumps(patch))
        policy = self._policy_for(new_row)  # raises on anything invalid: nothing applied yet
        self.state.update(name, policy_patch=json.dumps(patch))
        if ep is not None:
            self._apply_live(ep, policy, patch)
            if _on_worker(ep):  # on a gate worker: applied there before this call returns
                await ep.synced()
        took = (time.perf_counter() - t0) * 1000
        self.record("policy.change", actor=actor, sandbox=name, op=op, detail={k: v for k, v in doc.items() if k != "op"},
                    applied_live=ep is not None, ms=round(took, 3))
        return {"applied": True, "live": ep is not None, "ms": round(took, 3), "patch": patch}

    def _apply_live(self, ep, policy, patch: dict) -> None:
        """A sandbox's policy (its file's, with the live changes in ``patch``) onto its running
        endpoint: the next request is decided under it. (Revocations are the caller's.)"""
        if policy.egress is not None:
            ep.set_policy(policy.egress)
        ep.paused = bool(patch.get("paused"))
        if ep.tools is not None and policy.tools is not None:
            ep.tools.set_policy(policy.tools, policy.digest())  # the next tool call is decided under it
        if policy.limits.budget is not None:  # the next request is checked against it
            if getattr(ep, "budget", None) is not None:
                ep.budget.set_spec(policy.limits.budget)
            elif _on_worker(ep):
                # a gate worker cannot meter: never the case of a budget op (refused first), nor
                # of a start (placed on the daemon's gate); here only when the row's file gained a
                # budget it is not running yet (a fleet update between its stop and start): it
                # applies at that start
                pass
            else:
                from agentvm.gate.budget import Budget, BudgetStore

                ep.set_budget(Budget(ep.agent, policy.limits.budget, BudgetStore(self.paths.home / "budgets.db")))

    async def _approvals(self, method: str, p: list, doc: dict, q: dict, conn, writer, actor: str) -> None:
        """The approvals queue over the API (the SDK, a webhook's answer): list, show, approve, deny."""
        from agentvm.approvals import STATES, ApprovalError

        store = self.gate.approval_store()
        if store is None:
            raise _refuse("approvals.unavailable", "the approvals queue cannot be opened")
        try:
            if not p and method == "GET":
                states = STATES if q.get("all") in ("1", "true") else ("pending",)
                return await self._json(conn, writer, 200, [r.to_dict() for r in store.list(states)])
            if len(p) == 1 and method == "GET":
                return await self._json(conn, writer, 200, store.get(p[0]).to_dict())
            if len(p) == 2 and p[1] in ("approve", "deny") and method == "POST":
                # typed by api.ApprovalAnswer; a digest binds the approval to the request shown
                by = f"{doc['via']} via api:{actor}" if doc.get("via") else f"api:{actor}"
                r = store.answer(p[0], p[1] == "approve", by, doc.get("note"), doc.get("digest"))
                return await self._json(conn, writer, 200, r.to_dict())
        except ApprovalError as exc:
            if "no approval request" in exc.message:
                raise _refuse("approvals.not-found", exc.message, exc.hint) from None
            raise
        raise _refuse("api.no-route", "approvals: GET /v1/approvals[/ID], POST /v1/approvals/ID/approve|deny")

    # ---------------------------------------------------------------- fleet promotion
    def _fleet_current(self) -> tuple[dict, str | None]:
        """name -> what runs now (its policy from the stored spec, without live changes), and
        the commit of the last applied promotion."""
        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent_text

        meta = self.state.fleet_agents()
        cur = {}
        for row in self.state.all():
            try:
                policy = compile_policy(load_agent_text(row.spec_text, row.spec_file).spec)
            except AgentVMError:
                continue
            cur[row.name] = {"policy": policy, "digest": policy.digest(), "fleet": row.name in meta,
                             "running": row.state in ("running", "starting", "backoff"), "desired": row.desired,
                             "state": row.state, "row": row}
            if row.policy_patch not in ("", "{}"):
                cur[row.name]["live"] = row.policy_patch
                try:
                    cur[row.name]["effective"] = self._policy_for(row)
                except AgentVMError:
                    pass
        done = [x for x in self.state.promotions() if x["result"] in ("applied", "rolled-back")]
        return cur, (done[0]["commit"] if done else None)

    async def _fleet_plan(self, doc: dict):
        from agentvm import fleet as fl

        repo, ref = doc["repo"], doc.get("commit") or "HEAD"  # (api.FleetPlan)
        sha = await asyncio.to_thread(fl.resolve, repo, ref)
        trust = fl.load_trust(self.paths.home)
        fleet = await asyncio.to_thread(fl.load, repo, sha, trust=trust)
        cur, previous = self._fleet_current()
        meta = self.state.fleet_agents()
        for name, c in cur.items():  # another repository's agents are not this plan's to remove
            if c["fleet"] and meta.get(name, {}).get("repo") != fleet.repo:
                c["fleet"] = False
        plan = fl.make_plan(fleet, {k: {kk: v[kk] for kk in ("policy", "digest", "fleet", "running", "live", "effective")
                                        if kk in v} for k, v in cur.items()}, previous)
        rp = doc.get("replay")
        if rp is not None:  # (api.Replay: since >= 0, last 1..100000)
            since, last = rp.get("since"), rp.get("last") or 1000
            for a in plan.actions:
                if a.kind in ("update", "create") or (a.kind == "unchanged" and rp.get("all")):
                    old = cur.get(a.name, {}).get("policy")
                    recs = await asyncio.to_thread(fl.recorded, self.paths.home / "logs", a.name, since=since, last=last)
                    a.replay = fl.replay(recs, old, fleet.agents[a.name].policy)
        return fleet, plan, ref

    async def _fleet(self, method: str, p: list, doc: dict, actor: str) -> dict:
        from agentvm import fleet as fl

        if p == ["plan"] and method == "POST":
            fleet, plan, ref = await self._fleet_plan(doc)
            out = plan.to_dict()
            out["ref"] = ref
            self.record("fleet.planned", actor=actor, repo=plan.repo, commit=plan.commit, ref=ref, digest=out["digest"],
                        changes=out["changes"], widening=out["widening"],
                        breakage=sum(len((a.replay or {}).get("breakage", [])) for a in plan.actions))
            return out
        if p == ["apply"] and method == "POST":
            async def planned():
                if not fl.is_full_id(str(doc.get("commit") or "")):
                    raise _refuse("fleet.not-a-commit-id", "apply takes a full commit id (40 hex digits), not a "
                                   "branch, a tag or a short id",
                                   hint="`agentvm apply` resolves a ref and shows it first (with --yes)")
                fleet, plan, _ = await self._fleet_plan(doc)
                if plan.commit != doc["commit"]:
                    raise _refuse("fleet.not-a-commit-id", f"{doc['commit']} resolves to {plan.commit}")
                want = doc.get("digest")
                if want is not None and want != plan.digest():
                    raise _refuse("fleet.plan-changed", "the plan changed since it was shown (the daemon's state or "
                                   "the repository moved)", hint="run `agentvm plan` again and review it")
                return fleet, plan

            return await self._fleet_exclusive(planned, doc, actor, doc.get("repo"), doc.get("commit"))
        if p == ["status"] and method == "GET":
            return self._fleet_status()
        if p == ["rollback"] and method == "POST":
            to = doc.get("to")
            hist = self.state.promotions(200)
            if to is None:
                last = next((x for x in hist if x["result"] in ("applied", "rolled-back")), None)
                if last is None or not last["previous"]:
                    raise _refuse("fleet.no-rollback-target", "no earlier promotion is recorded to go back to")
                repo, to = last["repo"], last["previous"]
            else:
                match = next((x for x in hist if x["commit"].startswith(str(to)) and len(str(to)) >= 7
                              and x["result"] in ("applied", "rolled-back")), None)
                if match is None:
                    raise _refuse("fleet.no-such-promotion", f"no promotion of a commit {to!r} is recorded",
                                   hint="`agentvm status --json` lists the promotions")
                repo, to = match["repo"], match["commit"]
            async def planned():
                fleet, plan, _ = await self._fleet_plan({"repo": repo, "commit": to})
                return fleet, plan

            return await self._fleet_exclusive(planned, {"canary": doc.get("canary")}, actor, repo, to, rollback=True)
        raise _refuse("api.no-route", "fleet: POST /v1/fleet/plan|apply|rollback, GET /v1/fleet/status")

    async def _fleet_exclusive(self, planned, doc: dict, actor: str, repo, commit, rollback: bool = False) -> dict:
        """An apply or a rollback: one at a time, holding the fleet lock from its plan to its
        end; a refusal before anything is applied (not a commit id, unsigned, plan changed)
        is on the audit chain too."""
        if self._fleet_lock.locked():
            raise _refuse("fleet.busy", "another apply or rollback is in progress",
                           hint="wait for it (`agentvm status`), then plan again")
        async with self._fleet_lock:
            try:
                fleet, plan = await planned()
            except AgentVMError as exc:
                self.record("fleet.refused", actor=actor, repo=str(repo)[:500], commit=str(commit)[:100],
                            error=exc.code, message=exc.message[:500], **({"rollback": True} if rollback else {}))
                raise
            return await self._fleet_apply(fleet, plan, doc, actor, rollback=rollback)

    async def _fleet_apply(self, fleet, plan, doc: dict, actor: str, rollback: bool = False) -> dict:
        """Apply exactly ``plan`` (creates, then updates, then removes), each agent atomically:
        its new spec and fleet record in one transaction; an update that does not come up
        (or fails its canary) is put back on its old version and the apply stops there."""
        from agentvm import fleet as fl

        canary = fleet.config.get("canary") or {}
        canary_all = bool(doc.get("canary"))
        pid = self.state.promotion_start(plan.repo, plan.commit, plan.previous, plan.digest(), actor)
        self.record("fleet.rollback-started" if rollback else "fleet.apply-started", actor=actor, repo=plan.repo,
                    commit=plan.commit, previous=plan.previous, digest=plan.digest(), signed=plan.signed)
        done, failed = [], None
        try:
            failed = await self._fleet_actions(fleet, plan, canary, canary_all, actor, done)
        except BaseException as exc:  # noqa: BLE001 - the promotion is always closed and recorded
            failed = {"agent": None, "error": "internal", "message": f"{type(exc).__name__}: {exc}"[:500]}
            if not isinstance(exc, Exception):
                self.state.promotion_end(pid, "failed", json.dumps(failed))
                raise
        result = "failed" if failed else ("rolled-back" if rollback else "applied")
        self.state.promotion_end(pid, result, json.dumps(failed) if failed else None)
        self.record("fleet." + result, actor=actor, repo=plan.repo, commit=plan.commit, previous=plan.previous,
                    digest=plan.digest(), agents=done, failure=failed)
        return {"result": result, "commit": plan.commit, "previous": plan.previous, "done": done, "failure": failed,
                "digest": plan.digest()}

    async def _fleet_actions(self, fleet, plan, canary: dict, canary_all: bool, actor: str, done: list) -> dict | None:
        from agentvm import fleet as fl

        failed = None
        for a in plan.actions:
            if a.kind == "unchanged":
                # the same content: only the record of which commit it comes from moves on
                fa = fleet.agents.get(a.name)
                self.state.fleet_touch(a.name, {"repo": fleet.repo, "commit": fleet.commit, "path": fa.path,
                                                "digest": fa.digest})
                continue
            fa = fleet.agents.get(a.name)
            try:
                if a.kind == "remove":
                    if self.state.get(a.name) is not None:
                        await self.stop(a.name, actor=actor)
                    self.state.fleet_put(a.name, None, None)
                    self.managed.pop(a.name, None)
                    self.record("lifecycle.removed", actor=actor, sandbox=a.name, commit=plan.commit)
                else:
                    check = a.kind == "update" and (canary_all or fl.matches(a.name, list(canary.get("agents") or [])))
                    await self._fleet_put_agent(fleet, fa, a, actor, canary=(canary if check else None))
                done.append(a.name)
            except AgentVMError as exc:
                failed = {"agent": a.name, "error": exc.code, "message": exc.message}
            if failed:
                break
        return failed

    async def _fleet_put_agent(self, fleet, fa, action, actor: str, canary: dict | None) -> None:
        old = self.state.get(fa.name)
        old_meta = self.state.fleet_agents().get(fa.name)
        spec = {"spec_text": fa.spec_text, "spec_file": f"{fleet.repo}@{fleet.commit[:12]}:{fa.path}",
                "lifecycle": fa.policy.lifecycle, "policy_patch": "{}"}
        meta = {"repo": fleet.repo, "commit": fleet.commit, "path": fa.path, "digest": fa.digest}
        was_running = old is not None and old.desired == "running"
        if canary is not None and was_running:
            # beside the old version, which keeps running: the new one under a name of its own
            # (its own uid, a fresh workspace: the durable one has one writer), checked, removed
            await self._fleet_canary_beside(fleet, fa, actor, canary)
            # the replacement still has to come up (checked below): no second stay-up window, but
            # its health check has as long to pass as the canary had - it has only just started
            canary = {**canary, "seconds": 0, "settle": float(canary.get("seconds", 3))}
        if old is not None and old.policy_patch not in ("", "{}"):
            self.record("fleet.live-changes-dropped", actor=actor, sandbox=fa.name, patch=json.loads(old.policy_patch))
        # the new version is the state first (one transaction): a daemon killed from here on
        # restarts the agent on it; before here, on the old one
        self.state.fleet_put(fa.name, spec, meta)
        self.record("fleet.agent-" + ("created" if old is None else "updated"), actor=actor, sandbox=fa.name,
                    commit=fleet.commit, path=fa.path, policy=fa.digest, previous=action.old_digest)
        if was_running:
            await self.stop(fa.name, actor=actor)
            self.state.update(fa.name, desired="running")  # (no await since the stop: nothing can come between)
        if not (was_running or (old is None and fa.policy.lifecycle == "persistent")):
            return
        try:
            problem = await self._fleet_start_checked(fa.name, actor, canary)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the old version comes back
            problem = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:500]
        if problem is None:
            return
        # the new version did not come up: back to the old one, which is started again
        self.record("fleet.agent-failed", actor=actor, sandbox=fa.name, commit=fleet.commit, problem=problem)
        await self.stop(fa.name, actor=actor)
        if old is None:
            self.state.fleet_put(fa.name, None, None)
            self.managed.pop(fa.name, None)
        else:
            self.state.fleet_put(fa.name, {"spec_text": old.spec_text, "spec_file": old.spec_file,
                                           "lifecycle": old.lifecycle, "policy_patch": old.policy_patch}, old_meta)
            if was_running:
                m = self.managed.get(fa.name)
                if m is not None:
                    m.last_error = None
                await self.start(fa.name, actor=actor)
        self.record("fleet.agent-rolled-back", actor=actor, sandbox=fa.name, to=(old_meta or {}).get("commit"))
        raise _refuse("fleet.agent-failed", f"{fa.name} at {fleet.commit[:12]} did not pass: {problem}; it runs "
                       "its previous version again and the apply stopped here")

    async def _fleet_canary_beside(self, fleet, fa, actor: str, canary: dict) -> None:
        import yaml

        cname = (fa.name[:56] + "-canary").strip("-")
        left = self.state.get(cname)
        if left is not None and str(left.spec_file).endswith("(canary)"):
            # a canary an interrupted apply left behind (the daemon was killed): removed first
            if left.state in ("running", "starting", "backoff"):
                await self.stop(cname, actor=actor)
            self.state.fleet_put(cname, None, None)
            self.managed.pop(cname, None)
            self.record("fleet.canary-removed", actor=actor, sandbox=cname, reason="left by an interrupted apply")
        elif left is not None:
            raise _refuse("fleet.canary-name-taken", f"cannot run the canary of {fa.name} beside it: a sandbox "
                           f"named {cname} exists")
        doc = yaml.safe_load(fa.spec_text)
        doc["metadata"]["name"] = cname
        doc["spec"]["workspace"] = {"enabled": False}
        doc["spec"]["lifecycle"] = "persistent"
        spec = {"spec_text": yaml.safe_dump(doc, sort_keys=False),
                "spec_file": f"{fleet.repo}@{fleet.commit[:12]}:{fa.path} (canary)", "lifecycle": "persistent",
                "policy_patch": "{}"}
        hc = (canary.get("healthchecks") or {}).get(fa.name)
        check = {**canary, "healthchecks": {cname: hc} if hc else {}}
        self.record("fleet.canary-started", actor=actor, sandbox=fa.name, canary=cname, commit=fleet.commit)
        self.state.fleet_put(cname, spec, None)
        try:
            try:
                problem = await self._fleet_start_checked(cname, actor, check)
            except Exception as exc:  # noqa: BLE001
                problem = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:500]
        finally:
            try:
                if self.state.get(cname) is not None:
                    await self.stop(cname, actor=actor)
            finally:
                self.state.fleet_put(cname, None, None)
                self.managed.pop(cname, None)
        if problem is not None:
            self.record("fleet.canary-failed", actor=actor, sandbox=fa.name, commit=fleet.commit, problem=problem)
            raise _refuse("fleet.agent-failed", f"the canary of {fa.name} at {fleet.commit[:12]} did not pass: "
                           f"{problem}; the old version ran on untouched and the apply stopped here")

    async def _fleet_start_checked(self, name: str, actor: str, canary: dict | None) -> str | None:
        m = self.managed.get(name)
        if m is not None:
            m.last_error = None
        await self.start(name, actor=actor)
        await self._wait_state(name, ("running", "exited", "failed", "stopped", "backoff"), 30)
        row = self.state.get(name)
        if row is None or row.state != "running":
            err = (self.managed.get(name).last_error if self.managed.get(name) else None) or {}
            return f"it did not start ({row.state if row else 'gone'}{': ' + err.get('message', '') if err else ''})"
        if canary is None:
            return None
        seconds = float(canary.get("seconds", 3))
        deadline = time.monotonic() + seconds
        start_restarts = row.restarts
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            row = self.state.get(name)
            if row is None or row.state != "running" or row.restarts != start_restarts:
                return f"it did not stay up for {seconds:g}s (state {row.state if row else 'gone'})"
        hc = (canary.get("healthchecks") or {}).get(name)
        if hc:
            settle = float(canary.get("settle", 0))  # a just-started replacement: retried this long
            until = time.monotonic() + settle
            while True:
                m = self.managed.get(name)
                if m is None or m.handle is None:
                    return "it is not running for its health check"

                def run_check(m=m):
                    null = os.open(os.devnull, os.O_RDWR)
                    try:
                        return m.backend.exec(m.handle, [str(x) for x in hc], stdio=(null, null, null), timeout=30)
                    finally:
                        os.close(null)

                status = await asyncio.to_thread(run_check)
                if status.exit_code == 0:
                    break
                if time.monotonic() >= until:
                    within = f" (retried for {settle:g}s after its start)" if settle else ""
                    return f"its health check {hc} exited {status.exit_code}{within}"
                await asyncio.sleep(0.2)
                row = self.state.get(name)
                if row is None or row.state != "running" or row.restarts != start_restarts:
                    return f"it did not stay up for its health check (state {row.state if row else 'gone'})"
        self.record("fleet.canary-passed", actor=actor, sandbox=name, seconds=seconds, healthcheck=hc or None)
        return None

    def _fleet_status(self) -> dict:
        meta = self.state.fleet_agents()
        cur, desired = self._fleet_current()
        agents, drifted = [], False
        for name, c in sorted(cur.items()):
            fm = meta.get(name)
            row = c["row"]
            d = {"name": name, "state": row.state, "commit": fm["commit"] if fm else None, "desired": desired,
                 "path": fm["path"] if fm else None, "drift": []}
            if fm is None:
                # not from a fleet: plan leaves it alone, and so does status (listed, never drift)
                d["unmanaged"] = True
            else:
                if desired and fm["commit"] != desired:
                    d["drift"].append(f"runs {fm['commit'][:12]}, the last promotion is {desired[:12]}")
                if c["digest"] != fm["digest"]:
                    d["drift"].append("its stored config differs from its commit's")
                patch = json.loads(row.policy_patch or "{}")
                if patch:
                    d["drift"].append("live policy changes: " + ", ".join(sorted(patch)))
                    try:
                        d["running_digest"] = self._policy_for(row).digest()
                    except AgentVMError:
                        pass
                if c["policy"].lifecycle == "persistent" and row.desired != "running":
                    d["drift"].append("declared, not running")
            d["config_digest"] = c["digest"]
            drifted = drifted or bool(d["drift"])
            agents.append(d)
        for name, fm in sorted(meta.items()):
            if name not in cur:
                agents.append({"name": name, "state": "missing", "commit": fm["commit"], "desired": desired,
                               "path": fm["path"], "drift": ["declared, but its sandbox is gone"]})
                drifted = True
        out = {"desired": desired, "drift": drifted, "agents": agents, "promotions": self.state.promotions(20),
               "unmanaged": [a["name"] for a in agents if a.get("unmanaged")]}
        if drifted:  # a drift finding is on the audit chain (what was found, when, by whom)
            self.record("fleet.drift", desired=desired,
                        agents={a["name"]: a["drift"] for a in agents if a["drift"]})
        return out

    async def _events(self, conn, writer) -> None:
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(q)
        try:
            await self._stream_start(conn, writer)
            while True:
                rec = await q.get()
                if rec is None:
                    break
                await self._stream_line(conn, writer, rec)
        finally:
            self.subscribers.discard(q)
        await self._stream_end(conn, writer)


#: events a live reader (``agentvm events``, the console's decision stream) may be behind
#: before it is cut off with a ``stream.lagged`` record
SUBSCRIBER_BACKLOG = 10000


def _phrase(status: int) -> bytes:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _is_console(target: bytes) -> bool:
    """Everything but the API (``/v1/...``) and ``/metrics`` is the console's."""
    path = target.split(b"?", 1)[0]
    return not (path == b"/v1" or path.startswith(b"/v1/") or path == b"/metrics")


def _deny_rules(specs: list[str]):
    """``policy NAME deny HOST[:PORT]``: without a port, the host on every port."""
    from agentvm.gate.policy import cli_rule

    return [cli_rule(f"live-deny[{i}]", s, default_ports=()) for i, s in enumerate(specs)]


def check_chain(paths: Paths, accept_broken: bool) -> str | None:
    """Refuse to start on an audit chain that does not verify (appending to it would bury
    the break under new records), unless the operator accepts it - then the break is the
    first thing recorded. Returns the problem accepted, if any."""
    db = paths.audit_dir / "audit.db"
    if not db.exists() or db.stat().st_size == 0:
        if db.with_suffix(".head").exists():
            AuditLog(db)  # refuses (audit.lost): the head says a chain was here
        return None
    log = AuditLog.open_readonly(db)
    try:
        v = log.verify()
    finally:
        log.close()
    if v.ok:
        return None
    if not accept_broken:
        raise ConfigError(
            f"the audit chain at {db} does not verify: {v.problem}; refusing to append to it",
            hint="keep a copy for the investigation, then start with `agentvm up --accept-broken-chain` (the break "
            "is recorded as the first event), or move the database aside to start a new chain; see docs/daemon.md",
            code="audit.broken-chain")
    return v.problem


def _spec_name(text) -> str:
    """An agent file's metadata.name, for a record about it (``run`` when there is none)."""
    if not isinstance(text, str):
        return "run"
    try:
        import yaml

        name = yaml.safe_load(text)["metadata"]["name"]
    except Exception:  # noqa: BLE001 - a record's label, never a reason to fail
        return "run"
    return str(name)[:200] if isinstance(name, str) else "run"


def check_state(paths: Paths) -> None:
    """Refuse to start on a lost identity database (``state.db``: which host uid each named
    agent owns, and so whose files its workspace holds), as an embedded run refuses it: the
    daemon opens it lazily, so without this check it would start and fail every named start."""
    from agentvm import statedb
    from agentvm.identity import _connect

    db = paths.state_db
    if db.exists() or statedb._marker(db).exists():
        _connect(db).close()  # raises state.lost (exit 78) for a missing, emptied or garbage one


def run_daemon(paths: Paths, *, listen: str | None = None, backend=None, accept_broken_chain: bool = False,
               otlp_endpoint: str | None = None, otlp_sample_allowed: float | None = None, gate_workers: int = 0,
               resume: bool = True) -> None:
    """Foreground entry point (``agentvm up --foreground``)."""
    accepted = check_chain(paths, accept_broken_chain)
    check_state(paths)
    from agentvm.observe.tracing import from_env_or

    # a bad URL or ratio refuses here, before anything starts
    tracing = from_env_or(otlp_endpoint, otlp_sample_allowed)
    import resource

    # one daemon serves every sandbox, client and gate connection of the host: the default
    # soft limit of 1024 descriptors is a ceiling it would hit (every fd path is poll/epoll based)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))

    async def main():
        from concurrent.futures import ThreadPoolExecutor

        # blocking substrate calls (prepare, launch, exec, stop, destroy) run in threads; never
        # let a busy fleet starve them (the default pool is cpu+4 threads)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=256,
                                                                           thread_name_prefix="agentvm"))
        d = Daemon(paths, backend=backend, listen=listen, tracing=tracing, gate_workers=gate_workers, resume=resume)
        if tracing is not None:
            d.record("daemon.tracing", endpoint=tracing.endpoint, sample_allowed=tracing.sample_allowed)
        if accepted:
            d.record("daemon.accepted-broken-chain", problem=accepted)
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, d.stopping.set)
        await d.serve()

    from agentvm.gate.server import run

    run(main())


_SANDBOX_POSTS = {"start": api.Empty, "stop": api.Empty, "restart": api.Empty, "exec": api.Exec,
                  "policy": api.POLICY_CHANGE}
_FLEET_POSTS = {"plan": api.FleetPlan, "apply": api.FleetApply, "rollback": api.FleetRollback}


def _body_model(method: str, p: list[str]):
    """The model of a route's JSON body (``api.ROUTES`` publishes the same), or None."""
    if method != "POST":
        return None
    if p == ["sandboxes"]:
        return api.CreateSandbox
    if len(p) == 3 and p[0] == "sandboxes":
        return _SANDBOX_POSTS.get(p[2])
    if p in (["run"], ["run", "frames"]):
        return api.Run
    if len(p) == 3 and p[0] == "approvals" and p[2] in ("approve", "deny"):
        return api.ApprovalAnswer
    if len(p) == 2 and p[0] == "fleet":
        return _FLEET_POSTS.get(p[1])
    if p in (["console", "login"], ["shutdown"]):
        return api.Empty
    return None


def _query_model(method: str, p: list[str]):
    if len(p) == 2 and p[0] == "sandboxes" and method == "DELETE":
        return api.RmQuery
    if len(p) == 3 and p[0] == "sandboxes" and p[2] == "logs" and method == "GET":
        return api.LogsQuery
    if len(p) == 3 and p[0] == "sandboxes" and p[2] == "files":
        return api.FilesQuery
    if p == ["audit"] and method == "GET":
        return api.AuditQuery
    if p == ["approvals"] and method == "GET":
        return api.ApprovalsQuery
    return None


def _json_body(body: bytes) -> dict:
    """A request body: one JSON object, or a 400 that says what is wrong."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise _refuse("api.bad-request", "the request body is nested too deeply") from None
    except ValueError as exc:
        raise _refuse("api.bad-request", f"the request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _refuse("api.bad-request", f"the request body must be a JSON object, not {type(doc).__name__}")
    return doc


def _since(text: str) -> float:
    from agentvm.units import parse_since

    try:
        return parse_since(text)
    except ValueError as exc:
        raise _refuse("api.bad-request", f"since: {exc}", hint="a Unix time, a duration ago (10m, 2h, 1d) or an ISO date") from None


def _make_reserve(path: Path) -> None:
    """Hold ``RESERVE`` bytes on the state disk (best effort: a disk already full has none)."""
    if path.exists():
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, RESERVE)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return
    os.close(fd)


async def _drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: float = 5.0) -> None:
    """After an early answer (413, 429...): stop writing, then read and drop what the client is
    still sending for a while, so it gets to read the answer instead of a reset."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
        deadline = asyncio.get_running_loop().time() + limit
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or not await asyncio.wait_for(reader.read(1 << 16), left):
                return
    except (asyncio.TimeoutError, ConnectionError, OSError):
        return
