"""The shipped examples and the reference doc agree with the code."""

from __future__ import annotations

import re
from pathlib import Path

from agentvm.spec.loader import load_agent
from agentvm.spec.models import TIER_CEILINGS

ROOT = Path(__file__).resolve().parents[2]


def test_hello_agent_example():
    la = load_agent(ROOT / "examples" / "hello-agent.yaml", preset_dirs=[])
    s = la.spec.spec
    assert la.presets == ["python"]
    assert s.lifecycle.value == "ephemeral"
    assert s.command[0] == "python3" and "/workspace/" in s.command[-1] and "print(" in s.command[-1]
    assert s.limits.memory == 256 * 1024**2 and s.limits.timeout == 30
    assert s.env["PYTHONUNBUFFERED"] == "1"


def test_worker_agent_example():
    la = load_agent(ROOT / "examples" / "worker-agent.yaml", preset_dirs=[])
    s = la.spec.spec
    assert s.lifecycle.value == "persistent"
    assert [(m.host, m.path, m.mode) for m in s.mounts] == [("/usr/share/doc", "/docs", "ro")]


def test_reference_tier_table_matches_tier_ceilings():
    doc = (ROOT / "docs" / "policy-reference.md").read_text()
    rows = dict(re.findall(r"^\| (L[0-5]) \| ((?:(?:yes|no) \| ){4}(?:yes|no)) \|$", doc, re.M))
    keys = ["rw_mounts", "egress", "credentials", "ptrace", "tools"]
    assert set(rows) == set(TIER_CEILINGS)
    for tier, ceil in TIER_CEILINGS.items():
        assert rows[tier].split(" | ") == ["yes" if ceil[k] else "no" for k in keys], tier


def test_reference_documents_every_spec_field():
    from agentvm.spec.models import AgentSpecBody, Limits, Security

    doc = (ROOT / "docs" / "policy-reference.md").read_text()
    for model in (AgentSpecBody, Limits, Security):
        for name, f in model.model_fields.items():
            assert f"| `{f.alias or name}` |" in doc, f"{model.__name__}.{f.alias or name} is not documented"


def test_tools_agent_example():
    from agentvm.policy import compile_policy
    from agentvm.tools.policy import decide

    la = load_agent(ROOT / "examples" / "tools-agent.yaml", preset_dirs=[])
    p = compile_policy(la.spec)
    assert [s.name for s in p.tools.servers] == ["notes"]
    assert decide("notes", "read_note", {"name": "welcome"}, p.tools).verdict == "allow"
    assert decide("notes", "read_note", {"name": "../x"}, p.tools).rule_id == "tools:argument:name"
    assert decide("notes", "delete_note", {"name": "welcome"}, p.tools).rule_id == "tools:deny:notes:delete_*"
    assert decide("notes", "write_note", {}, p.tools).rule_id == "tools:not-allowed"
    assert p.credentials == () and p.mounts == ()  # the server's grant of the SDK is the server's own
    assert "/opt/mcp-sdk" in p.tools.server("notes").sandbox_spec


def test_tools_github_agent_example():
    from agentvm.policy import compile_policy
    from agentvm.tools.policy import decide

    la = load_agent(ROOT / "examples" / "tools-github-agent.yaml", preset_dirs=[])
    assert la.presets == ["python", "github-readonly"]
    p = compile_policy(la.spec)
    assert [s.name for s in p.tools.servers] == ["github"]
    assert decide("github", "get_issue", {}, p.tools).verdict == "allow"
    assert decide("github", "create_issue", {}, p.tools).rule_id == "tools:not-allowed"
    assert decide("github", "get_secret_scanning_alert", {}, p.tools).verdict == "deny"
    assert [r.id for r in p.egress.allow if r.ask] == ["charges"]
    gh = p.tools.server("github")
    assert "vault:github-token" in gh.sandbox_spec and p.credentials == ()  # the token is the server's, not the agent's
