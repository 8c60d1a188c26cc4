"""A pool workspace's disk at the end of a run, in its result and report: the pool ran out
(ENOSPC, possible only under overcommit) or the agent hit its own limit (EDQUOT)."""

from __future__ import annotations

from agentvm import runreport
from agentvm.lifecycle import RunResult

M = 1 << 20


def _result(disk):
    return RunResult(sandbox_id="s", agent="a", exit_code=0, duration=1.0, teardown={"verified": True}, disk=disk)


def test_a_full_pool_is_named_and_said_with_the_numbers():
    r = _result({"used": 200 * M, "limit": 300 * M, "limit_hit": False, "pool_free": 1 * M, "pool_size": 256 * M,
                 "pool_full": True})
    assert r.limits_hit == ["workspace-pool-full"]
    d = r.to_dict()
    assert d["disk"]["pool_full"] is True and d["limits_hit"] == ["workspace-pool-full"]
    text = runreport.render(d)
    assert "the workspace pool is full: 255.0M of 256.0M used; the agent's writes failed with ENOSPC" in text, text
    assert "200.0M of its limit 300.0M" in text, text


def test_its_own_limit_is_disk_and_nothing_is_said_under_it():
    r = _result({"used": 16 * M, "limit": 16 * M, "limit_hit": True, "pool_free": 200 * M, "pool_size": 256 * M,
                 "pool_full": False})
    assert r.limits_hit == ["disk"]
    assert "disk limit (16.0M) was hit" in runreport.render(r.to_dict())
    quiet = _result({"used": 1 * M, "limit": 16 * M, "limit_hit": False, "pool_free": 200 * M,
                     "pool_size": 256 * M, "pool_full": False})
    assert quiet.limits_hit == [] and runreport.render(quiet.to_dict()) == ""
    assert _result(None).limits_hit == [] and runreport.render(_result(None).to_dict()) == ""
