"""The LLM budget's pieces without a gate: reading usage from OpenAI- and Anthropic-compatible
responses (JSON and SSE, split anywhere), estimation when usage is missing, the checks before
a request, prices, the per-agent store, and the agent file's validation."""

from __future__ import annotations

import json

import pytest

from agentvm.gate.budget import Budget, BudgetSpec, BudgetStore, Meter, compile_budget

JSON_H = [(b"content-type", b"application/json")]
SSE_H = [(b"content-type", b"text/event-stream; charset=utf-8")]


def run(meter_headers, body: bytes, status=200, split=1, request_bytes=100):
    m = Meter()
    m.head(status, meter_headers)
    for i in range(0, len(body), split):
        m.feed(body[i:i + split])
    return m.finish(request_bytes)


def sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("split", [1, 7, 4096])
def test_openai_json_and_stream(split):
    doc = {"model": "gpt-4o", "usage": {"prompt_tokens": 11, "completion_tokens": 22, "total_tokens": 33}}
    assert run(JSON_H, json.dumps(doc).encode(), split=split) == ("gpt-4o", 11, 22, False)
    body = sse({"model": "gpt-4o", "choices": [{"delta": {"content": "x"}}], "usage": None},
               {"model": "gpt-4o", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}})
    assert run(SSE_H, body, split=split) == ("gpt-4o", 5, 9, False)


@pytest.mark.parametrize("split", [1, 13, 4096])
def test_anthropic_stream_and_message(split):
    body = (b"event: message_start\n" + b"data: " + json.dumps({"type": "message_start", "message": {
        "model": "claude-x", "usage": {"input_tokens": 40, "cache_read_input_tokens": 60, "output_tokens": 1}}}).encode()
        + b"\n\nevent: message_delta\ndata: " + json.dumps({"type": "message_delta", "usage": {"output_tokens": 25}}).encode()
        + b"\n\n")
    assert run(SSE_H, body, split=split) == ("claude-x", 100, 25, False)
    msg = {"type": "message", "model": "claude-x", "usage": {"input_tokens": 3, "output_tokens": 4}}
    assert run(JSON_H, json.dumps(msg).encode(), split=split) == ("claude-x", 3, 4, False)


def test_openai_responses_api_events():
    body = sse({"type": "response.created", "response": {"model": "gpt-5", "usage": None}},
               {"type": "response.completed", "response": {"model": "gpt-5", "usage": {"input_tokens": 7, "output_tokens": 8}}})
    assert run(SSE_H, body) == ("gpt-5", 7, 8, False)


def test_missing_usage_is_estimated_never_free_and_errors_cost_nothing():
    body = sse({"model": "gpt-4o", "choices": [{"delta": {"content": "x" * 400}}]})
    model, i, o, est = run(SSE_H, body, request_bytes=400)
    assert (model, i, est) == ("gpt-4o", 100, True) and o >= 100
    # a body too large to keep: estimated from its size
    big = b'{"model": "m", "pad": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    assert run(JSON_H, big, split=65536)[3] is True
    # not JSON at all (HTML, gzip the upstream sent anyway): estimated
    assert run([(b"content-type", b"text/html")], b"<html>" * 100)[3] is True
    # an error answer generated nothing
    assert run(JSON_H, b'{"error": {"message": "bad"}}', status=400) == (None, 0, 0, False)
    # hostile numbers are ignored, not trusted
    doc = {"usage": {"prompt_tokens": -5, "completion_tokens": True, "output_tokens": "9"}}
    assert run(JSON_H, json.dumps(doc).encode())[3] is True


