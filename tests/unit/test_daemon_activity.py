"""A managed sandbox's last activity (its idle timeout's clock): held in memory per gate
decision, written to its row at most every ACTIVITY_SAVE seconds, never moved back, and a
state database that refuses writes does not end the watch that enforces TTL and idle timeout."""

from __future__ import annotations

import asyncio
import time
import types

from agentvm.daemon import server
from agentvm.daemon.server import Daemon, Managed
from agentvm.daemon.state import State


def row_activity(st: State, name: str) -> float:
    return st.get(name).last_activity


def test_activity_is_written_at_most_every_activity_save_and_the_row_never_moves_back(tmp_path):
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, None)
    m = Managed("w")
    t0 = 1_000_000.0
    m.touch(st, t0)  # the start
    assert row_activity(st, "w") == t0
    m.activity = t0 + 0.6  # allowed gate decisions: memory only
    m.save_activity(st, now=t0 + 1.0)  # younger than ACTIVITY_SAVE since the last write: not yet
    assert row_activity(st, "w") == t0
    m.touch(st, t0 + 4.9)  # an exec: on the row at once
    assert row_activity(st, "w") == t0 + 4.9 and m.activity == t0 + 4.9
    m.save_activity(st, now=t0 + 5.0 + server.ACTIVITY_SAVE)
    assert row_activity(st, "w") == t0 + 4.9
    # memory behind the row (another writer, a previous run's late decision): the row stays
    m.activity, m.activity_saved = t0 + 2.0, 0.0
    m.save_activity(st, now=t0 + 5.0 + server.ACTIVITY_SAVE)
    assert row_activity(st, "w") == t0 + 4.9  # never back to an older time
    m.activity = t0 + 9.0
    m.save_activity(st, now=t0 + 9.5 + server.ACTIVITY_SAVE)
    assert row_activity(st, "w") == t0 + 9.0
    m.activity = t0 + 9.5
    m.save_activity(st)  # the end of a run: whatever moved, now
    assert row_activity(st, "w") == t0 + 9.5


def test_a_state_database_that_refuses_writes_does_not_end_the_watch(tmp_path, caplog):
    """_run_once stops a sandbox as soon as its watch ends: a failed activity write (a full or
    read-only disk) must not end it - the idle timeout is still enforced, from memory."""
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, 1.5)  # idle timeout 1.5 s
    st.update("w", last_activity=time.time() - 100)  # the row says: idle long ago
    st._c.execute("PRAGMA query_only=1")  # from now on every write fails
    records = []
    fake = types.SimpleNamespace(state=st, record=lambda kind, **kw: records.append(kind))

    async def go():
        m = Managed("w")
        m.activity = time.time()  # but a request went through the gate just now
        m.activity_saved = 0.0
        watch = asyncio.ensure_future(Daemon._watch(fake, m, st.get("w")))
        await asyncio.sleep(1.0)
        alive = not watch.done()
        m.activity = time.time()  # more traffic
        await asyncio.sleep(1.0)
        still = not watch.done()
        # then quiet: the idle timeout ends it (its own write of desired=stopped fails here too,
        # which ends the watch as well - the sandbox is stopped either way)
        await asyncio.wait({watch}, timeout=5.0)
        return alive, still, watch.done(), m.activity_save_failed

    alive, still, done, failed = asyncio.run(go())
    assert alive and still and done and failed
    assert records == ["lifecycle.idle-timeout"]
    assert sum("cannot save the last activity" in r.getMessage() for r in caplog.records) == 1


def test_a_row_ahead_of_the_clock_does_not_keep_a_sandbox_from_idling_out(tmp_path):
    """A last activity in the future (written while the wall clock ran ahead) counts as now:
    the idle timeout still ends a quiet sandbox."""
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, 1.0)
    st.update("w", last_activity=time.time() + 3600)
    records = []
    fake = types.SimpleNamespace(state=st, record=lambda kind, **kw: records.append(kind))

    async def go():
        watch = asyncio.ensure_future(Daemon._watch(fake, Managed("w"), st.get("w")))
        await asyncio.wait({watch}, timeout=5.0)
        return watch.done()

    assert asyncio.run(go()) and records == ["lifecycle.idle-timeout"]


def test_a_failed_activity_write_is_retried_after_activity_retry_not_every_tick(tmp_path, monkeypatch):
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, None)
    calls = []

    def touch(name, t):
        calls.append(t)
        raise server.sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(st, "touch", touch)
    monkeypatch.setattr(server, "ACTIVITY_RETRY", 1.2)
    fake = types.SimpleNamespace(state=st, record=lambda kind, **kw: None)

    async def go():
        m = Managed("w")
        watch = asyncio.ensure_future(Daemon._watch(fake, m, st.get("w")))
        for _ in range(6):  # activity all along: every tick would want to write
            m.activity = time.time()
            await asyncio.sleep(0.5)
        watch.cancel()

    asyncio.run(go())
    assert 2 <= len(calls) <= 3, calls  # at ~0.5 s, then ~1.2 s later (and maybe once more)
