"""`agentvm down` then `up` brings back the persistent workers that were running (their
desired state stays `running` when the daemon, not the operator, stopped them); a worker the
operator stopped stays stopped; `up --no-resume` leaves them all stopped, recorded."""

from __future__ import annotations

import time

import pytest

import agentvm.daemon.server as server
from tests.unit.test_daemon_fake import Running, spec


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")


def _wait(c, name, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.get(name)["state"] == state:
            return
        time.sleep(0.02)
    raise AssertionError(f"{name} is {c.get(name)['state']}, not {state}")


def test_down_then_up_resumes_what_was_running_and_not_what_was_stopped(tmp_path):
    r = Running(tmp_path)
    c = r.client
    for n in ("w1", "w2"):
        c.create(spec(n), f"{n}.yaml")
        c.action(n, "start")
        _wait(c, n, "running")
    c.action("w2", "stop")  # the operator's stop: it stays stopped
    r.stop()  # `agentvm down`
    r2 = Running(tmp_path)
    try:
        c2 = r2.client
        _wait(c2, "w1", "running")
        assert c2.get("w2")["state"] == "stopped"
        recs = [x for x in c2.request("GET", "/v1/audit") if x["kind"] in ("daemon.recovered", "lifecycle.stopped-with-daemon")]
        assert any(x["kind"] == "lifecycle.stopped-with-daemon" and x["sandbox"] == "w1" for x in recs)
        assert [x["data"]["restarted"] for x in recs if x["kind"] == "daemon.recovered"][-1] == ["w1"]
    finally:
        r2.stop()


def test_up_no_resume_leaves_them_stopped_and_says_so(tmp_path, monkeypatch):
    r = Running(tmp_path)
    r.client.create(spec("w1"), "w1.yaml")
    r.client.action("w1", "start")
    _wait(r.client, "w1", "running")
    r.stop()
    real = server.Daemon.__init__

    def no_resume(self, *a, **kw):
        real(self, *a, **dict(kw, resume=False))

    monkeypatch.setattr(server.Daemon, "__init__", no_resume)
    r2 = Running(tmp_path)
    try:
        time.sleep(0.3)
        row = r2.client.get("w1")
        assert row["state"] == "stopped" and row["desired"] == "stopped"
        rec = [x for x in r2.client.request("GET", "/v1/audit") if x["kind"] == "daemon.recovered"][-1]
        assert rec["data"]["not_resumed"] == ["w1"] and rec["data"]["restarted"] == []
    finally:
        r2.stop()
