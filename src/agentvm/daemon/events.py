"""The daemon's events and its audit queue: every event fanned out once (metrics, spans, live
readers), every record on the audit chain - or, while the disk refuses writes, queued in
memory and written as soon as it takes them again - and the space held back for that.

:class:`Events` is a part of :class:`agentvm.daemon.control.ControlPlane` (it reads the
control plane's ``audit``, ``observer``, ``tracing``, ``gate``, ``managed``, ``loop``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from agentvm.audit import AuditLog
from agentvm.errors import AgentVMError, ConfigError
from agentvm.paths import Paths

log = logging.getLogger("agentvm.daemon")

RESERVE = 8 * 1024 * 1024  # disk space held back for the daemon's own state when the disk fills
#: events a live reader (``agentvm events``, the console's decision stream) may be behind
#: before it is cut off with a ``stream.lagged`` record
SUBSCRIBER_BACKLOG = 10000
FLUSH_EVERY = 2.0  # seconds between tries of the records the disk did not take


def refuse(code: str, message: str, hint: str = "") -> AgentVMError:
    """An error of the control plane's own, by its registered code (agentvm.errorcodes: its
    HTTP status and exit code)."""
    return AgentVMError(message, hint=hint, code=code)


class Events:
    """Events, the audit chain and its queue (a part of the ControlPlane)."""

    subscribers: set
    _audit_queue: list
    _audit_stalled: bool

    # ------------------------------------------------------------------ live readers
    def subscribe(self) -> asyncio.Queue:
        """A live reader's queue of events (``None`` ends it; a reader that falls
        SUBSCRIBER_BACKLOG behind gets a ``stream.lagged`` event, then ``None``)."""
        q: asyncio.Queue = asyncio.Queue()  # unbounded: a lagging reader is cut off instead
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

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

    # ------------------------------------------------------------------ the audit chain
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

    def syscall_sink(self, sandbox_id: str):
        """``agentvm.sysaudit``'s sink factory (registered at start-up): each escape-probe record
        of a sandbox this daemon launches goes on the audit chain and the event stream (and so
        to /metrics' observer and the trace's span events). Called on the supervisor's
        recording thread: handed to the loop (``call_soon_threadsafe``), never run there."""

        def sink(rec: dict) -> None:
            kind = str(rec.get("kind") or "syscall.denied")
            data = {k: v for k, v in rec.items() if k not in ("kind", "sandbox", "time")}
            self._in_loop(lambda: self.record(kind, sandbox=rec.get("sandbox") or sandbox_id, **data))

        return sink

    def _worker_event(self, kind: str, **data) -> None:
        """A gate worker lost, replaced, or not replaceable (agentvm.gate.workers): on the chain."""
        log.warning("%s: %s", kind, json.dumps(data, default=str))
        self.record(kind, **data)

    def _in_loop(self, fn) -> None:
        if self.loop is None or threading.get_ident() == self._loop_thread:
            fn()
        else:
            self.loop.call_soon_threadsafe(fn)

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

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            if self._audit_queue:
                self.flush_audit()

    def _log_unwritten(self) -> None:
        """At shutdown: records the disk never took - at least the log shows what they were."""
        for kind, actor, sandbox, data, at in self._audit_queue:
            log.error("unwritten audit record: %s", json.dumps({"time": at, "kind": kind, "actor": actor,
                                                                "sandbox": sandbox, "data": data}, default=str))

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
                raise refuse("state.unwritable", f"agent-vm's state cannot be written: {exc}",
                             hint=f"free space on the filesystem of {self.paths.home} (or make it writable)") from None
            return fn(*args, **kw)

    # ------------------------------------------------------------------ gate decisions
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


def make_reserve(path: Path) -> None:
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


def check_chain(paths: Paths, accept_broken: bool) -> str | None:
    """Refuse to start on an audit chain that does not verify (appending to it would bury
    the break under new records), unless the operator accepts it - then the break is the
    first thing recorded. Returns the problem accepted, if any."""
    db = paths.audit_dir / "audit.db"
    if not db.exists() or db.stat().st_size == 0:
        if db.with_suffix(".head").exists():
            AuditLog(db)  # refuses (audit.lost): the head says a chain was here
        return None
    chain = AuditLog.open_readonly(db)
    try:
        v = chain.verify()
    finally:
        chain.close()
    if v.ok:
        return None
    if not accept_broken:
        raise ConfigError(
            f"the audit chain at {db} does not verify: {v.problem}; refusing to append to it",
            hint="keep a copy for the investigation, then start with `agentvm up --accept-broken-chain` (the break "
            "is recorded as the first event), or move the database aside to start a new chain; see docs/daemon.md",
            code="audit.broken-chain")
    accepted = AuditLog(db)
    try:
        accepted.accept_break(v.problem)  # recorded now; every writer (embedded runs too) appends after it
    finally:
        accepted.close()
    return v.problem


def check_state(paths: Paths) -> None:
    """Refuse to start on a lost identity database (``state.db``: which host uid each named
    agent owns, and so whose files its workspace holds), as an embedded run refuses it: the
    daemon opens it lazily, so without this check it would start and fail every named start."""
    from agentvm import statedb
    from agentvm.identity import _connect

    db = paths.state_db
    if db.exists() or statedb._marker(db).exists():
        _connect(db).close()  # raises state.lost (exit 78) for a missing, emptied or garbage one
