"""A managed sandbox's last activity (its idle timeout's clock): held in memory per gate
decision, written to its row at most every ACTIVITY_SAVE seconds, never moved back, and a
state database that refuses writes does not end the watch that enforces TTL and idle timeout."""

from __future__ import annotations

import asyncio
import time
import types

from agentvm.daemon import supervisor as server
from agentvm.daemon.server import Daemon
from agentvm.daemon.supervisor import Managed
from agentvm.daemon.state import State


def row_activity(st: State, name: str) -> float:
    return st.get(name).last_activity


class FakeDaemon:
    """What Daemon._watch uses of the daemon: its state, its records, its helper."""

    _expired = Daemon._expired

    def __init__(self, st: State) -> None:
        self.state = st
        self.records: list[str] = []

    def record(self, kind, **kw) -> None:
        self.records.append(kind)


def started(name: str) -> Managed:
    m = Managed(name)
    m.started_at = m.activity_clock = server._clock()  # as _run_once does at launch
    return m


def traffic(m: Managed) -> None:
    """An allowed gate decision, as Daemon._on_decision notes it."""
    m.activity_clock, m.activity = server._clock(), time.time()


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
    """_run_once stops a sandbox as soon as its watch ends: a failed write (a full or read-only
    disk) must not end it - the idle timeout is still enforced, from memory."""
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, 1.5)  # idle timeout 1.5 s
    st._c.execute("PRAGMA query_only=1")  # from now on every write fails
    d = FakeDaemon(st)

    async def go():
        m = started("w")
        traffic(m)
        watch = asyncio.ensure_future(Daemon._watch(d, m, st.get("w")))
        await asyncio.sleep(1.0)
        alive = not watch.done()
        traffic(m)  # more traffic
        await asyncio.sleep(1.0)
        still = not watch.done()
        await asyncio.wait({watch}, timeout=5.0)  # then quiet: the idle timeout ends it
        return alive, still, watch.done() and watch.exception() is None, m.activity_save_failed

    alive, still, ended_cleanly, failed = asyncio.run(go())
    assert alive and still and ended_cleanly and failed
    assert d.records == ["lifecycle.idle-timeout"]
    said = [r.getMessage() for r in caplog.records]
    assert sum("cannot save the last activity" in m for m in said) == 1
    assert sum("cannot mark w as stopped" in m for m in said) == 1  # (desired=stopped: refused too)


def test_a_failed_read_of_the_row_does_not_end_the_watch(tmp_path, monkeypatch):
    """A transient error reading the row (locked past its busy timeout, an I/O error): the
    last row read still rules; TTL and idle timeout still end the sandbox when they run out."""
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", 2.0, None)  # TTL 2 s
    real_get, fails = st.get, []

    def get(name):
        if len(fails) < 2:
            fails.append(name)
            raise server.sqlite3.OperationalError("database is locked")
        return real_get(name)

    monkeypatch.setattr(st, "get", get)
    d = FakeDaemon(st)

    async def go():
        m = started("w")
        watch = asyncio.ensure_future(Daemon._watch(d, m, real_get("w")))
        await asyncio.sleep(1.3)  # two failed reads
        alive = not watch.done()
        await asyncio.wait({watch}, timeout=5.0)
        return alive, watch.done() and watch.exception() is None, server._clock() - m.started_at

    alive, ended_cleanly, after = asyncio.run(go())
    assert alive and ended_cleanly and len(fails) == 2 and 2.0 <= after < 4.0
    assert d.records == ["lifecycle.ttl-expired"]


def test_the_wall_clock_does_not_move_the_idle_timeout(tmp_path, monkeypatch):
    """Idle and TTL run on the monotonic clock: a row written while the wall clock ran an hour
    ahead, then a clock an hour behind, change neither."""
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, 1.0)
    st.update("w", last_activity=time.time() + 3600)
    real_time = time.time
    monkeypatch.setattr(server.time, "time", lambda: real_time() - 3600)
    d = FakeDaemon(st)

    async def go():
        m = started("w")
        watch = asyncio.ensure_future(Daemon._watch(d, m, st.get("w")))
        await asyncio.wait({watch}, timeout=5.0)
        return watch.done(), server._clock() - m.started_at

    done, after = asyncio.run(go())
    assert done and 1.0 <= after < 2.5 and d.records == ["lifecycle.idle-timeout"]


