"""Host identities for sandboxes: a dedicated unprivileged uid per agent.

* A declared agent gets a uid of its own, allocated once and recorded in the state database,
  so its workspace files are owned by that uid and no other agent can touch them.
* An anonymous ``agentvm run`` leases a uid from a separate pool for the life of the run
  (an ``flock``-ed file, so a crashed supervisor never leaks it); the lease is released only
  after teardown verified that no process of that uid remains.

The ranges are above the usual subuid allocations and configurable with
``AGENTVM_UID_BASE``. ``agentvm doctor`` checks that no local account uses them.
"""

from __future__ import annotations

import os
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
    lease_fd: int | None = None
    lease_path: str = ""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS identities (
    name TEXT PRIMARY KEY,
    uid INTEGER UNIQUE NOT NULL,
    created REAL NOT NULL
);
"""


SCHEMA_VERSION = 1


def _connect(db: Path):
    from agentvm import statedb  # lazy: anonymous runs never touch the database

    conn = statedb.connect(db, "identities", _SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION};")
    return conn


def uid_processes(uid: int) -> list[tuple[int, int, str]]:
    """``(pid, ppid, state)`` of every host process whose real uid is ``uid``."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
            # /proc/<pid> belongs to the euid - or to root when the process made itself
            # non-dumpable, so root-owned entries must be read too.
            if owner != uid and owner != 0:
                continue
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


def lease_identity(lease_dir: Path, sandbox_id: str) -> Identity:
    """Lease an anonymous-run uid: ``<lease_dir>/<uid>.lock`` held with ``flock`` for the
    life of the run. A lock left by a dead supervisor is free again once no process of that
    uid is alive (the sandbox dies with its supervisor, but we check rather than assume)."""
    import fcntl

    lease_dir.mkdir(parents=True, exist_ok=True)
    base = uid_base() + AGENT_RANGE
    start = int.from_bytes(os.urandom(4), "little") % LEASE_RANGE
    for i in range(LEASE_RANGE):
        uid = base + (start + i) % LEASE_RANGE
        path = lease_dir / f"{uid}.lock"
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            # the holder released (unlinked) it between our open and our lock: the lock we
            # hold is on a dead inode, and a newcomer may lock a fresh file of that name
            os.close(fd)
            continue
        if existed and uid_has_processes(uid):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {sandbox_id}\n".encode())
        return Identity(uid=uid, gid=uid, leased=True, lease_fd=fd, lease_path=str(path))
    raise BackendError("no free sandbox uid left for an anonymous run")


def release_lease(ident: Identity) -> None:
    """Give the uid back (call only after teardown verified no process of it remains)."""
    if ident.lease_fd is None:
        return
    try:
        os.unlink(ident.lease_path)
    except OSError:
        pass
    os.close(ident.lease_fd)
