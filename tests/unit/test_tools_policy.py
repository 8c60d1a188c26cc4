"""The tool policy: the agent file's `tools` section, validated with file:line errors, and the
one pure decide() (deny wins, no match denies, bad arguments deny, the tier's approvals)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentvm.errors import SpecError
from agentvm.policy import compile_policy
from agentvm.spec.loader import load_agent_text
from agentvm.tools import policy as tp

from _spec_helpers import agent


def tools_policy(body: str, tier: str = "L3"):
    text = agent(f"spec:\n  riskTier: {tier}\n" + body)
    return compile_policy(load_agent_text(text, "a.yaml", preset_dirs=[]).spec).tools


BASE = """\
  tools:
    - name: gh
      command: [gh-mcp]
      allow: [get_*, list_issues, search]
      approve: [create_issue]
      deny: [get_secret]
      risk: {"get_*": read, list_issues: read, search: read, delete_repo: destructive}
      arguments:
        get_file: {path: {path: /repo, required: true}}
        search: {q: {maxLength: 20, pattern: "[a-z ]+"}, order: {enum: [asc, desc]}}
      limits: {callsPerMinute: 5, timeout: 2s, maxArguments: 1K}
"""


def test_deny_wins_no_match_denies_and_approve_asks():
    p = tools_policy(BASE)
    d = tp.decide
    assert d("gh", "get_issue", {}, p).verdict == "allow"
    assert d("gh", "get_secret", {}, p).rule_id == "tools:deny:gh:get_secret"
    assert d("gh", "delete_repo", {}, p).rule_id == "tools:not-allowed"
    assert d("gh", "create_issue", {}, p).verdict == "ask"
    assert d("nope", "get_issue", {}, p).rule_id == "tools:unknown-server"
    assert d("gh", "get issue", {}, p).rule_id == "tools:invalid-name"
    assert d("gh", 7, {}, p).verdict == "deny"  # not even a string


def test_hidden_means_denied_visible_means_allowed_or_approved():
    p = tools_policy(BASE)
    sp = p.server("gh")
    for tool in ("get_issue", "list_issues", "create_issue"):
        assert tp.visible(sp, tool)
    for tool in ("get_secret", "delete_repo", "", "x" * 200, "../x y"):
        assert not tp.visible(sp, tool)
        assert tp.decide("gh", tool, {}, p).verdict == "deny"


@pytest.mark.parametrize("args, rule", [
    ({"path": "/repo/a/b"}, None),
    ({"path": "/repo"}, None),
    ({"path": "/repo/../etc/passwd"}, "tools:argument:path"),
    ({"path": "/repository"}, "tools:argument:path"),
    ({"path": "relative"}, "tools:argument:path"),
    ({"path": "/repo/\x00"}, "tools:argument:path"),
    ({"path": ["/repo"]}, "tools:argument:path"),
    ({}, "tools:argument:path"),  # required
])
def test_path_constraints(args, rule):
    d = tp.decide("gh", "get_file", args, tools_policy(BASE))
    assert (d.rule_id if d.verdict == "deny" else None) == rule, d


@pytest.mark.parametrize("args, ok", [
    ({"q": "find me"}, True),
    ({"q": "FIND"}, False),
    ({"q": "a" * 21}, False),
    ({"q": 5}, False),
    ({"q": "ok", "order": "asc"}, True),
    ({"q": "ok", "order": "sideways"}, False),
    ({"q": "ok", "order": True}, False),
    ({"q": "x" * 2000}, False),  # over maxArguments too
])
def test_pattern_enum_length_and_size(args, ok):
    assert (tp.decide("gh", "search", args, tools_policy(BASE)).verdict == "allow") is ok


def test_arguments_must_be_an_object():
    assert tp.decide("gh", "search", ["q"], tools_policy(BASE)).rule_id == "tools:bad-arguments"


def test_the_tier_sets_which_classes_always_need_a_human():
    body = BASE.replace("approve: [create_issue]", "approve: []").replace("allow: [get_*, list_issues, search]",
                                                                          "allow: [get_*, list_issues, search, create_issue]")
    assert tp.decide("gh", "create_issue", {}, tools_policy(body, "L2")).rule_id == "tools:tier:write"
    assert tp.decide("gh", "create_issue", {}, tools_policy(body, "L3")).verdict == "allow"
    destructive = body.replace("create_issue]", "create_issue, delete_repo]")
    for tier in ("L3", "L4"):
        assert tp.decide("gh", "delete_repo", {}, tools_policy(destructive, tier)).rule_id == "tools:tier:destructive"
    assert tp.decide("gh", "delete_repo", {}, tools_policy(destructive, "L5")).verdict == "allow"


def test_server_hints_are_never_consulted_only_the_agent_file():
    # a tool with no risk entry is "write", whatever the server would annotate it with
    sp = tools_policy(BASE).server("gh")
    assert tp.risk_of(sp, "get_anything") == "read" and tp.risk_of(sp, "unlisted") == "write"


def test_an_exception_denies():
    class Boom:
        servers = property(lambda self: 1 / 0)

    assert tp.decide("gh", "get_issue", {}, Boom()).rule_id == "tools:internal-error"


@settings(max_examples=300, deadline=None)
@given(tool=st.text(max_size=40), args=st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=30), lambda c: st.lists(c, max_size=3), max_leaves=5),
    max_size=4))
def test_decide_never_raises_and_never_allows_what_is_not_listed(tool, args):
    p = tools_policy(BASE)
    d = tp.decide("gh", tool, args, p)
    assert d.verdict in ("allow", "deny", "ask")
    if d.verdict != "deny":
        assert tp.visible(p.server("gh"), tool)


def test_live_changes_narrow_and_widen_in_order():
    p = tools_policy(BASE)
    p2 = tp.apply_live(p, [{"action": "deny", "server": "gh", "tool": "get_*"}])
    assert tp.decide("gh", "get_issue", {}, p2).rule_id == "tools:deny:gh:get_*"
    p3 = tp.apply_live(p, [{"action": "approve", "server": "gh", "tool": "search"}])
    assert tp.decide("gh", "search", {"q": "x"}, p3).verdict == "ask"
    p4 = tp.apply_live(p2, [{"action": "allow", "server": "gh", "tool": "get_*"}])
    assert tp.decide("gh", "get_issue", {}, p4).verdict == "allow"
    for bad in ({"action": "grant", "server": "gh", "tool": "x"}, {"action": "allow", "server": "nope", "tool": "x"},
                {"action": "allow", "server": "gh", "tool": "a b"}):
        with pytest.raises(ValueError):
            tp.apply_live(p, [bad])


@pytest.mark.parametrize("body, where", [
    ("  tools:\n    - {name: gh, allow: [x]}\n", "either command"),
    ("  tools:\n    - {name: gh, command: [x], url: 'https://a.test/mcp', allow: [x]}\n", "either command"),
    ("  tools:\n    - {name: gh, command: [x]}\n", "allow or approve"),
    ("  tools:\n    - {name: GH, command: [x], allow: [x]}\n", "tool server name"),
    ("  tools:\n    - {name: gh, command: [x], allow: ['a b']}\n", "not a tool name"),
    ("  tools:\n    - {name: gh, command: [x], allow: [x], arguments: {x: {p: {}}}}\n", "needs path, pattern"),
    ("  tools:\n    - {name: gh, command: [x], allow: [x], arguments: {x: {p: {pattern: '('}}}}\n", "regular expression"),
    ("  tools:\n    - {name: gh, url: 'http://a.test/mcp', allow: [x]}\n", "https"),
    ("  tools:\n    - {name: gh, url: 'https://a.test/mcp', allow: [x], env: {A: b}}\n", "local servers"),
    ("  tools:\n    - {name: gh, url: 'https://a.test/mcp', allow: [x], credentials: [{name: k, env: K, ref: 'vault:k', "
     "hosts: [a.test], sigv4: {accessKeyId: AKIDX}}]}\n", "inject.header"),
    ("  egress:\n    deny: [{host: a.test, action: ask}]\n", "allow rules"),
    ("  approvals: {webhook: 'http://evil.test/hook'}\n", "webhook"),
])
def test_bad_tool_sections_are_refused_with_file_and_line(body, where):
    with pytest.raises(SpecError) as e:
        load_agent_text(agent("spec:\n  riskTier: L3\n" + body), "a.yaml", preset_dirs=[])
    text = str(e.value) + " ".join(str(p) for p in e.value.problems)
    assert where in text and "a.yaml:" in text


def test_two_servers_of_one_name_are_refused():
    from agentvm.errors import ConfigError

    body = "  tools:\n    - {name: gh, command: [x], allow: [x]}\n    - {name: gh, command: [y], allow: [y]}\n"
    with pytest.raises((ConfigError, SpecError)):
        tools_policy(body)


def test_tools_need_a_tier_that_allows_them_and_a_route_through_the_gate():
    from agentvm.errors import ConfigError

    with pytest.raises(SpecError, match="tools need risk tier"):
        load_agent_text(agent("spec:\n  riskTier: L1\n  tools:\n    - {name: gh, command: [x], allow: [x]}\n"),
                        "a.yaml", preset_dirs=[])
    with pytest.raises(ConfigError, match="network: gate"):
        tools_policy("  network: none\n  tools:\n    - {name: gh, command: [x], allow: [x]}\n")


def test_the_tool_servers_sandbox_holds_its_own_grants_and_none_of_the_agents():
    import json

    p = tools_policy("  mounts: [{host: /srv/agent-data, path: /data}]\n" + BASE.replace(
        "      limits:", "      mounts: [{host: /srv/gh, path: /repo}]\n      env: {GH_HOST: github.test}\n      limits:"))
    doc = json.loads(p.server("gh").sandbox_spec)
    assert doc["spec"]["command"] == ["gh-mcp"] and doc["spec"]["workspace"] == {"enabled": False}
    assert [m["host"] for m in doc["spec"]["mounts"]] == ["/srv/gh"]
    assert doc["spec"]["env"] == {"GH_HOST": "github.test"} and "credentials" not in doc["spec"]
    assert doc["metadata"]["name"].endswith("-tool-gh") and len(doc["metadata"]["name"]) <= 63
    # two agents whose names start the same never share a tool server's identity
    from agentvm.tools.policy import _sandbox_spec

    srv = type("S", (), {"command": ["x"], "memory": 1 << 29, "mounts": [], "env": {}, "credentials": [], "name": "gh",
                         "egress": type("E", (), {"allow": [], "deny": [], "hosts": {}})()})()
    a = json.loads(_sandbox_spec("research-assistant-team-alpha", "L3", srv))["metadata"]["name"]
    b = json.loads(_sandbox_spec("research-assistant-team-beta", "L3", srv))["metadata"]["name"]
    assert a != b and len(a) <= 63


# ---------------------------------------------------------------------------- names in one normal form
CASES = """\
  tools:
    - name: notes
      command: [notes-mcp]
      allow: ["*"]
      approve: ["write_*"]
      deny: ["*admin*"]
      risk: {"*delete*": destructive, "read_*": read}
      arguments:
        "read_*": {path: {path: /srv/notes, required: true}}
