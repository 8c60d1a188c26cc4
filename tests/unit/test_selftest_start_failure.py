"""The selftest's runner: a case whose gVisor sandbox died while starting (runsc: "cannot read
client sync file") never ran its attack - it is an error, never a pass, and never run again to
hide it; its evidence carries the backend's reason (the sandbox's boot log), not only runsc's
"EOF"."""

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


def test_a_start_failure_is_an_error_with_the_backends_reason_and_is_not_run_again():
    start = F.Verdict.error("attacker did not run: creating container: cannot read client sync file: EOF")
    c, calls = _case([start, F.Verdict.contained("nothing read")])
    (r,) = F.run_cases([c], SimpleNamespace(substrate="gvisor", start_failures=[]))
    assert len(calls) == 1 and r["status"] == "error"
    assert r["evidence"].endswith("[backend: the sandbox's boot process said: W attempt 1]"), r["evidence"]


def test_other_verdicts_are_left_as_they_are():
    for v in (F.Verdict.escaped("read the canary"), F.Verdict.error("the sink never answered"),
              F.Verdict.contained("x")):
        c, calls = _case([v, F.Verdict.contained("y")])
        (r,) = F.run_cases([c], SimpleNamespace(substrate="gvisor", start_failures=[]))
        assert r["status"] == v.status and r["evidence"] == v.evidence and len(calls) == 1


def test_the_sink_records_a_body_sent_after_its_head():
    """(the permissive-gate run of tools.held-egress failed in a full run: the gate forwarded the
    request's head and body in two writes, the sink read once - the head - and the canary in the
    body was never recorded, so an escape read as "not held")"""
    import socket
    import time

    sink = F.Sink()
    try:
        mark = sink.mark()
        c = socket.create_connection(("127.0.0.1", sink.port))
        c.sendall(b"POST /collect HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n")
        time.sleep(0.2)
        c.sendall(b"held-canary")
        answer = c.recv(100)
        c.close()
        assert answer.endswith(b"sink!")
        hits = sink.since(mark)  # (recorded before the answer was sent)
        assert len(hits) == 1 and hits[0][1].endswith(b"\r\n\r\nheld-canary"), hits
    finally:
        sink.close()
