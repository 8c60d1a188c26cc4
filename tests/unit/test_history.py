"""Run history: folding audit records into runs, and the retention of gate decision logs."""

from __future__ import annotations

import os
import time

import pytest

from agentvm.audit import AuditLog
from agentvm.cli.history_cmds import RUN_KINDS, collect_runs
from agentvm.paths import Paths
from agentvm.runtime import gc_logs


def test_runs_fold_embedded_daemon_and_refused(tmp_path):
    a = AuditLog(tmp_path / "audit.db")
    a.append("run.started", sandbox="run-1", data={"agent": "run", "command": ["true"]})
    a.append("run.exited", sandbox="run-1", data={"exit_code": 0, "duration": 0.5, "egress": {"denied": 2}})
    a.append("lifecycle.running", sandbox="worker", data={"sandbox_id": "worker-9"})
    a.append("run.refused", data={"agent": "run", "code": "policy.grant-unreachable", "message": "no"})
    a.append("run.started", sandbox="run-2", data={"agent": "run", "command": ["sleep", "9"]})
    a.append("lifecycle.exited", sandbox="worker", data={"sandbox_id": "worker-9", "exit_code": 3})
    a.append("policy.change", sandbox="worker", data={})
    runs = collect_runs(a.records(kinds=RUN_KINDS))
    assert [r["run"] for r in runs] == ["run-2", "-", "worker-9", "run-1"]
    by = {r["run"]: r for r in runs}
    assert by["run-1"]["exit_code"] == 0 and by["run-1"]["duration"] == 0.5 and by["run-1"]["egress"]["denied"] == 2
    assert by["run-2"]["exit_code"] is None, "still running (or its supervisor died)"
    assert by["worker-9"]["exit_code"] == 3 and by["worker-9"]["via"] == "daemon" and by["worker-9"]["duration"] >= 0
    assert by["-"]["refused"] == "policy.grant-unreachable" and by["-"]["exit_code"] == 77


@pytest.fixture
def paths(tmp_path):
    p = Paths(tmp_path / "home", tmp_path / "run").ensure()
    (p.home / "logs").mkdir(parents=True, exist_ok=True)
    return p


def test_old_decision_logs_go_but_a_running_sandboxs_stays(paths):
    logs = paths.home / "logs"
    old = time.time() - 40 * 86400
    for sid in ("old-run", "old-but-running", "new-run"):
        (logs / f"{sid}.egress.jsonl").write_text("{}\n")
    (logs / "not-a-log.txt").write_text("")
    for sid in ("old-run", "old-but-running"):
        os.utime(logs / f"{sid}.egress.jsonl", (old, old))
    os.utime(logs / "not-a-log.txt", (old, old))
    (paths.sandboxes / "old-but-running").mkdir(parents=True)
    assert gc_logs(paths, retention=30 * 86400) == ["old-run.egress.jsonl"]
    assert sorted(p.name for p in logs.iterdir()) == ["new-run.egress.jsonl", "not-a-log.txt",
                                                      "old-but-running.egress.jsonl"]
    assert gc_logs(paths, retention=0) == [], "0 keeps logs forever"


def test_retention_setting_is_validated(paths, monkeypatch):
    from agentvm.errors import ConfigError

    monkeypatch.setenv("AGENTVM_LOG_RETENTION", "soon")
    with pytest.raises(ConfigError, match="AGENTVM_LOG_RETENTION"):
        gc_logs(paths)
    monkeypatch.setenv("AGENTVM_LOG_RETENTION", "1s")
    (paths.home / "logs" / "x.egress.jsonl").write_text("")
    os.utime(paths.home / "logs" / "x.egress.jsonl", (time.time() - 5, time.time() - 5))
    assert gc_logs(paths) == ["x.egress.jsonl"]