"""


@pytest.mark.parametrize("tool", ["ADMIN_RESET", "Admin_Reset", "reset_ADMIN", "aDmIn"])
def test_a_deny_glob_denies_every_case_of_the_name(tool):
    """Issue 35: with allow ["*"] and deny ["*admin*"], ADMIN_RESET was listed and ran."""
    p = tools_policy(CASES)
    sp = p.server("notes")
    assert not tp.visible(sp, tool)
    assert tp.decide("notes", tool, {}, p).rule_id == "tools:deny:notes:*admin*"


@pytest.mark.parametrize("tool", ["WRITE_NOTE", "Write_Note", "write_NOTE"])
def test_an_approve_glob_holds_every_case_of_the_name(tool):
    assert tp.decide("notes", tool, {}, tools_policy(CASES)).rule_id == "tools:approve:notes:write_*"


def test_risk_classes_and_argument_rules_apply_to_every_case_of_the_name():
    p = tools_policy(CASES, tier="L3")
    assert tp.decide("notes", "DELETE_ALL", {}, p).rule_id == "tools:tier:destructive"
    assert tp.decide("notes", "READ_NOTE", {}, p).rule_id == "tools:argument:path"
    assert tp.decide("notes", "READ_NOTE", {"path": "/etc/shadow"}, p).rule_id == "tools:argument:path"
    assert tp.decide("notes", "READ_NOTE", {"path": "/srv/notes/a"}, p).verdict == "allow"


def test_server_names_and_live_changes_are_compared_in_normal_form():
    p = tools_policy(CASES)
    assert tp.decide("NOTES", "ADMIN", {}, p).rule_id == "tools:deny:notes:*admin*"
    assert tp.decide("\uff4e\uff4f\uff54\uff45\uff53", "list", {}, p).verdict == "allow"  # fullwidth "notes"
    p2 = tp.apply_live(p, [{"action": "deny", "server": "Notes", "tool": "list_*"}])
    assert tp.decide("notes", "LIST_ALL", {}, p2).rule_id == "tools:deny:notes:list_*"
    # a live allow lifts a live deny of the same name, whatever its case
    p3 = tp.apply_live(p2, [{"action": "allow", "server": "notes", "tool": "LIST_*"}])
    assert tp.decide("notes", "list_all", {}, p3).verdict == "allow"
    # a grant never lifts a deny, in any case
    p4 = tp.apply_live(p, [{"action": "grant", "server": "NOTES", "tool": "ADMIN"}], grants=True)
    assert tp.decide("notes", "admin", {}, p4).verdict == "deny"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-.0123456789", min_size=1, max_size=20))
def test_a_decision_depends_only_on_the_normal_form_of_the_name(tool):
    p = tools_policy(CASES)
    want = tp.decide("notes", tool.lower(), {"path": "/srv/notes/x"}, p)
    for variant in (tool, tool.upper(), tool.swapcase()):
        got = tp.decide("notes", variant, {"path": "/srv/notes/x"}, p)
        assert (got.verdict, got.rule_id) == (want.verdict, want.rule_id)


def test_one_normal_form_helper():
    from agentvm import names

    assert names.norm("ＡＤＭＩＮ") == names.norm("admin") == "admin"
    assert names.norm(names.norm("ǅ")) == names.norm("ǅ")
    assert names.match("ADMIN_RESET", "*admin*") and not names.match("reset", "*admin*")
    assert names.first_match(["x", "*Admin*"], "admin_reset") == "*Admin*"


@pytest.mark.parametrize("risk", ['{"*": read, "rm_*": destructive}', '{"rm_*": destructive, "*": read}'])
def test_the_most_severe_matching_risk_class_wins_whatever_the_order(risk):
    """A stored copy of the agent file (key-sorted YAML: the daemon's, the fleet's) must mean
    what the file means: the class is the most severe match, not the first."""
    p = tools_policy(f'  tools:\n    - name: n\n      command: [x]\n      allow: ["*"]\n      risk: {risk}\n', tier="L3")
    assert tp.decide("n", "rm_all", {}, p).rule_id == "tools:tier:destructive"
    assert tp.decide("n", "list", {}, p).verdict == "allow"


# ---------------------------------------------------------------------------- folding narrows, never widens
WIDE = """\
  tools:
    - name: gh
      command: [gh-mcp]
      allow: ["get_*", "read_note"]
      approve: ["write_*"]
      deny: ["*secret*"]
      prompts: ["summary"]