def test_budget_checks_before_each_request_prices_and_live_changes(tmp_path):
    spec = BudgetSpec(tokens=100, requests=4, cost=0.001, hosts=("api.test", "*.llm.test"),
                      prices=(("gpt-4o*", 2.5, 10.0), ("*", 1.0, 1.0)))
    assert spec.covers("api.test") and spec.covers("API.TEST.") and spec.covers("eu.llm.test")
    assert not spec.covers("llm.test") and not spec.covers("api.test.evil") and not spec.covers("xapi.test")
    store = BudgetStore(tmp_path / "budgets.db")
    b = Budget("w", spec, store)
    assert b.refusal() is None
    llm = b.add("gpt-4o-mini", 10, 20, False)
    assert llm == {"model": "gpt-4o-mini", "input_tokens": 10, "output_tokens": 20, "cost": (10 * 2.5 + 20 * 10) / 1e6}
    assert b.add("other", 10, 10, True)["estimated"] is True
    assert b.refusal() is None
    b.add("other", 30, 30, False)
    assert "tokens" in b.refusal() and "110 used" in b.refusal()
    b.set_spec(spec.with_limits(tokens=1000, requests=3))
    assert "requests" in b.refusal()
    b.set_spec(spec.with_limits(tokens=1000, requests=10))
    assert b.refusal() is None or "budget of 0.001" in b.refusal()
    # the counters survive (a new Budget over the same store: a restart)
    again = Budget("w", spec, BudgetStore(tmp_path / "budgets.db"))
    assert again.usage.to_dict() == b.usage.to_dict() and again.usage.by_model["other"] == [2, 40, 40]
    again.reset()
    assert Budget("w", spec, store).usage.tokens == 0
    assert oct((tmp_path / "budgets.db").stat().st_mode & 0o777) == "0o600"


def test_a_lost_budgets_db_is_refused_not_silently_reset(tmp_path):
    from agentvm.errors import ConfigError

    BudgetStore(tmp_path / "budgets.db")
    (tmp_path / "budgets.db").unlink()
    with pytest.raises(ConfigError) as e:
        BudgetStore(tmp_path / "budgets.db")
    assert "LLM budget would start over" in e.value.message


def test_agent_file_validation():
    from _spec_helpers import agent

    from agentvm.errors import ConfigError
    from agentvm.spec.loader import load_agent_text

    def load(budget: str):
        return load_agent_text(agent(f"spec:\n  limits:\n    budget: {budget}\n"), "a.yaml", preset_dirs=[])

    ok = load("{tokens: 5, prices: {'gpt-*': {input: 1, output: 2}}}").spec.spec.limits.budget
    c = compile_budget(ok)
    assert c.tokens == 5 and "api.openai.com" in c.hosts and c.prices == (("gpt-*", 1.0, 2.0),)
    c = compile_budget(load("{cost: 1, prices: {'*': {input: 1, output: 1}, 'a*': {input: 2, output: 2}}}")
                       .spec.spec.limits.budget)
    assert c.prices[-1][0] == "*", "the catch-all is tried last"
    for bad, why in [("{}", "at least one"), ("{cost: 1}", "'*'"), ("{tokens: 0}", "greater than"),
                     ("{tokens: 5, hosts: []}", "at least one host"), ("{tokens: 5, hosts: ['a.test:443']}", "not a host"),
                     ("{tokens: 5, hosts: ['*']}", "not a host"), ("{tokens: 5, extra: 1}", "xtra")]:
        with pytest.raises(ConfigError) as e:
            load(bad)
        assert why in str(e.value.message) + str(getattr(e.value, "hint", "")), (bad, e.value.message)


def test_the_request_limit_is_exact_with_requests_in_flight(tmp_path):
    """Reserved at admission, settled with the response: N concurrent requests cannot all
    pass a check that sees the same count (the agent's sandboxes share one ledger)."""
    spec = BudgetSpec(requests=3, hosts=("api.test",))
    store = BudgetStore(tmp_path / "budgets.db")
    a, b = Budget("w", spec, store), Budget("w", spec, BudgetStore(tmp_path / "budgets.db"))  # two sandboxes
    assert a.ledger is b.ledger
    got = [x.admit() for x in (a, b, a, b, a)]
    assert got[:3] == [None, None, None], got
    assert all(g is not None and g[0] == "budget:reserved" for g in got[3:]), got
    a.release()  # one never got an answer: its reservation ends uncounted
    assert b.admit() is None
    for x in (a, b, a):
        x.add("m", 1, 1, False)
    why = a.admit()
    assert why is not None and why[0] == "budget:exceeded" and "3 made" in why[1]


