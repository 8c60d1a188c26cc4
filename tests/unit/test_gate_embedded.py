"""The embedded gate comes up on the first connection: its socket listens from the start, a
sandbox that never connects never starts a gate, and nothing that connected is dropped."""

from __future__ import annotations

import socket

import pytest

from agentvm.gate.embedded import LazyGate
from agentvm.gate.embedded_worker import confinable
from agentvm.gate.policy import compile_egress

# each test on the in-process gate and on the confined gate worker (the default, where it can be had)
GATES = [pytest.param(False, id="in-process"),
         pytest.param(True, id="confined", marks=pytest.mark.skipif(confinable() is not None,
                                                                    reason=f"no confined gate here: {confinable()}"))]


@pytest.mark.parametrize("confine", GATES)
def test_an_unused_endpoint_is_abandoned_without_starting_a_gate(tmp_path, confine):
    g = LazyGate(tmp_path / "gate", tmp_path / "logs", confine=confine)
    ep = g.open("s1", "a", compile_egress(None), tmp_path / "s1.sock", None)
    assert (tmp_path / "s1.sock").exists() and oct((tmp_path / "s1.sock").stat().st_mode & 0o777) == "0o600"
    assert ep.abandon_if_unused() is True
    assert not g._started, "no gate was started for a sandbox that never connected"
    assert g._zygote is None, "nor a gate worker forked (no prefork: nothing for it to come before)"
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(str(tmp_path / "s1.sock"))
        raise AssertionError("connected to an abandoned endpoint")
    except OSError:
        pass  # refused: the socket is closed
    g.stop()


@pytest.mark.parametrize("confine", GATES)
def test_a_waiting_connection_is_served_not_abandoned(tmp_path, confine):
    g = LazyGate(tmp_path / "gate", tmp_path / "logs", confine=confine)
    ep = g.open("s2", "a", compile_egress(None), tmp_path / "s2.sock", None)
    c = socket.socket(socket.AF_UNIX)
    c.connect(str(tmp_path / "s2.sock"))
    c.sendall(b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
    c.settimeout(30)
    answer = c.recv(4096)
    assert answer.startswith(b"HTTP/1.1 403"), answer[:100]  # decided by the gate: no rule allows it
    c.close()
    assert ep.abandon_if_unused() is False, "claimed by the gate: never abandoned"
    endpoint = ep.result()
    g.close("s2")  # (a confined worker's counters reach the run at the close)
    assert endpoint.denials, "the attempt is counted"
    g.stop()