def test_a_failed_activity_write_is_retried_after_activity_retry_not_every_tick(tmp_path, monkeypatch):
    st = State(tmp_path / "d.db")
    st.create("w", "x", "f", "persistent", None, None)
    calls = []

    def touch(name, t):
        calls.append(t)
        raise server.sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(st, "touch", touch)
    monkeypatch.setattr(server, "ACTIVITY_RETRY", 1.2)
    d = FakeDaemon(st)

    async def go():
        m = started("w")
        watch = asyncio.ensure_future(Daemon._watch(d, m, st.get("w")))
        for _ in range(6):  # activity all along: every tick would want to write
            traffic(m)
            await asyncio.sleep(0.5)
        watch.cancel()

    asyncio.run(go())
    assert 2 <= len(calls) <= 3, calls  # at ~0.5 s, then ~1.2 s later (and maybe once more)


# -- the same on a real daemon (the fake substrate: no sandbox is started) --------------------

def _daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")
    from tests.unit.test_daemon_fake import Running

    return Running(tmp_path)


def test_allowed_decisions_and_an_exec_keep_a_worker_alive_then_quiet_ends_it(tmp_path, monkeypatch):
    """Through the daemon's own paths: _on_decision (as the gate calls it) and exec are activity;
    once they stop, the idle timeout ends the persistent worker for good."""
    from tests.unit.test_daemon_fake import spec

    r = _daemon(tmp_path, monkeypatch)
    try:
        c, d = r.client, r.daemon
        c.create(spec("w1"), "w1.yaml", idle_timeout=1.5)
        c.action("w1", "start")
        list(c.exec("w1", ["true"]))
        for _ in range(8):  # 4 s of allowed requests, every 0.5 s
            d.loop.call_soon_threadsafe(d._on_decision, {"agent": "w1", "verdict": "allow", "time": time.time()})
            time.sleep(0.5)
        assert c.get("w1")["state"] == "running"
        quiet = time.monotonic()
        while c.get("w1")["state"] == "running" and time.monotonic() - quiet < 10:
            time.sleep(0.1)
        row = c.get("w1")
        assert row["state"] in ("exited", "stopped") and row["desired"] == "stopped" and row["restarts"] == 0, row
        assert 1.0 <= time.monotonic() - quiet < 4.0
        kinds = [a["kind"] for a in c.audit(sandbox="w1")]
        assert "lifecycle.idle-timeout" in kinds and "lifecycle.restart-scheduled" not in kinds
    finally:
        r.stop()


def test_a_worker_whose_ttl_ran_out_is_not_restarted_when_the_disk_refuses_to_say_so(tmp_path, monkeypatch):
    """The write of desired=stopped after a TTL fails (a locked database): the persistent
    worker is still not restarted - the daemon remembers the expiry."""
    import sqlite3

    from tests.unit.test_daemon_fake import spec

    r = _daemon(tmp_path, monkeypatch)
    try:
        c, st = r.client, r.daemon.state
        real_update, refused = st.update, []

        def update(name, **fields):
            if fields == {"desired": "stopped"} and not refused:
                refused.append(name)
                raise sqlite3.OperationalError("database is locked")
            return real_update(name, **fields)

        st.update = update
        c.create(spec("w1"), "w1.yaml", ttl=1.5)
        c.action("w1", "start")
        time.sleep(5.0)  # past the TTL and the first restart backoff
        row = c.get("w1")
        kinds = [a["kind"] for a in c.audit(sandbox="w1") if a["kind"].startswith("lifecycle")]
        assert refused == ["w1"]
        assert row["state"] in ("exited", "stopped") and row["restarts"] == 0, (row, kinds)
        assert kinds.count("lifecycle.ttl-expired") == 1 and "lifecycle.restart-scheduled" not in kinds, kinds
        # and the next start is a start: the expiry does not stick
        c.action("w1", "start")
        assert c.get("w1")["state"] == "running"
    finally:
        r.stop()


def test_ttl_and_idle_timeout_must_be_numbers(tmp_path, monkeypatch):
    from agentvm.daemon.client import ApiFailure
    from tests.unit.test_daemon_fake import spec

    r = _daemon(tmp_path, monkeypatch)
    try:
        for bad in ({"ttl": "5m"}, {"idle_timeout": 0}, {"ttl": -1}, {"idle_timeout": True}):
            try:
                r.client.create(spec("w1"), "w1.yaml", **bad)
            except ApiFailure as exc:
                field = next(iter(bad))
                assert exc.status == 400 and exc.code == "config.invalid" and f"  {field}: " in str(exc), exc
            else:
                raise AssertionError(f"{bad} was accepted")
    finally:
        r.stop()