def test_token_limits_count_requests_in_flight_at_their_average(tmp_path):
    spec = BudgetSpec(tokens=1000, hosts=("api.test",))
    b = Budget("t", spec, BudgetStore(tmp_path / "budgets.db"))
    assert b.admit() is None
    b.add("m", 100, 100, False)  # 200 per response so far
    held = [b.admit() for _ in range(5)]
    assert held[:4] == [None] * 4 and held[4][0] == "budget:reserved" and "in flight" in held[4][1], held
    for _ in range(4):
        b.add("m", 100, 100, False)
    assert b.admit()[0] == "budget:exceeded"


def test_another_process_counting_the_same_agent_is_seen_at_the_next_admission(tmp_path):
    from agentvm.gate.budget import Ledger

    spec = BudgetSpec(requests=2, hosts=("api.test",))
    here = Budget("p", spec, BudgetStore(tmp_path / "budgets.db"))
    there = Ledger("p", BudgetStore(tmp_path / "budgets.db"))  # an embedded run's gate: its own process
    assert there.admit(spec) is None
    there.settle(spec, "m", 5, 5, False)
    assert here.admit() is None
    here.add("m", 5, 5, False)
    assert here.admit()[0] == "budget:exceeded"  # both counts, not the last writer's
    assert BudgetStore(tmp_path / "budgets.db").load("p").requests == 2


def test_non_finite_money_is_refused():
    from _spec_helpers import agent

    from agentvm.errors import ConfigError
    from agentvm.spec.loader import load_agent_text

    for bad in ("{cost: .inf, prices: {'*': {input: 1, output: 1}}}", "{cost: .nan, prices: {'*': {input: 1, output: 1}}}",
                "{cost: 1, prices: {'*': {input: .inf, output: 1}}}"):
        with pytest.raises(ConfigError):
            load_agent_text(agent(f"spec:\n  limits:\n    budget: {bad}\n"), "a.yaml", preset_dirs=[])


def test_cheap_or_failed_calls_cannot_shrink_the_reservation(tmp_path):
    spec = BudgetSpec(tokens=100_000, hosts=("api.test",))
    b = Budget("m1", spec, BudgetStore(tmp_path / "budgets.db"))
    assert b.admit() is None
    assert b.admit()[0] == "budget:reserved", "no response size known yet: one at a time"
    b.add("m", 0, 0, False)  # an error answer: no tokens
    assert b.admit() is None and b.admit()[0] == "budget:reserved"
    b.add("m", 0, 0, False)
    b.add("m", 20_000, 20_000, False)  # now a real one: 40k a response
    got = [b.admit() for _ in range(4)]
    assert got[:2] == [None, None] and got[2][0] == "budget:reserved", got


def test_a_count_the_database_refused_is_not_forgotten(tmp_path, monkeypatch):
    import sqlite3

    spec = BudgetSpec(requests=3, hosts=("api.test",))
    store = BudgetStore(tmp_path / "budgets.db")
    b = Budget("m2", spec, store)

    def full(*a, **kw):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "add", full)
    for _ in range(3):
        assert b.admit() is None
        b.add("m", 1, 1, False)
    why = b.admit()
    assert why is not None and why[0] == "budget:exceeded", "the counts the disk refused still count"
    monkeypatch.undo()
    assert b.ledger.pending.requests == 3  # kept until a write succeeds, added to every read meanwhile
    b.set_spec(spec.with_limits(requests=10))
    assert b.admit() is None
    b.add("m", 1, 1, False)  # the disk takes writes again: this count and the three it missed
    assert b.ledger.pending.requests == 0 and BudgetStore(tmp_path / "budgets.db").load("m2").requests == 4


@pytest.mark.parametrize("headers", [JSON_H, SSE_H])
def test_a_response_nested_past_the_json_parsers_depth_is_estimated_not_a_crash(headers):
    # json.loads raises RecursionError (not ValueError) on deep nesting: an upstream's body
    # must not be able to raise out of the meter into the relay
    deep = b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    body = deep if headers is JSON_H else b"data: " + deep + b"\n\n"
    model, inp, out, estimated = run(headers, body, split=4096)
    assert estimated and inp > 0 and out > 0
