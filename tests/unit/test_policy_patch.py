"""Live policy as data (agentvm.policy_patch), as playbooks: an agent's policy and a list of
changes in, the policy its gate would enforce - or a refusal with its code - out. No daemon,
no gate, no disk."""

from __future__ import annotations

import pytest

from agentvm.errors import AgentVMError, PolicyDenied
from agentvm.policy import compile_policy
from agentvm.policy_patch import (AddRules, BudgetChange, LimitsApplied, LimitsChange, LivePolicy, RemoveRule,
                                  SetCredential, SetPaused, ToolChange, apply, check_limits, detail_of, fold,
                                  op_of, parse_patch)
from agentvm.spec.loader import load_agent_text

AGENT = """apiVersion: agentvm/v1
kind: Agent
metadata: {{name: w}}
spec:
  riskTier: {tier}
  command: [worker]
{extra}"""

EGRESS = """  egress:
    allow:
      - {host: pypi.org}
"""
CREDS = """  egress:
    allow:
      - {host: api.example.com}
  credentials:
    - {name: k, env: API_KEY, ref: 'vault:k', hosts: [api.example.com], inject: {header: Authorization, format: 'Bearer {}'}}
"""
TOOLS = "  tools:\n    - {name: fs, command: [fs-mcp], allow: [read_file]}\n"


def agent(extra: str = EGRESS, tier: str = "L2"):
    return compile_policy(load_agent_text(AGENT.format(tier=tier, extra=extra), "w.yaml").spec)


def play(policy, *patches):
    """Each patch folded in order (checked against the policy as it is at that step), then
    applied: -> (the LivePolicy kept, the Policy enforced)."""
    live = LivePolicy()
    for p in patches:
        live = fold(live, p, apply(policy, live))
        apply(policy, live)  # each step must hold, as the daemon checks before it stores one
    return live, apply(policy, live)


def refused(policy, *patches) -> AgentVMError:
    with pytest.raises(AgentVMError) as e:
        play(policy, *patches)
    return e.value


def rules(policy, kind):
    eg = policy.egress
    return [(r.host, r.ports) for r in (eg.allow if kind == "allow" else eg.deny) if not r.id.startswith("doh:")]


# ---------------------------------------------------------------------- egress rules
def test_allow_then_deny_then_remove():
    base = agent()
    live, p = play(base, AddRules("allow", ("example.com:8443",)), AddRules("deny", ("evil.example",)))
    assert ("example.com", (8443,)) in rules(p, "allow") and ("pypi.org", (443,)) in rules(p, "allow")
    assert ("evil.example", ()) in rules(p, "deny")  # a deny without a port: every port
    assert live.to_dict() == {"allow": ["example.com:8443"], "deny": ["evil.example"]}
    rid = next(r.id for r in p.egress.allow if r.host == "pypi.org")
    live, p = play(base, RemoveRule(rid))
    assert ("pypi.org", (443,)) not in rules(p, "allow") and live.removed == (rid,)


def test_the_agent_files_policy_is_untouched():
    base = agent()
    play(base, AddRules("allow", ("example.com",)), SetPaused(True))
    assert base == agent()  # pure: the input policy is never changed


def test_a_bad_rule_is_refused_and_nothing_is_kept():
    e = refused(agent(), AddRules("allow", ("exa mple.com",)))
    assert e.code == "policy.invalid-rule"


def test_removing_a_rule_that_does_not_exist_names_the_real_ones():
    e = refused(agent(), RemoveRule("nope"))
    assert e.code == "policy.no-such-rule" and "its rules" in e.message


def test_the_default_doh_denies_cannot_be_removed():
    base = agent()
    doh = next(r.id for r in base.egress.deny if r.id.startswith("doh:"))
    e = refused(base, RemoveRule(doh))
    assert e.code == "policy.rule-not-removable"


def test_a_live_allow_may_not_widen_past_the_risk_tier():
    with pytest.raises(PolicyDenied, match="risk tier"):
        play(agent(extra="", tier="L1"), AddRules("allow", ("pypi.org",)))


# ---------------------------------------------------------------------- pause, credentials
def test_pause_and_resume_are_kept_as_the_last_word():
    live, _ = play(agent(), SetPaused(True))
    assert live.is_paused and live.to_dict() == {"paused": True}
    live, _ = play(agent(), SetPaused(True), SetPaused(False))
    assert not live.is_paused and live.to_dict() == {"paused": False}


def test_revoke_and_restore_a_credential():
    base = agent(CREDS, tier="L3")
    live, _ = play(base, SetCredential("k", True))
    assert live.revoked_names == ("k",)
    live, _ = play(base, SetCredential("k", True), SetCredential("k", False))
    assert live.revoked_names == () and live.to_dict() == {"revoked": []}
    assert refused(base, SetCredential("other", True)).code == "policy.no-such-credential"


