"""What `agentvm runs` and `agentvm logs RUN` print: aligned columns from the rows, where a
run's output went, and a clear answer for a name that is nothing known."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from agentvm.audit import AuditLog
from agentvm.cli import cli, main
from agentvm.errors import EXIT_CONFIG
from agentvm.paths import default_paths

LONG_AGENT = "research-assistant-with-a-long-name"  # cut to 16 characters before
LONG_RUN = f"{LONG_AGENT}-tool-notes-1a2b3c4d5e6f"  # 22 columns before: the row slid right


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AGENTVM_RUNTIME_DIR", str(tmp_path / "run"))  # no daemon there
    p = default_paths().ensure()
    return AuditLog(p.audit_dir / "audit.db")


def test_runs_columns_fit_the_longest_cell(home):
    home.append("run.started", actor="uid:0", sandbox="run-1a2b3c4d", data={"agent": "run", "command": ["true"]})
    home.append("run.exited", actor="uid:0", sandbox="run-1a2b3c4d", data={"exit_code": 0, "duration": 0.25})
    home.append("run.started", actor="agentvm", sandbox=LONG_RUN,
                data={"agent": LONG_AGENT, "command": ["python3", "-c", "print(1)"]})
    home.append("run.exited", actor="agentvm", sandbox=LONG_RUN,
                data={"exit_code": 3, "duration": 12.5, "egress": {"denied": 12}})
    r = CliRunner().invoke(cli, ["runs"])
    assert r.exit_code == 0, r.output
    head, first, second = r.output.splitlines()
    assert first.startswith(LONG_RUN + "  " + LONG_AGENT + " ")  # whole, never cut
    assert second.startswith("run-1a2b3c4d ")
    for col in ("AGENT", "STARTED", "COMMAND"):  # left-aligned: each starts where its header does
        at = head.index(col)
        assert first[at - 1] == " " and first[at] != " " and second[at - 1] == " " and second[at] != " ", col
    for col, a, b in (("EXIT", "3", "0"), ("DENIED", "12", None), ("DURATION", "12.5s", "0.2s")):  # right-aligned
        end = head.index(col) + len(col)
        assert first[end - len(a):end] == a, col
        if b:
            assert second[end - len(b):end] == b, col
    assert first.endswith("python3 -c print(1)") and second.endswith("true")


def test_runs_cuts_only_a_long_command(home):
    home.append("run.started", actor="uid:0", sandbox="run-1", data={"agent": "run", "command": ["echo", "x" * 400]})
    lines = CliRunner().invoke(cli, ["runs"]).output.splitlines()
    assert len(lines[1]) == 160 and lines[1].endswith("xxx...") and lines[1].startswith("run-1  run  ")


def _run(log, sid, actor):
    log.append("run.started", actor=actor, sandbox=sid, data={"agent": "a", "command": ["true"]})
    log.append("run.exited", actor=actor, sandbox=sid, data={"exit_code": 0, "duration": 0.1})


def test_logs_says_where_a_runs_output_went(home):
    _run(home, "run-embedded", "uid:0")
    _run(home, "a-1a2b3c4d", "agentvm")  # `agentvm run` through the daemon: the daemon records it
    home.append("lifecycle.running", actor="agentvm", sandbox="worker", data={"sandbox_id": "worker-5e6f7a8b"})
    _run(home, "worker-5e6f7a8b", "agentvm")  # a managed sandbox's session
    out = {sid: CliRunner().invoke(cli, ["logs", sid]).output.splitlines()[-1]
           for sid in ("run-embedded", "a-1a2b3c4d", "worker-5e6f7a8b")}
    assert out["run-embedded"] == ("(an embedded run: its stdout and stderr went to its caller; "
                                   "agent-vm does not keep them)")
    assert out["a-1a2b3c4d"] == ("(a run through the daemon: its stdout and stderr were relayed to its caller; "
                                 "agent-vm does not keep them)")
    assert out["worker-5e6f7a8b"] == ("(a session of the daemon's sandbox worker: its output is in its log, "
                                      "`agentvm logs worker`)")


def test_logs_of_an_unknown_name_says_what_was_looked_for_and_how_to_list(home, capsys):
    assert main(["logs", "nosuchrun"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err == ("agentvm: error [logs.not-found]: no run or sandbox named 'nosuchrun'\n"
                   "  hint: `agentvm runs` lists past runs, `agentvm ps` the daemon's sandboxes "
                   "(the daemon is not running: no sandbox was looked up)\n")


def test_logs_of_an_unknown_name_with_the_daemon_up(home, capsys, monkeypatch):
    from agentvm.cli import daemon_cmds
    from agentvm.daemon.client import ApiFailure

    class Daemon:
        def logs(self, name):
            raise ApiFailure(404, {"error": "sandbox.not-found", "message": f"no sandbox named {name!r}"})

    monkeypatch.setattr(daemon_cmds, "_client", Daemon)
    assert main(["logs", "nosuchrun"]) == EXIT_CONFIG
    assert capsys.readouterr().err == ("agentvm: error [logs.not-found]: no run or sandbox named 'nosuchrun'\n"
                                       "  hint: `agentvm runs` lists past runs, `agentvm ps` the daemon's sandboxes\n")


def test_a_daemon_timeout_from_any_command_says_where_the_log_is(home, capsys, monkeypatch):
    from agentvm.cli import daemon_cmds
    from agentvm.daemon.client import DaemonUnavailable

    class Daemon:
        def logs(self, name):
            raise DaemonUnavailable("the agent-vm daemon did not answer within 2s (x)", code="daemon.timeout",
                                    hint="it may be stopped or overloaded: check its log (`agentvm up --foreground`)")

    monkeypatch.setattr(daemon_cmds, "_client", Daemon)
    assert main(["logs", "x"]) == 125
    home_dir = default_paths().home
    assert f"  hint: it may be stopped or overloaded: its log is {home_dir}/daemon.log;" in capsys.readouterr().err
