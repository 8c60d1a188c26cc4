"""The selftest's runner: a case whose gVisor sandbox died while starting (runsc: "cannot read
client sync file") never ran its attack - it is run once more and the report says so; an
escape or any other error is never run again."""

from __future__ import annotations

from types import SimpleNamespace

from agentvm.selftest import framework as F


def _case(outcomes: list):
    calls = []

    def run(env):
        calls.append(1)
        v = outcomes[len(calls) - 1]
        if F.START_FAILED in v.evidence:  # what Env.run_policy records from the run's setup_error
            env.start_failures.append(f"the sandbox's boot process said: W attempt {len(calls)}")
        return v

    return F.Case("fs.test-case", "filesystem", "a test case", "no-landlock", run), calls


def test_a_start_failure_is_run_again_and_said():
    start = F.Verdict.error("attacker did not run: creating container: cannot read client sync file: EOF")
    c, calls = _case([start, F.Verdict.contained("nothing read")])
    (r,) = F.run_cases([c], SimpleNamespace(substrate="gvisor", start_failures=[]))
    assert len(calls) == 2 and r["status"] == "contained"
    assert r["evidence"].startswith("(run again: the first attempt's gVisor sandbox did not start")
    # the backend's reason (the boot log's words) is in the evidence, not only runsc's "EOF"
    assert "[backend: the sandbox's boot process said: W attempt 1]" in r["evidence"]


def test_two_start_failures_stay_an_error_and_other_verdicts_are_not_run_again():
    start = F.Verdict.error("cannot read client sync file: EOF")
    c, calls = _case([start, start])
    (r,) = F.run_cases([c], SimpleNamespace(substrate="gvisor", start_failures=[]))
    assert r["status"] == "error" and len(calls) == 2
    assert "W attempt 1" in r["evidence"] and "W attempt 2" in r["evidence"]
    for v in (F.Verdict.escaped("read the canary"), F.Verdict.error("the sink never answered")):
        c, calls = _case([v, F.Verdict.contained("x")])
        assert F.run_cases([c], SimpleNamespace(substrate="gvisor", start_failures=[]))[0]["status"] == v.status and len(calls) == 1