"""


@pytest.mark.parametrize("tool", ["GET_ADMIN_TOKEN", "Get_issue", "READ_NOTE", "WRITE_NOTE", "Write_x"])
def test_an_allow_or_approve_glob_lets_through_only_its_exact_spelling(tool):
    """Case folding widened allow: ``get_*`` allowed (and listed) ``GET_ADMIN_TOKEN``, another
    tool on a case-sensitive server. What lets a name through is compared exactly."""
    p = tools_policy(WIDE)
    sp = p.server("gh")
    assert not tp.visible(sp, tool)
    assert tp.decide("gh", tool, {}, p).rule_id == "tools:not-allowed"
    assert tp.visible(sp, tool.lower()) and tp.decide("gh", tool.lower(), {}, p).verdict in ("allow", "ask")
    assert not tp.prompt_allowed(sp, "SUMMARY") and tp.prompt_allowed(sp, "summary")


@pytest.mark.parametrize("tool", ["GET_SECRET", "get_Secret", "get_\uff53ecret"])
def test_a_deny_glob_still_names_every_spelling(tool):
    p = tools_policy(WIDE.replace('["get_*", "read_note"]', '["*"]'))
    assert tp.decide("gh", tool, {}, p).verdict == "deny"
    assert not tp.visible(p.server("gh"), tool)


def test_an_approve_glob_still_holds_every_spelling_of_an_allowed_tool():
    p = tools_policy(WIDE.replace('["get_*", "read_note"]', '["*"]'))
    assert tp.decide("gh", "WRITE_NOTE", {}, p).rule_id == "tools:approve:gh:write_*"


@pytest.mark.parametrize("glob", ["read\uff0a", "\uff52ead_*", "get_\u0131ssue", "r\u00e9ad"])
@pytest.mark.parametrize("field", ["allow", "deny", "approve", "prompts", "risk", "arguments"])
def test_a_tool_glob_with_a_non_ascii_character_is_refused_where_it_is_written(glob, field):
    """A fullwidth ``read＊`` is ``read*`` under NFKC, while ``plan`` shows it as written:
    tool globs are ASCII, refused at validation with the field and the character named."""
    value = {"risk": f'{{"{glob}": read}}', "arguments": f'{{"{glob}": {{a: {{required: true}}}}}}'}.get(
        field, f'["x", "{glob}"]')
    base = "" if field == "allow" else "      allow: [x]\n"
    body = f"  tools:\n    - name: gh\n      command: [gh-mcp]\n{base}      {field}: {value}\n"
    with pytest.raises(SpecError) as e:
        tools_policy(body)
    msg = str(e.value)
    assert f"spec.tools[0].{field}" in msg and "non-ASCII" in msg, msg
