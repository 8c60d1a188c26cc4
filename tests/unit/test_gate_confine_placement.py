"""Gate workers' placement keys and the security alert of a worker's death (pure parts of
agentvm.gate.workers; the real processes are in test_gate_workers.py and
tests/attacks/test_gate_containment.py)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from agentvm.errors import AgentVMError
from agentvm.gate.workers import WorkerPool, placement_key


def test_placement_keys():
    assert placement_key(None, "a", "L3") is None
    assert placement_key("agent", "a", "L3") == "agent:a" != placement_key("agent", "b", "L3")
    assert placement_key("tier", "a", "L3") == placement_key("tier", "b", "L3") == "tier:L3"
    assert placement_key("tier", "a") == "tier:unknown"
    with pytest.raises(AgentVMError):
        placement_key("sandbox", "a")


def test_a_death_by_sigsys_or_a_memory_error_is_a_security_alert(tmp_path):
    pool = WorkerPool(1, tmp_path / "state", tmp_path / "logs", on_record=None, on_event=None)
    w = SimpleNamespace(index=3, proc=SimpleNamespace(pid=1234), uid=5000003, tenant="agent:a")
    a = pool.death_alert(w, -signal.SIGSYS, {"sb-1": None})
    assert a["alert"] == "security" and a["cause"] == "seccomp" and a["signal"] == "SIGSYS"
    assert a["pid"] == 1234 and a["uid"] == 5000003 and a["sandboxes"] == ["sb-1"] and a["tenant"] == "agent:a"
    assert pool.death_alert(w, -signal.SIGSEGV, {})["cause"] == "crash"
    for rc in (None, 0, 3, -signal.SIGKILL, -signal.SIGTERM):  # replaced or stopped: no alert
        assert pool.death_alert(w, rc, {}) is None


def test_pool_options_are_checked(tmp_path):
    with pytest.raises(AgentVMError):
        WorkerPool(1, tmp_path / "s", tmp_path / "l", on_record=None, on_event=None, confine="yes")
    with pytest.raises(AgentVMError):
        WorkerPool(1, tmp_path / "s", tmp_path / "l", on_record=None, on_event=None, isolate="sandbox")
    assert WorkerPool(1, tmp_path / "s", tmp_path / "l", on_record=None, on_event=None, confine=None).confine is None


def test_a_workers_counters_are_checked_before_the_daemon_adds_them():
    from agentvm.gate.workers import _counters_ok

    good = {"allowed": 1, "bytes_out": 2, "bytes_in": 3, "alerts": 0, "denials": {("default-deny", "x.test:443"): 2},
            "denial_reasons": {("default-deny", "x.test:443"): ("no rule allows it", "add x.test")}}
    assert _counters_ok(good)
    for bad in ({**good, "allowed": "1"}, {**good, "bytes_in": -1}, {**good, "alerts": True},
                {**good, "denials": {"k": 1}}, {**good, "denial_reasons": {("a", "b"): "why"}},
                {k: v for k, v in good.items() if k != "alerts"}, [good], "x"):
        assert not _counters_ok(bad), bad


def test_no_agent_uid_is_ever_a_gate_workers(tmp_path):
    """The last GATE_UIDS uids of the agent range belong to the confined gate workers: agent
    uids stop below them, so a compromised worker never shares an agent's uid (its files)."""
    from agentvm import identity
    from agentvm.gate import confine

    home = tmp_path / "home"
    home.mkdir()
    base = identity.uid_base(home)
    gate = {confine.gate_uid(home, i) for i in range(confine.MAX_GATE_UIDS)}
    top = base + identity.AGENT_RANGE - identity.GATE_UIDS
    assert min(gate) >= top and max(gate) < base + identity.AGENT_RANGE
    db = home / "state.db"
    with __import__("unittest.mock").mock.patch.object(identity, "AGENT_RANGE", identity.GATE_UIDS + 3):
        uids = [identity.agent_identity(db, f"a{i}").uid for i in range(3)]
        assert max(uids) < base + identity.AGENT_RANGE - identity.GATE_UIDS
        import pytest

        from agentvm.errors import BackendError

        with pytest.raises(BackendError, match="no free agent uid"):
            identity.agent_identity(db, "one-too-many")
