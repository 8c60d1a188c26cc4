"""Host identities for sandboxes: a dedicated unprivileged uid per agent.

* A declared agent gets a uid of its own, allocated once and recorded in the state database,
  so its workspace files are owned by that uid and no other agent can touch them.
* An anonymous ``agentvm run`` leases a uid from a separate pool for the life of the run;
  the lease is released only after teardown verified that no process of that uid remains.

The ranges are above the usual subuid allocations and configurable with
``AGENTVM_UID_BASE``. ``agentvm doctor`` checks that no local account uses them.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import BackendError

AGENT_RANGE = 60000  # uids for named agents: base .. base+AGENT_RANGE-1
LEASE_RANGE = 60000  # uids for anonymous runs: base+AGENT_RANGE ..


def uid_base() -> int:
    try:
        return int(os.environ.get("AGENTVM_UID_BASE", "2100000"))
    except ValueError:
        return 2100000


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    leased: bool  # True for an anonymous-run lease, released at teardown


_SCHEMA = """
CREATE TABLE IF NOT EXISTS identities (
    name TEXT PRIMARY KEY,
    uid INTEGER UNIQUE NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS uid_leases (
    uid INTEGER PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    holder_pid INTEGER NOT NULL,
    created REAL NOT NULL
);
"""


def _connect(db: Path) -> sqlite3.Connection:
    db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(db), timeout=10.0, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=10000")
    conn.executescript(_SCHEMA)
    return conn


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def uid_processes(uid: int) -> list[tuple[int, int, str]]:
    """``(pid, ppid, state)`` of every host process whose real uid is ``uid``."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue  # /proc/<pid> is owned by the euid: a cheap first filter
            state, ppid, real_uid = "?", 0, -1
            with open(f"/proc/{entry.name}/status") as fh:
                for line in fh:
                    if line.startswith("State:"):
                        state = line.split()[1]
                    elif line.startswith("PPid:"):
                        ppid = int(line.split()[1])
                    elif line.startswith("Uid:"):
                        real_uid = int(line.split()[1])
                        break
            if real_uid == uid:
                out.append((int(entry.name), ppid, state))
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
    return out


def uid_has_processes(uid: int) -> list[int]:
    """Live (non-zombie) host pids of ``uid``: teardown verification."""
    return [pid for pid, _, state in uid_processes(uid) if state not in ("Z", "X")]


def agent_identity(db: Path, name: str) -> Identity:
    base = uid_base()
    with closing(_connect(db)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute("SELECT uid FROM identities WHERE name=?", (name,)).fetchone()
        if row is None:
            used = {r[0] for r in conn.execute("SELECT uid FROM identities")}
            uid = next((u for u in range(base, base + AGENT_RANGE) if u not in used), None)
            if uid is None:
                conn.execute("ROLLBACK")
                raise BackendError("no free agent uid left", hint="remove unused agents or raise AGENTVM_UID_BASE")
            conn.execute("INSERT INTO identities(name, uid, created) VALUES (?,?,?)", (name, uid, time.time()))
            conn.execute("COMMIT")
        else:
            uid = row[0]
            conn.execute("COMMIT")
    return Identity(uid=uid, gid=uid, leased=False)


def lease_identity(db: Path, sandbox_id: str) -> Identity:
    base = uid_base() + AGENT_RANGE
    with closing(_connect(db)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute("SELECT uid, holder_pid FROM uid_leases").fetchall()
        taken = set()
        for uid, holder in rows:
            if _pid_alive(holder) or uid_has_processes(uid):
                taken.add(uid)
            else:
                conn.execute("DELETE FROM uid_leases WHERE uid=?", (uid,))
        # Spread leases so a uid is not reused immediately after release.
        start = int(time.monotonic_ns() // 1000) % LEASE_RANGE
        uid = None
        for i in range(LEASE_RANGE):
            cand = base + (start + i) % LEASE_RANGE
            if cand not in taken:
                uid = cand
                break
        if uid is None:
            conn.execute("ROLLBACK")
            raise BackendError("no free sandbox uid left for an anonymous run")
        conn.execute(
            "INSERT INTO uid_leases(uid, sandbox_id, holder_pid, created) VALUES (?,?,?,?)",
            (uid, sandbox_id, os.getpid(), time.time()),
        )
        conn.execute("COMMIT")
    return Identity(uid=uid, gid=uid, leased=True)


def release_lease(db: Path, uid: int) -> None:
    with closing(_connect(db)) as conn:
        conn.execute("DELETE FROM uid_leases WHERE uid=?", (uid,))
