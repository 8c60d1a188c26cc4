"""What the root daemon takes from a gate worker, which may be compromised (security review,
2026-11-28): a message that expands past a bound (pickle's shared references) is refused before
anything walks it; a decision record is written under the agent the daemon gave the sandbox to,
with no kind of its own and a sane time; a vault write is a rotated refresh token and nothing
else of the entry."""

from __future__ import annotations

import json
import pickle
import time

import pytest

from agentvm.errors import AgentVMError
from agentvm.gate import workers as W


def test_a_message_that_expands_exponentially_is_refused_at_once():
    x: list = []
    for _ in range(60):  # ~400 bytes of pickle, 2^60 leaves once walked
        x = [x, x]
    data = pickle.dumps(("records", [{"sandbox": "s", "agent": x}]), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) < 1000
    t = time.monotonic()
    with pytest.raises(ValueError, match="expands"):
        W._plain_loads(data)
    assert time.monotonic() - t < 1.0  # (not a timing claim about speed: the walk did not expand it)


def test_cycles_deep_nesting_and_oversized_messages_are_refused():
    a: list = []
    a.append(a)
    with pytest.raises(ValueError):
        W._plain_loads(pickle.dumps(a))
    deep: list = []
    for _ in range(W.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ValueError, match="nests"):
        W._plain_loads(pickle.dumps(deep))
    with pytest.raises(ValueError, match="bytes from a gate worker"):
        W._plain_loads(b"\x80" * (W.MAX_FROM_WORKER + 1))


def test_honest_messages_pass_shared_values_included():
    shared = {"reason": "no rule allows it"}
    recs = [{"sandbox": "s", "n": i, "headers": [("a", "b")] * 5, "why": shared} for i in range(256)]
    msg = W._plain_loads(pickle.dumps(("records", recs), protocol=pickle.HIGHEST_PROTOCOL))
    assert msg[1][255]["n"] == 255 and msg[1][0]["why"] == shared


def test_a_record_is_written_under_the_daemons_agent_with_no_kind_and_a_sane_time():
    now = time.time()
    forged = {"sandbox": "a-1", "agent": "victim", "kind": "lifecycle.exited", "time": now + 86400,
              "verdict": "deny", "host": "x.test"}
    rec = W._worker_record(forged, "attacker", now)
    assert rec["agent"] == "attacker" and "kind" not in rec and rec["time"] == now
    assert rec["verdict"] == "deny" and rec["host"] == "x.test" and rec["sandbox"] == "a-1"
    assert W._worker_record({"sandbox": "a-1", "time": now - 10}, "a", now)["time"] == now - 10
    assert W._worker_record({"sandbox": "a-1", "time": "soon"}, "a", now)["time"] == now


class _Broker:
    kind = "oauth2-refresh"


class _Binding:
    broker = _Broker()


class _Creds:
    def __init__(self, entry: dict):
        self.entry = entry

    def _raw_value(self, name):
        return json.dumps(self.entry)


def test_a_worker_may_store_a_rotated_refresh_token_and_nothing_else():
    cur = {"tokenUrl": "https://idp.test/token", "clientId": "c", "clientSecret": "fake-secret", "refreshToken": "r1"}
    creds = _Creds(cur)
    W._only_rotated(0, "k", _Binding(), creds, json.dumps({**cur, "refreshToken": "r2"}))
    for bad in ({**cur, "tokenUrl": "https://evil.test/token", "refreshToken": "r2"},
                {**cur, "clientId": "other", "refreshToken": "r2"},
                {**cur, "refreshToken": ""},
                {**cur, "extra": "x", "refreshToken": "r2"},
                {k: v for k, v in cur.items() if k != "clientSecret"}):
        with pytest.raises(AgentVMError, match="more than its refresh token"):
            W._only_rotated(0, "k", _Binding(), creds, json.dumps(bad))
    with pytest.raises(AgentVMError):
        W._only_rotated(0, "k", _Binding(), creds, "not json")

    class _Other:
        broker = type("B", (), {"kind": "aws-sts"})()

    with pytest.raises(AgentVMError):
        W._only_rotated(0, "k", _Other(), creds, json.dumps({**cur, "refreshToken": "r2"}))
