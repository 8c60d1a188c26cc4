"""Human approvals: a durable queue of held actions, answered by a person or by the timeout.

A held action is a tool call whose tool is in ``tools[].approve`` (or whose risk class the
agent's tier always puts before a human), or an egress request that matched an allow rule
with ``action: ask``. Whoever holds it (the tool gateway, the egress gate - in the daemon or
in an embedded ``agentvm run``) puts a row into ``<home>/approvals/approvals.db`` and waits; a human answers
with ``agentvm approvals approve|deny ID`` (or the SDK), which only moves a *pending* row to
*approved* or *denied* - atomically, so two answers cannot both win. Nothing is ever allowed
without that row saying ``approved``:

- the deadline passes: the holder moves the row to ``expired`` (denied, ``approval:timeout``);
- the holder dies (``kill -9`` of the daemon, a crashed run): the row stays ``pending`` in the
  database - never lost - and the next holder to open the store (or ``agentvm approvals``)
  moves it to ``expired`` with the reason "the requester is gone": answered, never silently
  allowed, and the held request itself died with its connection;
- the database cannot be written: the holder denies (``approval:unavailable``).

Every request and every answer goes on the audit chain (who, when, what: kind, target, the
digest of the exact arguments and their names - never their values, never a credential
value: the gate's placeholders are what the agent sent). The queue itself (owner-only) keeps
the whole arguments (at most ``SHOW_MAX`` bytes; bigger actions are refused, not held), and
that is what the human is shown (``agentvm approvals show``, the console): nobody approves
what they cannot see.

A held request lives exactly as long as its waiter: a waiter that is cancelled (its sandbox
stopped or paused) or whose requester hung up (``wait(gone=...)``: the connection was cut)
expires its row at once; a waiter beats a heartbeat on its row (``alive``) while it waits, so
a row whose waiter vanished without a word (its task lost, its process wedged) is *orphaned*:
the next answer or listing expires it. Approving an expired or orphaned request is refused
(``approvals.expired``): nobody approves an action that can no longer happen.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agentvm import statedb
from agentvm.held import SHOW_MAX, digest  # noqa: F401 (re-exported: the gate and the tool gateway use them)
from agentvm.errors import AgentVMError, ConfigError

SCHEMA = """
CREATE TABLE approvals (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    kind TEXT NOT NULL,          -- tool | egress | access
    sandbox TEXT NOT NULL,
    agent TEXT NOT NULL,
    target TEXT NOT NULL,        -- server__tool, or METHOD host:port/path
    summary TEXT NOT NULL,       -- JSON: the redacted preview shown to the human
    digest TEXT NOT NULL,        -- sha256 of the exact arguments / request line
    policy TEXT NOT NULL,        -- the policy digest that decided to hold it
    state TEXT NOT NULL,         -- pending | approved | denied | expired
    deadline REAL NOT NULL,
    answered REAL,
    by TEXT,
    note TEXT,
    owner_pid INTEGER NOT NULL,
    owner_start TEXT NOT NULL,
    notified TEXT,               -- the webhook's delivery: "delivered 200", "failed: ...", NULL (none)
    alive REAL                   -- the waiter's last heartbeat (NULL: none yet)
);
CREATE INDEX approvals_state ON approvals(state, created);
"""

POLL = 0.05  # how often a holder looks for the answer (seconds)
WEBHOOK_TIMEOUT = 5.0
MAX_PENDING = 16  # per sandbox: more held at once are refused (no flooding the queue, the human or the loop)
PREVIEW_CHARS = 200
HEARTBEAT = 1.0  # a waiter marks its row alive this often (seconds)
#: a pending row whose waiter has not beaten for this long is orphaned: nobody waits for its answer
ORPHANED_AFTER = 15.0
GONE = "the requester is gone (its connection was cut): nothing waits for this answer"
STATES = ("pending", "approved", "denied", "expired")


class ApprovalError(AgentVMError):
    code = "approvals.error"
    exit_code = 2


@dataclass(frozen=True)
class Request:
    id: str
    created: float
    kind: str
    sandbox: str
    agent: str
    target: str
    summary: dict
    digest: str
    policy: str
    state: str
    deadline: float
    answered: float | None
    by: str | None
    note: str | None
    notified: str | None = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def approved(self) -> bool:
        return self.state == "approved"


def _row(r) -> Request:
    return Request(id=r[0], created=r[1], kind=r[2], sandbox=r[3], agent=r[4], target=r[5], summary=json.loads(r[6]),
                   digest=r[7], policy=r[8], state=r[9], deadline=r[10], answered=r[11], by=r[12], note=r[13],
                   notified=r[14] if len(r) > 14 else None)


_COLS = "id, created, kind, sandbox, agent, target, summary, digest, policy, state, deadline, answered, by, note"
_ALL = _COLS + ", notified"


def _proc_start(pid: int) -> str:
    """The process's start time (field 22 of /proc/PID/stat): a pid with another start time is
    another process (pids are reused); "" for no process, or a dead one (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):
            return ""  # a zombie is no holder: it will never answer anyone
        return fields[19].decode()
    except (OSError, ValueError, IndexError):
        return ""


