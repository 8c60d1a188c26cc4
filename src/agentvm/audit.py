"""A tamper-evident audit trail: an append-only, hash-chained log in SQLite.

Each record carries the hash of the previous one::

    hash = sha256(prev_hash || canonical_json({seq, time, kind, actor, sandbox, data}))

so editing, removing, inserting or reordering any record breaks the chain at a point that
:meth:`AuditLog.verify` reports. The chain starts from a fixed genesis value; the latest
hash is also written to a side file (``head``) after every append, so truncating the tail is
detected too (the head no longer matches).

Only agent-vm writes here (the daemon or ``agentvm run``), from outside every sandbox; a
sandbox can only cause records to be written through events the daemon observes.

No writer appends to a chain that does not verify (that would bury the break under new
records): before its first record, every writer - the daemon, an embedded ``agentvm run``, the
CLI's own records - verifies the chain from the last *verified checkpoint* (a side file,
``audit.verified``: the sequence number and hash of the last record a verification or a
writer vouched for) to the end, and refuses with ``audit.broken-chain`` when it does not hold.
The checkpoint moves with verifications and with the records a writer appends onto a chain it
verified, so the check costs the records written since, not the whole chain. A break below
the checkpoint is found by a full walk: ``agentvm audit verify`` and the daemon's start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

GENESIS = "0" * 64
_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    actor TEXT NOT NULL,
    sandbox TEXT,
    data TEXT NOT NULL,
    prev TEXT NOT NULL,
    hash TEXT NOT NULL
);
"""


def _digest(prev: str, seq: int, t: float, kind: str, actor: str, sandbox: str | None, data: str) -> str:
    body = json.dumps([seq, repr(t), kind, actor, sandbox, data], separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256((prev + body).encode()).hexdigest()


@dataclass(frozen=True)
class Record:
    """One record of the audit chain, linked to the one before it by its hash."""
    seq: int
    time: float
    kind: str
    actor: str
    sandbox: str | None
    data: dict
    prev: str
    hash: str

    def to_dict(self) -> dict:
        return {"seq": self.seq, "time": self.time, "kind": self.kind, "actor": self.actor, "sandbox": self.sandbox,
                "data": self.data, "prev": self.prev, "hash": self.hash}


@dataclass(frozen=True)
class Verification:
    """The result of checking the audit chain: whether it holds, and where it breaks if not."""
    ok: bool
    records: int
    problem: str = ""
    at_seq: int | None = None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "records": self.records, "problem": self.problem, "at_seq": self.at_seq}


