"""Opening agent-vm's SQLite databases so that loss is noticed, never papered over.

A database agent-vm created once must stay: ``state.db`` maps named agents to their host
uids, and if it silently came back empty the uids would be handed out again - an agent could
no longer write its own workspace, and files still owned by an old uid (a workspace, a
granted folder) would pass to another agent. So creating a database leaves a marker beside
it (``.NAME.made``); a marked database that is missing, empty, lacks its table, or is not a
database at all is refused with the way to recover (docs/daemon.md).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from agentvm.errors import ConfigError


def _marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.made")


_UIDS = "agent uids would be handed out again, and files still owned by the old ones would pass to other agents"


def connect(path: Path, table: str, schema: str, consequence: str = _UIDS) -> sqlite3.Connection:
    """A connection to ``path`` (WAL, busy timeout), created with ``schema`` the first time.
    ``consequence``: what starting over silently would do (said when the database is lost)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    made = _marker(path).exists()
    fresh = not path.exists() or path.stat().st_size == 0
    if fresh and made:
        raise _lost(path, "is missing or empty", consequence)
    # agent-vm's databases are its own: created 0600 (SQLite gives its -wal and -shm files the
    # same mode), and an older one readable by others is tightened
    if fresh and not made:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    try:
        st = path.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(path, st.st_mode & 0o700)
    except OSError:
        pass
    try:
        conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=10000")
        has = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone()
        if not has and made:
            conn.close()
            raise _lost(path, f"has no {table} table", consequence)
        if not has:
            _create(conn, path, table, schema)
    except sqlite3.OperationalError as exc:  # busy, locked, unopenable: not a lost database
        from agentvm.errors import BackendError

        raise BackendError(f"cannot use {path}: {exc}", hint="another agent-vm process may hold it; retry, and check "
                           "the disk (free space, permissions) if it persists", code="state.unavailable") from None
    except sqlite3.DatabaseError as exc:
        raise _lost(path, f"is not a readable database ({exc})", consequence) from None
    if not made:
        fd = os.open(_marker(path), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)
    return conn


def _create(conn: sqlite3.Connection, path: Path, table: str, schema: str) -> None:
    init_schema(conn, path, schema, table=table)


def init_schema(conn: sqlite3.Connection, path, schema: str, *, table: str | None = None) -> None:
    """WAL and ``schema`` for a database several processes may open at the same moment (two
    `agentvm run`s on a fresh home, a run beside the daemon): switching to WAL, and a schema
    script's deferred transaction, fail at once with "database is locked" when another process is
    doing the same (SQLite does not wait out a lock it could deadlock on). So they are done under
    an exclusive lock on a file beside the database (held for milliseconds); the others wait for
    it, then find the work done. ``table``: when it exists already, nothing is done. Every
    agent-vm database opened for writing comes here (statedb.connect, the audit chain, the
    checkpoint, snapshot and E2B stores)."""
    import fcntl

    path = Path(path)
    conn.execute("PRAGMA busy_timeout=10000")
    fd = os.open(path.with_name(f".{path.name}.init"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if table is not None and conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                              (table,)).fetchone():
            return
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(schema)
    finally:
        os.close(fd)


def _lost(path: Path, what: str, consequence: str = _UIDS) -> ConfigError:
    return ConfigError(
        f"{path} {what}, but agent-vm created it before: refusing to start over silently ({consequence})",
        hint=f"restore {path.name} from a backup; or, to start this installation over on purpose, move {path.name}, "
        f"{_marker(path).name} and the workspaces/ folder aside (see docs/daemon.md, 'Recovering state and audit databases')",
        code="state.lost",
    )
