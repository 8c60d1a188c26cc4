"""agentvm.statedb: a new database opened by several processes at the same moment (two
`agentvm run`s on a fresh home) is made once, and none of them fails with "database is
locked" (found in CI: one of two concurrent runs exited 125, state.unavailable)."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

import pytest

SCHEMA = "CREATE TABLE IF NOT EXISTS things (name TEXT PRIMARY KEY, n INTEGER);\nPRAGMA user_version=1;"


def _open_and_write(path: str, i: int, start, out) -> None:
    from agentvm import statedb
    from agentvm.errors import AgentVMError

    start.wait(10)
    try:
        conn = statedb.connect(__import__("pathlib").Path(path), "things", SCHEMA)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO things VALUES (?, ?)", (f"p{i}", i))
        conn.execute("COMMIT")
        conn.close()
        out.put((i, "ok"))
    except AgentVMError as exc:
        out.put((i, f"{exc.code}: {exc}"))


@pytest.mark.parametrize("round_", range(25))
def test_a_new_database_opened_by_many_processes_at_once_is_made_once_without_a_lock_error(tmp_path, round_):
    ctx = mp.get_context("fork")
    path = tmp_path / "state.db"
    start, out = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_open_and_write, args=(str(path), i, start, out)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    results = dict(out.get(timeout=5) for _ in procs)
    assert results == {i: "ok" for i in range(8)}, results
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert sorted(r[0] for r in c.execute("SELECT n FROM things")) == list(range(8))


def _open_audit(path: str, i: int, start, out) -> None:
    from pathlib import Path

    from agentvm.audit import AuditLog

    start.wait(10)
    try:
        log = AuditLog(Path(path))
        log.append("test.record", actor="t", data={"i": i})
        out.put((i, "ok"))
    except Exception as exc:  # noqa: BLE001 - what the test reports
        out.put((i, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("round_", range(10))
def test_a_new_audit_chain_opened_by_many_writers_at_once_takes_every_record(tmp_path, round_):
    """The audit chain switched to WAL before its busy timeout and outside any lock: of two runs
    on a fresh home one failed with 'database is locked' (CI, again after the state db's fix)."""
    ctx = mp.get_context("fork")
    path = tmp_path / "audit" / "audit.db"
    start, out = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_open_audit, args=(str(path), i, start, out)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = dict(out.get(timeout=5) for _ in procs)
    assert results == {i: "ok" for i in range(6)}, results