class _FileLock:
    """An exclusive flock on a side file for the length of a ``with`` block, waited for at most
    ``timeout`` seconds (a holder stopped with ^Z must not freeze the daemon): then OSError."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.fd = -1

    def __enter__(self):
        import errno
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise OSError(errno.EAGAIN, f"the audit chain is locked by another process ({self.path})") from None
                time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


class AuditLog:
    def __init__(self, path: Path, lock_timeout: float = 10.0) -> None:
        self.path = Path(path)
        self.head_path = self.path.with_suffix(".head")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.lock_timeout = lock_timeout
        new = not self.path.exists() or self.path.stat().st_size == 0
        if new and self.head_path.exists():
            from agentvm.errors import ConfigError

            raise ConfigError(
                f"the audit chain {self.path} is missing or empty, but its head file says it had records: "
                "refusing to start a new chain over it (that would hide the removal)",
                hint="restore the database from a backup; or move the head file aside too to start a new chain "
                "on purpose (see docs/daemon.md)", code="audit.lost")
        if new:  # owner-only from the first byte
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._conn = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
        from agentvm.statedb import init_schema

        init_schema(self._conn, self.path, _SCHEMA)  # (under a lock: writers opening a new chain at once)
        self._checked = False  # verified from the checkpoint before this writer's first record
        self._vouched: tuple[int, str] | None = None  # the last record this writer can vouch for
        self._vouched_written = 0.0

    @classmethod
    def open_readonly(cls, path: Path) -> "AuditLog":
        """The chain for reading and verifying only: nothing is created or written (a copy, a
        chain whose daemon is down, a disk that is full or read-only)."""
        self = cls.__new__(cls)
        self._checked, self._vouched, self._vouched_written = True, None, 0.0  # a reader: it never appends
        self.path = Path(path)
        self.head_path = self.path.with_suffix(".head")
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10.0, isolation_level=None,
                                         check_same_thread=False)
            self._conn.execute("SELECT 1 FROM audit LIMIT 1")
        except sqlite3.DatabaseError as exc:
            from agentvm.errors import ConfigError, disk_full_error

            full = disk_full_error(exc, where=self.path)
            wal = self.path.with_name(self.path.name + "-wal")
            if full is not None and (not wal.exists() or wal.stat().st_size == 0):
                # SQLite cannot make its -shm file for lack of room. With no write-ahead log
                # pending, the database file alone is the whole chain: read it as immutable
                # (no -shm needed) and verify it, rather than refuse to judge.
                try:
                    self._conn = sqlite3.connect(f"file:{self.path}?mode=ro&immutable=1", uri=True,
                                                 isolation_level=None, check_same_thread=False)
                    self._conn.execute("SELECT 1 FROM audit LIMIT 1")
                    return self
                except sqlite3.DatabaseError:
                    pass
            if full is not None:  # no room and a log pending: not a corrupt chain, an unreadable one
                full.message = (f"cannot read the audit chain {self.path}: the disk holding it is full "
                                "(this says nothing about the chain itself; it was not judged)")
                raise full from exc
            raise ConfigError(f"{self.path} is not a readable audit chain ({exc})",
                              hint="see docs/daemon.md, 'Recovering state and audit databases'") from None
        return self

    def close(self) -> None:
        if self._vouched is not None and self._vouched[0] > 0:
            try:
                self._write_checkpoint(*self._vouched)
            except OSError:
                pass  # a full disk: the next writer walks a little further
        self._conn.close()

    # -- the verified checkpoint ---------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.path.with_suffix(".verified")

    def read_checkpoint(self) -> tuple[int, str] | None:
        try:
            seq, h = self.checkpoint_path.read_text().split()
            return int(seq), h
        except (FileNotFoundError, ValueError):
            return None  # none yet, or unreadable: the next check walks the whole chain

    def _write_checkpoint(self, seq: int, h: str) -> None:
        tmp = self.checkpoint_path.with_name(f"{self.checkpoint_path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{seq} {h}\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.checkpoint_path)
        self._vouched_written = time.monotonic()

    def _last(self) -> tuple[int, str]:
        row = self._conn.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        return (int(row[0]), row[1]) if row else (0, GENESIS)

    def check_appendable(self) -> None:
        """Verify the chain from the checkpoint to its end; refuse (``audit.broken-chain``) to
        append to one that does not hold, as the daemon refuses to start on it. Then move the
        checkpoint to the end."""
        # under the writers' lock, in a write transaction: the head file, the checkpoint and the
        # records are read as one state (a writer moves them together under this lock), never a
        # head newer than the snapshot the walk reads
        with self._lock, _FileLock(self.path.with_suffix(".lock"), self.lock_timeout):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                v = self.verify(since=self.read_checkpoint())
                last = self._last()
            finally:
                self._conn.execute("COMMIT")
        if not v.ok:
            from agentvm.errors import ConfigError

            raise ConfigError(
                f"the audit chain at {self.path} does not verify: {v.problem}; refusing to append to it",
                hint="keep a copy for the investigation, then accept the break once with `agentvm up "
                "--accept-broken-chain` (it is recorded as the first event; embedded runs append again after it), "
                "or move the database aside to start a new chain; see docs/daemon.md", code="audit.broken-chain")
        if last[0]:
            self._write_checkpoint(*last)
        self._vouched = last
        self._checked = True

    def accept_break(self, problem: str, actor: str = "agentvm") -> Record:
        """The operator accepted a chain that does not verify (``up --accept-broken-chain``):
        the acceptance is appended as the next record (``daemon.accepted-broken-chain``, with
        the problem) and the checkpoint moves to it, so every writer - embedded runs too -
        appends again after it, and ``audit verify`` still shows the break below."""
        last = self._last()
        if last[0]:
            self._write_head(*last)  # a cut tail accepted: the head names what is there now
        self._vouched = last
        self._checked = True
        rec = self.append("daemon.accepted-broken-chain", actor=actor, data={"problem": problem})
        self._write_checkpoint(rec.seq, rec.hash)
        return rec

    def append(self, kind: str, *, actor: str = "agentvm", sandbox: str | None = None, data: dict | None = None) -> Record:
        payload = json.dumps(data or {}, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
        if not self._checked:
            self.check_appendable()
        with self._lock, _FileLock(self.path.with_suffix(".lock"), self.lock_timeout):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
                seq, prev = (row[0] + 1, row[1]) if row else (1, GENESIS)
                t = time.time()
                h = _digest(prev, seq, t, kind, actor, sandbox, payload)
                self._conn.execute(
                    "INSERT INTO audit(seq, time, kind, actor, sandbox, data, prev, hash) VALUES (?,?,?,?,?,?,?,?)",
                    (seq, t, kind, actor, sandbox, payload, prev, h),
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            # several processes (the daemon, embedded runs) append to one chain: the lock file
            # orders commit and head together, so an older head never overtakes a newer one.
            # A crash right here leaves the head one record behind, which verify tells apart
            # from a cut tail.
            self._write_head(seq, h)
            # onto the record this writer vouched for: the chain is still verified to here
            if self._vouched is not None and self._vouched == (seq - 1, prev):
                self._vouched = (seq, h)
                if time.monotonic() - self._vouched_written > 2.0:
                    try:
                        self._write_checkpoint(seq, h)
                    except OSError:  # (a full disk) the record is in: the next check walks further
                        pass
            else:
                self._vouched = None  # another writer's records came between: the next check walks them
        return Record(seq, t, kind, actor, sandbox, json.loads(payload), prev, h)

    def _write_head(self, seq: int, h: str) -> None:
        tmp = self.head_path.with_name(f"{self.head_path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{seq} {h}\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.head_path)

    def records(self, *, since: float | None = None, sandbox: str | None = None, limit: int | None = None,
                kinds: tuple[str, ...] | None = None, newest: bool = False) -> list[Record]:
        """Records in chain order; ``newest`` with ``limit``: the last ``limit`` of them (still in
        chain order)."""
        q = "SELECT seq, time, kind, actor, sandbox, data, prev, hash FROM audit"
        cond, args = [], []
        if kinds:
            cond.append("kind IN (" + ",".join("?" * len(kinds)) + ")")
            args += list(kinds)
        if since is not None:
            cond.append("time >= ?")
            args.append(since)
        if sandbox is not None:
            cond.append("sandbox = ?")
            args.append(sandbox)
        if cond:
            q += " WHERE " + " AND ".join(cond)
        q += " ORDER BY seq DESC" if newest else " ORDER BY seq"
        if limit is not None:
            q += f" LIMIT {int(limit)}"
        out = []
        for seq, t, kind, actor, sb, data, prev, h in self._conn.execute(q, args):
            try:
                d = json.loads(data)
            except ValueError:
                d = {"_unparseable": data}
            out.append(Record(seq, t, kind, actor, sb, d, prev, h))
        return out[::-1] if newest else out

    def length(self) -> int:
        """How many records the chain holds (its last sequence number)."""
        row = self._conn.execute("SELECT MAX(seq) FROM audit").fetchone()
        return int(row[0] or 0)

    def verify(self, require_head: bool = True, *, since: tuple[int, str] | None = None) -> Verification:
        """Walk the chain; report the first record that does not hold, and a missing tail.

        The head is read *first*: records appended while the walk runs (another process) come
        after it and are no alarm. The chain holds when the record the head names exists with
        the head's hash; records beyond it are newer (or written just before a crash that kept
        the head from moving). Fewer records than the head names: the tail was cut.
        ``require_head=False`` (a copied database): a missing head file is a note, not a break."""
        head: tuple[int, str] | None = None
        try:
            hs, hh = self.head_path.read_text().split()
            head = (int(hs), hh)
        except FileNotFoundError:
            pass
        except ValueError:
            return Verification(False, 0, "the head file is corrupt", None)
        prev = GENESIS
        expected_seq = 1
        n = 0
        at_head = None  # the hash of the record the head names
        if since is not None and since[0] > 0:  # from a verified checkpoint: that record must be as it was
            row = self._conn.execute("SELECT seq, time, kind, actor, sandbox, data, prev, hash FROM audit WHERE seq = ?",
                                     (since[0],)).fetchone()
            if row is None:
                return Verification(False, 0, f"record {since[0]}, verified before, is missing (removed from the "
                                              "end or deleted)", since[0])
            if _digest(*row[6:7], *row[:6]) != row[7]:
                return Verification(False, since[0], f"record {since[0]} was modified (its hash does not match its "
                                                     "content)", since[0])
            if row[7] != since[1]:
                return Verification(False, 0, f"record {since[0]} is not the one verified before (rewritten)",
                                    since[0])
            if head is not None and head[0] < since[0] - 1:  # (one behind: a crash before the head moved)
                return Verification(False, since[0], f"the head says {head[0]} records but record {since[0]} was "
                                                     "verified before: the head was moved back", head[0])
            prev, expected_seq, n = since[1], since[0] + 1, since[0]
            if head is not None and 0 < head[0] <= since[0]:
                row = self._conn.execute("SELECT hash FROM audit WHERE seq = ?", (head[0],)).fetchone()
                at_head = row[0] if row else None
        for seq, t, kind, actor, sb, data, stored_prev, h in self._conn.execute(
            "SELECT seq, time, kind, actor, sandbox, data, prev, hash FROM audit WHERE seq >= ? ORDER BY seq",
            (expected_seq,),
        ):
            n += 1
            if seq != expected_seq:
                return Verification(False, n, f"record {expected_seq} is missing (found {seq} next)", expected_seq)
            if stored_prev != prev:
                return Verification(False, n, f"record {seq} does not follow record {seq - 1} (removed or reordered)", seq)
            if _digest(prev, seq, t, kind, actor, sb, data) != h:
                return Verification(False, n, f"record {seq} was modified (its hash does not match its content)", seq)
            if head is not None and seq == head[0]:
                at_head = h
            prev = h
            expected_seq += 1
        if head is None:
            if n > 1 and require_head:
                return Verification(False, n, "the head file is missing", n)
            if n:  # one record and no head: a crash right after the very first record
                return Verification(True, n, f"no head file ({self.head_path.name}) beside it: records cut from the "
                                             "end could not be detected")
            return Verification(True, n)
        if head[0] > n:
            return Verification(False, n, f"the chain ends at record {n} but the head says {head[0]}: records were "
                                          "removed from the end", n)
        if head[0] and at_head != head[1]:
            return Verification(False, n, f"record {head[0]} is not the one the head names (rewritten)", head[0])
        if n > head[0] + 1:
            return Verification(True, n)  # appended meanwhile by another process
        if n == head[0] + 1:
            return Verification(True, n, "the head is one record behind (agent-vm stopped between writing the last "
                                         "record and moving the head, or one was being appended); nothing is missing")
        return Verification(True, n)


# -- runs, as the chain records them ----------------------------------------------------------
RUN_KINDS = ("run.started", "run.exited", "run.refused", "lifecycle.running", "lifecycle.exited")


def fold_runs(records) -> list[dict]:
    """Fold audit records into runs, newest first: embedded and daemon-routed runs
    (``run.*``) and the sessions of the daemon's managed sandboxes (``lifecycle.*``). A run
    without its end has ``duration`` None; ``actor`` is who recorded its start (``agentvm``:
    the daemon). `agentvm runs` shows them; the daemon's recovery ends the ones it lost."""
    runs: dict[str, dict] = {}
    for r in records:
        d = r.data
        if r.kind == "run.started":
            runs[r.sandbox] = {"run": r.sandbox, "agent": d.get("agent"), "started": r.time, "via": "run",
                               "command": d.get("command") or [], "exit_code": None, "duration": None,
                               "actor": r.actor}
        elif r.kind == "lifecycle.running" and d.get("sandbox_id"):
            runs[d["sandbox_id"]] = {"run": d["sandbox_id"], "agent": r.sandbox, "started": r.time, "via": "daemon",
                                     "command": [], "exit_code": None, "duration": None, "actor": r.actor}
        elif r.kind == "run.refused":
            key = f"refused-{r.seq}"
            runs[key] = {"run": "-", "agent": d.get("agent"), "started": r.time, "via": "run", "command": [],
                         "exit_code": 77, "duration": 0.0, "refused": d.get("code"), "message": d.get("message")}
        elif r.kind in ("run.exited", "lifecycle.exited"):
            sid = r.sandbox if r.kind == "run.exited" else d.get("sandbox_id")
            run = runs.get(sid)
            if run is None:
                continue
            run["exit_code"] = d.get("exit_code")
            run["duration"] = d.get("duration") if d.get("duration") is not None else round(r.time - run["started"], 3)
            if d.get("reason"):  # daemon-lost: it ended with a daemon that never saw its exit
                run["ended"] = d["reason"]
            run["egress"] = d.get("egress")
            run["teardown_verified"] = d.get("teardown_verified")
    return sorted(runs.values(), key=lambda x: x["started"], reverse=True)