# ---------------------------------------------------------------------- tools
def test_tool_changes_narrow_at_once_and_are_checked():
    base = agent(TOOLS, tier="L3")
    live, p = play(base, ToolChange("deny", "fs__read_file"))
    assert "read_file" in p.tools.servers[0].deny
    assert refused(base, ToolChange("allow", "nosuchserver__x")).code == "tools.invalid-change"
    assert refused(base, ToolChange("allow", "no-separator")).code == "api.bad-request"
    assert refused(agent(), ToolChange("allow", "fs__x")).code == "tools.none-declared"


# ---------------------------------------------------------------------- budget, limits
def test_a_budget_set_live_holds_and_merges():
    live, p = play(agent(), BudgetChange(tokens=1000), BudgetChange(cost=2.5))
    assert p.limits.budget.tokens == 1000 and p.limits.budget.cost == 2.5
    assert live.to_dict() == {"budget": {"tokens": 1000, "cost": 2.5}}


@pytest.mark.parametrize("bad", [dict(tokens=0), dict(tokens=1.5), dict(requests=True), dict(cost=float("nan")),
                                 dict(cost="x")])
def test_a_bad_budget_is_refused(bad):
    assert refused(agent(), BudgetChange(**bad)).code == "budget.invalid"


def test_a_budget_change_needs_something_to_change():
    assert refused(agent(), BudgetChange()).code == "api.bad-request"
    live, _ = play(agent(), BudgetChange(reset=True))  # a reset alone is a change (of the counters)
    assert live.to_dict() == {"budget": {}}


def test_limits_only_ever_lower():
    base = agent()
    live, p = play(base, LimitsApplied((("memory", 64 << 20), ("pids", 10**9))))
    assert p.limits.memory == 64 << 20 and p.limits.pids == base.limits.pids  # never raised
    assert check_limits(LimitsChange(memory="32M", pids=16)) == (32 << 20, 16, None)
    for bad in (LimitsChange(memory="1K"), LimitsChange(pids=2), LimitsChange(cpus=0), LimitsChange(memory="lots")):
        with pytest.raises(AgentVMError) as e:
            check_limits(bad)
        assert e.value.code == "limits.invalid"
    assert refused(base, LimitsChange(memory="64M")).code == "api.bad-request"  # applied by a backend first


# ---------------------------------------------------------------------- the stored form
def test_the_stored_json_round_trips():
    _, _ = play(agent(CREDS, tier="L3"), AddRules("allow", ("a.example",)))
    live, _ = play(agent(CREDS, tier="L3"), AddRules("allow", ("a.example",)), AddRules("deny", ("b.example:22",)),
                   SetCredential("k", True), BudgetChange(tokens=5), SetPaused(True),
                   LimitsApplied((("pids", 32),)))
    again = LivePolicy.from_json(live.to_json())
    assert again == live and apply(agent(CREDS, tier="L3"), again) == apply(agent(CREDS, tier="L3"), live)
    assert LivePolicy.from_json("") == LivePolicy() and LivePolicy().to_dict() == {}


# ---------------------------------------------------------------------- from the wire
@pytest.mark.parametrize("doc,want", [
    ({"op": "allow", "rule": "a.example"}, AddRules("allow", ("a.example",))),
    ({"op": "deny", "rules": ["a", "b"]}, AddRules("deny", ("a", "b"))),
    ({"op": "remove", "rule_id": "r1"}, RemoveRule("r1")),
    ({"op": "pause"}, SetPaused(True)),
    ({"op": "resume"}, SetPaused(False)),
    ({"op": "revoke", "credential": "k"}, SetCredential("k", True)),
    ({"op": "restore", "credential": "k"}, SetCredential("k", False)),
    ({"op": "tools", "action": "deny", "tool": "fs__x"}, ToolChange("deny", "fs__x")),
    ({"op": "budget", "tokens": 5, "reset": True}, BudgetChange(tokens=5, reset=True)),
    ({"op": "limits", "memory": "64M"}, LimitsChange(memory="64M")),
])
def test_parse_patch(doc, want):
    got = parse_patch(doc)
    assert got == want and op_of(got) == doc["op"]
    assert detail_of(got) == {k: v for k, v in doc.items() if k != "op"}


def test_parse_patch_refuses_what_is_not_a_change():
    for doc in ({"op": "show"}, {"op": "explode"}, {}, {"op": "allow"}):
        with pytest.raises(AgentVMError) as e:
            parse_patch(doc)
        assert e.value.code == "api.bad-request"
