"""uid leases for anonymous runs: two runs must never hold the same uid, including when a
lease is released exactly between another leaser's open and its lock."""

from __future__ import annotations

import fcntl

import pytest

from agentvm import identity
from agentvm.errors import BackendError


def test_a_lease_released_between_open_and_lock_is_not_double_granted(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_UID_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setattr(identity, "LEASE_RANGE", 1)  # one uid: any double grant shows
    monkeypatch.setattr(identity, "uid_has_processes", lambda uid: [])
    a = identity.lease_identity(tmp_path, "run-a", tmp_path)
    real_flock = fcntl.flock
    state = {"released": False}

    def racing_flock(fd, op):
        if not state["released"]:  # B has opened a's lock file; a is released right now
            state["released"] = True
            identity.release_lease(a)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", racing_flock)
    try:
        b = identity.lease_identity(tmp_path, "run-b", tmp_path)
    except BackendError:
        b = None
    monkeypatch.setattr(fcntl, "flock", real_flock)
    c = identity.lease_identity(tmp_path, "run-c", tmp_path)  # a newcomer, after the release
    assert b is None or b.uid != c.uid, "the same uid was leased twice"
    identity.release_lease(c)
    if b is not None:
        identity.release_lease(b)


def test_a_held_lease_is_not_granted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_UID_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setattr(identity, "LEASE_RANGE", 1)
    monkeypatch.setattr(identity, "uid_has_processes", lambda uid: [])
    a = identity.lease_identity(tmp_path, "run-a", tmp_path)
    with pytest.raises(BackendError):
        identity.lease_identity(tmp_path, "run-b", tmp_path)
    identity.release_lease(a)
    identity.release_lease(identity.lease_identity(tmp_path, "run-c", tmp_path))


def test_a_state_database_that_was_emptied_or_damaged_is_refused(tmp_path, monkeypatch):
    """Never silently recreated: uids would be reassigned to other agents."""
    monkeypatch.setenv("AGENTVM_UID_REGISTRY", str(tmp_path / "registry"))  # not the host's
    from agentvm.errors import ConfigError
    from agentvm.identity import agent_identity

    db = tmp_path / "state.db"
    first = agent_identity(db, "alpha")
    assert agent_identity(db, "alpha") == first
    for damage in (b"", b"garbage" * 600):
        db.write_bytes(damage)
        with pytest.raises(ConfigError) as ei:
            agent_identity(db, "beta")
        assert ei.value.code == "state.lost" and "handed out again" in ei.value.message and "backup" in ei.value.hint
    db.unlink()
    with pytest.raises(ConfigError):
        agent_identity(db, "beta")
    assert not db.exists() or db.stat().st_size == 0, "nothing was recreated"


def test_each_installation_claims_its_own_uid_range(tmp_path, monkeypatch):
    """Two homes on one host never share uids; a home keeps its range; explicit bases win."""
    monkeypatch.delenv("AGENTVM_UID_BASE", raising=False)
    monkeypatch.setenv("AGENTVM_UID_REGISTRY", str(tmp_path / "registry"))
    a, b = tmp_path / "home-a", tmp_path / "home-b"
    a.mkdir()
    b.mkdir()
    base_a = identity.uid_base(a)
    base_b = identity.uid_base(b)
    assert base_a != base_b and abs(base_a - base_b) >= identity.SLOT
    assert identity.uid_base(a) == base_a, "kept"
    (a / "uid-range").unlink()  # the home's own record lost: the registry still knows it
    assert identity.uid_base(a) == base_a
    ua = identity.agent_identity(a / "state.db", "x").uid
    ub = identity.agent_identity(b / "state.db", "x").uid
    assert ua != ub and base_a <= ua < base_a + identity.AGENT_RANGE
    lease = identity.lease_identity(tmp_path / "leases-b", "run-1", b)
    assert base_b + identity.AGENT_RANGE <= lease.uid < base_b + identity.SLOT
    identity.release_lease(lease)
    monkeypatch.setenv("AGENTVM_UID_BASE", "5000000")
    assert identity.uid_base(a) == 5000000
    monkeypatch.setenv("AGENTVM_UID_BASE", "1000")
    with pytest.raises(BackendError):
        identity.uid_base(a)


def test_a_range_of_an_installation_that_is_gone_is_claimed_again(tmp_path, monkeypatch):
    """The host-wide registry of uid ranges does not fill up with installations that no longer
    exist (test homes, removed installs): a range whose home is gone and in which nothing runs
    is claimed again; one whose home still holds its record is not."""
    from agentvm import identity

    reg = tmp_path / "reg"
    reg.mkdir()
    monkeypatch.setenv("AGENTVM_UID_REGISTRY", str(reg))
    monkeypatch.delenv("AGENTVM_UID_BASE", raising=False)
    live = tmp_path / "live"
    live.mkdir()
    base0, base1 = identity.DEFAULT_BASE, identity.DEFAULT_BASE + identity.SLOT
    (live / "uid-range").write_text(f"{base0}\n")
    (reg / str(base0)).write_text(f"{live}\n")
    (reg / str(base1)).write_text(f"{tmp_path / 'gone'}\n")  # its home was removed
    new = tmp_path / "new"
    new.mkdir()
    assert identity.uid_base(new) == base1
    assert (reg / str(base1)).read_text().strip() == str(new)
    assert identity.uid_base(live) == base0, "a live installation keeps its range"
    # a test's home goes with its whole temporary folder: the parent is gone too, and the
    # nearest ancestor that exists says the home is absent
    base2 = identity.DEFAULT_BASE + 2 * identity.SLOT
    (reg / str(base2)).write_text(f"{tmp_path / 'tmpdir-gone' / 'sub' / 'home'}\n")
    other = tmp_path / "other"
    other.mkdir()
    assert identity.uid_base(other) == base2


def test_an_agent_whose_uid_is_now_a_gate_workers_is_refused_not_run_as_it(tmp_path, monkeypatch):
    """The gate workers' band at the top of the agent range grew (64 -> 1024 slots): an agent made
    before, with a uid now in the band, must not run as a uid a confined gate worker also uses
    (it could signal or trace that worker, or read the decision logs it owns)."""
    import sqlite3

    from agentvm.gate.confine import gate_uid
    from agentvm.identity import AGENT_RANGE, GATE_UIDS, agent_identity, uid_base

    monkeypatch.setenv("AGENTVM_UID_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.delenv("AGENTVM_GATE_UID_BASE", raising=False)
    db = tmp_path / "state.db"
    ok = agent_identity(db, "alpha")  # allocated from the bottom, below the band
    base = uid_base(tmp_path)
    assert ok.uid < base + AGENT_RANGE - GATE_UIDS
    band = gate_uid(tmp_path, 0)
    assert band == base + AGENT_RANGE - GATE_UIDS
    with sqlite3.connect(db) as c:  # as an installation that had allocated this high
        c.execute("INSERT INTO identities(name, uid, created) VALUES ('old', ?, 0)", (band + 5,))
    with pytest.raises(BackendError) as ei:
        agent_identity(db, "old")
    assert "confined gate worker" in ei.value.message and "AGENTVM_GATE_UID_BASE" in ei.value.hint
    assert agent_identity(db, "alpha") == ok
