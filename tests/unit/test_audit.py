"""The audit chain detects any edited, removed, inserted or reordered record, and says where."""

import sqlite3

import pytest

from agentvm.audit import AuditLog


@pytest.fixture
def log(tmp_path):
    a = AuditLog(tmp_path / "audit.db")
    for i in range(10):
        a.append("lifecycle.start" if i % 2 else "policy.change", actor="operator", sandbox=f"s{i % 3}", data={"i": i})
    yield a
    a.close()


def raw(log):
    return sqlite3.connect(str(log.path), isolation_level=None)


def test_intact_chain_verifies(log):
    v = log.verify()
    assert v.ok and v.records == 10
    recs = log.records()
    assert [r.seq for r in recs] == list(range(1, 11))
    assert all(recs[i].prev == recs[i - 1].hash for i in range(1, 10))
    assert [r.data["i"] for r in log.records(sandbox="s1")] == [1, 4, 7]


def test_edited_record_is_found(log):
    raw(log).execute("UPDATE audit SET data = ? WHERE seq = 4", ('{"i":99}',))
    v = log.verify()
    assert not v.ok and v.at_seq == 4 and "modified" in v.problem


def test_edited_record_with_recomputed_hash_breaks_the_next_link(log):
    from agentvm.audit import _digest

    c = raw(log)
    seq, t, kind, actor, sb, data, prev, h = c.execute("SELECT * FROM audit WHERE seq=4").fetchone()
    newdata = '{"i":99}'
    c.execute("UPDATE audit SET data=?, hash=? WHERE seq=4", (newdata, _digest(prev, seq, t, kind, actor, sb, newdata)))
    v = log.verify()
    assert not v.ok and v.at_seq == 5


def test_removed_record_is_found(log):
    raw(log).execute("DELETE FROM audit WHERE seq = 6")
    v = log.verify()
    assert not v.ok and v.at_seq == 6 and "missing" in v.problem


def test_reordered_records_are_found(log):
    c = raw(log)
    c.execute("UPDATE audit SET seq = -1 WHERE seq = 3")
    c.execute("UPDATE audit SET seq = 3 WHERE seq = 4")
    c.execute("UPDATE audit SET seq = 4 WHERE seq = -1")
    v = log.verify()
    assert not v.ok and v.at_seq == 3


def test_truncated_tail_is_found(log):
    raw(log).execute("DELETE FROM audit WHERE seq >= 9")
    v = log.verify()
    assert not v.ok and "removed from the end" in v.problem


def test_appends_continue_the_chain_after_reopen(tmp_path):
    a = AuditLog(tmp_path / "a.db")
    a.append("x")
    a.close()
    b = AuditLog(tmp_path / "a.db")
    r = b.append("y")
    assert r.seq == 2 and b.verify().ok


def _appender(path, n):
    a = AuditLog(path)
    for i in range(n):
        a.append("run.started", sandbox=f"p{i}", data={"i": i})
    a.close()


def test_several_processes_append_to_one_chain_and_the_head_keeps_up(tmp_path):
    """The daemon and embedded runs append to the same chain from different processes: the
    head file must always end up naming the last record (it moves under the write lock)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_appender, args=(tmp_path / "audit.db", 40)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    v = AuditLog(tmp_path / "audit.db").verify()
    assert v.ok and v.records == 160, v


def test_records_appended_during_a_walk_are_not_a_cut_tail(log):
    """verify reads the head first: records another process appends meanwhile come after it."""
    head = log.head_path.read_text()
    log.append("late.one")
    log.append("late.two")
    log.head_path.write_text(head)  # as if verify had read the head before those appends
    v = log.verify()
    assert v.ok and v.records == 12, v
    log.head_path.write_text("13 " + "0" * 64 + "\n")
    assert not log.verify().ok, "a head beyond the chain: the tail was cut"


def test_a_deleted_chain_is_not_silently_restarted(tmp_path):
    from agentvm.errors import ConfigError

    a = AuditLog(tmp_path / "audit.db")
    a.append("x")
    a.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"audit.db{suffix}").unlink(missing_ok=True)
    with pytest.raises(ConfigError) as ei:
        AuditLog(tmp_path / "audit.db")
    assert ei.value.code == "audit.lost"


def test_a_stuck_lock_holder_costs_a_bounded_wait(tmp_path):
    import fcntl
    import os
    import time

    a = AuditLog(tmp_path / "audit.db", lock_timeout=0.3)
    fd = os.open(tmp_path / "audit.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a process stopped mid-append
    t = time.monotonic()
    with pytest.raises(OSError):
        a.append("waits")
    assert time.monotonic() - t < 3
    os.close(fd)
    a.append("now")
    assert a.verify().ok


def test_every_writer_verifies_from_the_checkpoint_before_its_first_record(tmp_path):
    """A writer refuses to append to a chain broken since the last verified checkpoint (a cut
    tail, the checkpoint record rewritten); a lost checkpoint means a full walk; an accepted
    break is recorded and moves the checkpoint past it."""
    import sqlite3

    import pytest

    from agentvm.audit import AuditLog
    from agentvm.errors import ConfigError

    db = tmp_path / "audit.db"
    a = AuditLog(db)
    for i in range(5):
        a.append("t.x", data={"i": i})
    a.close()
    assert AuditLog(db).read_checkpoint()[0] == 5

    c = sqlite3.connect(db)
    c.execute("DELETE FROM audit WHERE seq = 5")
    c.commit()
    c.close()
    with pytest.raises(ConfigError) as e:
        AuditLog(db).append("t.y")
    assert e.value.code == "audit.broken-chain" and "verified before, is missing" in e.value.message

    b = AuditLog(db)
    rec = b.accept_break("record 5 is missing")
    assert rec.kind == "daemon.accepted-broken-chain" and b.read_checkpoint() == (rec.seq, rec.hash)
    b.close()
    AuditLog(db).append("t.after")  # appends again after the acceptance

    c = sqlite3.connect(db)
    c.execute("UPDATE audit SET data = '{\"forged\": 1}' WHERE seq = 1")  # below the checkpoint
    c.commit()
    c.close()
    AuditLog(db).append("t.unseen")  # (found by the full walks, not by a writer's check)
    assert not AuditLog.open_readonly(db).verify().ok
    (tmp_path / "audit.verified").unlink()
    with pytest.raises(ConfigError, match="record 1 was modified"):
        AuditLog(db).append("t.refused")