def preview(value, limit: int = PREVIEW_CHARS) -> str:
    """A short, printable rendering of arguments for a human (cut, control characters escaped)."""
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=True, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value) -> str:
    """The whole of a held action's arguments as the human sees them (canonical JSON, ASCII)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=True, indent=1, default=str)




class ApprovalStore:
    """The queue (``approvals.db`` in agent-vm's home). ``record(kind, sandbox=..., actor=...,
    **data)`` puts an event on the audit chain; it may raise - then the action is refused."""

    def __init__(self, path: Path, record: Callable | None = None) -> None:
        self.path = Path(path)
        self._db = statedb.connect(self.path, "approvals", SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(approvals)")}
        if "notified" not in cols:  # a queue made before webhooks
            self._db.execute("ALTER TABLE approvals ADD COLUMN notified TEXT")
        if "alive" not in cols:  # a queue made before waiters' heartbeats
            self._db.execute("ALTER TABLE approvals ADD COLUMN alive REAL")
        self._record = record
        self._me = (os.getpid(), _proc_start(os.getpid()))
        self.notified: list = []  # (id, outcome) of webhook deliveries by this process
        self.reap_orphans()

    def close(self) -> None:
        self._db.close()

    def record(self, kind: str, *, actor: str, sandbox: str | None, **data) -> None:
        if self._record is not None:
            self._record(kind, actor=actor, sandbox=sandbox, **data)

    # ------------------------------------------------------------------ holder side
    def submit(self, *, kind: str, sandbox: str, agent: str, target: str, summary: dict, arg_digest: str,
               policy: str, timeout: float, webhook: str | None = None) -> Request:
        pending = self._db.execute("SELECT COUNT(*) FROM approvals WHERE sandbox=? AND state='pending' AND deadline > ?",
                                   (sandbox, time.time())).fetchone()[0]
        if pending >= MAX_PENDING:
            raise ApprovalError(f"{sandbox} already has {pending} requests waiting for a human (at most {MAX_PENDING})",
                                code="approvals.too-many")
        now = time.time()
        rid = "apr-" + secrets.token_hex(6)
        row = (rid, now, kind, sandbox, agent, target[:512], json.dumps(summary, sort_keys=True, ensure_ascii=True),
               arg_digest, policy, "pending", now + timeout, None, None, None, self._me[0], self._me[1])
        # on the chain first: a request that cannot be recorded is not held (it is denied)
        # the chain gets the digest and the argument names, never their values (a held call's
        # arguments may carry data the agent read); the queue (owner-only) keeps them whole
        self.record("approval.requested", actor=f"sandbox:{sandbox}", sandbox=sandbox, id=rid, what=kind,
                    agent=agent, target=target[:512], digest=arg_digest, keys=summary.get("keys"),
                    policy=policy, timeout=timeout)
        self._db.execute(f"INSERT INTO approvals ({_COLS}, owner_pid, owner_start, alive) VALUES "
                         "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", row + (now,))
        req = self.get(rid)
        if webhook:
            threading.Thread(target=self._notify, args=(webhook, req), name=f"approvals-webhook-{rid}",
                             daemon=True).start()
        return req

    def _notify(self, url: str, req: Request) -> None:
        """POST the pending request (no argument values: their names and digest; the human
        reads them whole with ``agentvm approvals show`` or the console) to the operator's webhook; the outcome is kept on the row (``agentvm approvals show``). The
        answer comes back through ``agentvm approvals`` or the daemon's API, never the webhook."""
        import urllib.error
        import urllib.request

        public = {k: v for k, v in req.summary.items() if k not in ("arguments", "preview")}
        doc = {"id": req.id, "kind": req.kind, "sandbox": req.sandbox, "agent": req.agent, "target": req.target,
               "summary": public, "digest": req.digest, "policy": req.policy, "created": req.created,
               "deadline": req.deadline,
               "answer": {"cli": f"agentvm approvals approve|deny {req.id}",
                          "api": f"POST /v1/approvals/{req.id}/approve | /deny"}}
        body = json.dumps(doc, sort_keys=True).encode()
        try:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(urllib.request.Request(url, data=body, method="POST", headers={
                    "Content-Type": "application/json", "User-Agent": "agentvm-approvals"}), timeout=WEBHOOK_TIMEOUT) as r:
                outcome = f"delivered {r.status}"
        except urllib.error.HTTPError as exc:
            outcome = f"failed: HTTP {exc.code}"
        except Exception as exc:  # noqa: BLE001 - the request still waits; the failure is shown
            outcome = f"failed: {type(exc).__name__}"
        try:  # a connection of this thread's own
            import sqlite3

            db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None)
            try:
                db.execute("UPDATE approvals SET notified=? WHERE id=?", (outcome, req.id))
            finally:
                db.close()
        except Exception:  # noqa: BLE001
            pass
        self.notified.append((req.id, outcome))

    async def wait(self, rid: str, gone: Callable[[], bool] | None = None) -> Request:
        """Until the row is answered or its deadline passes (then: ``expired``). A waiter that
        is cancelled (the sandbox stopped or paused) expires its row, and so does one whose
        requester is ``gone()`` (its connection cut: checked at every poll, before the answer
        is taken): no human approves an action that can no longer happen. While it waits, the
        row's heartbeat says someone does."""
        beat = 0.0
        try:
            while True:
                if gone is not None and _gone(gone):
                    # (answered in the same instant: that answer stands; the caller, whose
                    # requester is gone, acts on nothing)
                    return self._finish(rid, "expired", "agentvm", GONE)
                req = self.get(rid)
                if req.state != "pending":
                    return req
                now = time.time()
                if now >= req.deadline:
                    return self._finish(rid, "expired", "timeout", "no answer before the deadline")
                if now - beat >= HEARTBEAT:
                    beat = now
                    self._db.execute("UPDATE approvals SET alive=? WHERE id=? AND state='pending'", (now, rid))
                await asyncio.sleep(POLL)
        except BaseException:
            try:
                self._finish(rid, "expired", "agentvm", "the held action was abandoned (its sandbox stopped, paused or "
                             "hung up)")
            except Exception:  # noqa: BLE001
                pass
            raise

    def _finish(self, rid: str, state: str, by: str, note: str | None) -> Request:
        return self._transition(rid, state, by, note)[0]

    def _transition(self, rid: str, state: str, by: str, note: str | None) -> tuple[Request, bool]:
        """-> (the row now, whether this call answered it: two answers cannot both win)."""
        cur = self._db.execute("UPDATE approvals SET state=?, answered=?, by=?, note=? WHERE id=? AND state='pending'",
                               (state, time.time(), by, note, rid))
        req = self.get(rid)
        if cur.rowcount == 1:
            self.record("approval.answered", actor=by if ":" in by else f"agentvm:{by}", sandbox=req.sandbox, id=rid,
                        state=state, what=req.kind, target=req.target, digest=req.digest, note=note)
        return req, cur.rowcount == 1

    def reap_orphans(self) -> int:
        """Pending rows whose holder is gone (its process died) or whose waiter is (no heartbeat
        for ORPHANED_AFTER seconds): ``expired`` - answered, never left to be approved into
        nothing, never allowed."""
        n = 0
        now = time.time()
        rows = self._db.execute("SELECT id, owner_pid, owner_start, deadline, alive FROM approvals "
                                "WHERE state='pending'").fetchall()
        for rid, pid, start, deadline, alive in rows:
            if alive is not None and now - alive > ORPHANED_AFTER:
                if self._finish(rid, "expired", "reaper", "orphaned: nothing has waited for the answer for "
                                f"{now - alive:.0f}s (its requester is gone)").state == "expired":
                    n += 1
                continue
            if (pid, start) == self._me:
                if deadline < now - 5:  # ours, past its deadline, no waiter took it
                    if self._finish(rid, "expired", "reaper", "no answer before the deadline").state == "expired":
                        n += 1
                continue
            if _proc_start(pid) != start or not start:
                if self._finish(rid, "expired", "reaper", "the requester is gone (its process ended)").state == "expired":
                    n += 1
        return n

    # ------------------------------------------------------------------ human side
    def get(self, rid: str) -> Request:
        r = self._db.execute(f"SELECT {_ALL} FROM approvals WHERE id=?", (rid,)).fetchone()
        if r is None:
            raise ApprovalError(f"no approval request {rid!r}", hint="`agentvm approvals list` shows the pending ones")
        return _row(r)

    def list(self, states: tuple[str, ...] = ("pending",), limit: int = 200) -> list[Request]:
        self.reap_orphans()
        q = ",".join("?" * len(states))
        rows = self._db.execute(f"SELECT {_ALL} FROM approvals WHERE state IN ({q}) ORDER BY created DESC LIMIT ?",
                                (*states, limit)).fetchall()
        return [_row(r) for r in rows]

    def answer(self, rid: str, approve: bool, by: str, note: str | None = None, digest: str | None = None) -> Request:
        """``digest``: the one the human was shown (the console sends it): an approval of
        anything else is refused."""
        self.reap_orphans()
        req = self.get(rid)
        if approve and digest is not None and digest != req.digest:
            raise ApprovalError(f"{rid} is not the request you were shown (its digest is {req.digest})",
                                code="approvals.digest-mismatch")
        if req.state == "expired":
            raise ApprovalError(f"{rid} is already expired" + (f" ({req.note})" if req.note else "") +
                                ": nothing waits for this answer, it was denied", code="approvals.expired",
                                hint="the agent asks again if it still needs it; `agentvm approvals list` shows "
                                "the pending ones")
        if req.state != "pending":
            raise ApprovalError(f"{rid} is already {req.state}" + (f" (by {req.by})" if req.by else ""),
                                code="approvals.answered")
        if time.time() >= req.deadline:
            self._finish(rid, "expired", "timeout", "no answer before the deadline")
            raise ApprovalError(f"{rid} expired before this answer (its timeout passed): it was denied",
                                code="approvals.expired")
        out, mine = self._transition(rid, "approved" if approve else "denied", by, note)
        if not mine:  # (two console tabs answer as the same user: only one of them answered)
            raise ApprovalError(f"{rid} was answered meanwhile: {out.state} (by {out.by})", code="approvals.answered")
        return out


def _gone(gone: Callable[[], bool]) -> bool:
    try:
        return bool(gone())
    except Exception:  # noqa: BLE001 - a liveness check that fails says nothing is left to answer
        return True


def store_path(paths) -> Path:
    """``<home>/approvals/approvals.db`` (a folder of its own: SQLite's -wal and -shm files go
    beside it; 0700, root's)."""
    return paths.home / "approvals" / "approvals.db"


def open_store(paths, record: Callable | None = None) -> ApprovalStore:
    try:
        d = store_path(paths).parent
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return ApprovalStore(store_path(paths), record)
    except AgentVMError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"cannot open the approvals queue: {type(exc).__name__}: {exc}") from exc
