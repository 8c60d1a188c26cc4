"""Presets: discovery, resolution (nested, cycles, unknown), merge rules, conflicts."""

from __future__ import annotations

import random

import pytest

from agentvm.errors import SpecError
from agentvm.spec.loader import (
    builtin_preset_dir,
    default_preset_dirs,
    dump_resolved,
    list_presets,
    load_agent_text,
    load_preset,
    validate_file,
)

from _spec_helpers import agent, write_preset


BUILTINS = {"strict", "python", "node", "build", "debug"}


def load(text, d):
    return load_agent_text(text, "a.yaml", preset_dirs=[d])


def test_builtin_presets_exist_and_each_validates_standalone():
    names = {p.stem for p in builtin_preset_dir().glob("*.yaml")}
    assert BUILTINS <= names
    for name in BUILTINS:
        lp = load_preset(builtin_preset_dir() / f"{name}.yaml", preset_dirs=[])
        assert lp.preset.metadata.name == name
        assert lp.preset.description.strip(), f"{name} has no description"
        body = lp.resolved.spec
        assert not body.egress.allow and not body.credentials, "egress/credentials stay empty for now"


def test_builtin_preset_values(tmp_path):
    s = load(agent("spec:\n  presets: [strict]\n"), tmp_path).spec.spec
    assert (s.limits.memory, s.limits.pids, s.limits.cpus, s.limits.timeout, s.limits.tmp) == (
        256 * 1024**2, 128, 1.0, 600.0, 64 * 1024**2)
    p = load(agent("spec:\n  presets: [python]\n"), tmp_path).spec.spec
    assert p.env == {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PIP_NO_INPUT": "1"}
    assert p.limits.memory == 1024**3
    n = load(agent("spec:\n  presets: [node]\n"), tmp_path).spec.spec
    assert n.env["NODE_OPTIONS"] == "--max-old-space-size=768"
    assert n.env["NPM_CONFIG_UPDATE_NOTIFIER"] == "false"
    b = load(agent("spec:\n  presets: [build]\n"), tmp_path).spec.spec
    assert (b.limits.pids, b.limits.cpus, b.limits.memory, b.limits.disk, b.limits.tmp) == (
        1024, 2.0, 2 * 1024**3, 4 * 1024**3, 1024**3)
    d = load(agent("spec:\n  presets: [debug]\n"), tmp_path).spec.spec
    assert d.risk_tier.value == "L4" and d.security.allow_ptrace is True


def test_later_preset_wins_and_agent_wins_over_all(tmp_path):
    write_preset(tmp_path, "a", "limits:\n  memory: 1G\n  pids: 100\nenv:\n  A: a\n")
    write_preset(tmp_path, "b", "limits:\n  memory: 2G\nenv:\n  B: b\n")
    la = load(agent("spec:\n  presets: [a, b]\n  limits:\n    pids: 50\n"), tmp_path)
    s = la.spec.spec
    assert s.limits.memory == 2 * 1024**3  # b after a
    assert s.limits.pids == 50  # the agent last
    assert s.env == {"A": "a", "B": "b"}  # dicts merge
    assert la.presets == ["a", "b"]
    assert la.spec.spec.presets == ["a", "b"]
    la2 = load(agent("spec:\n  presets: [b, a]\n"), tmp_path)
    assert la2.spec.spec.limits.memory == 1024**3


def test_origins_point_into_the_winning_file(tmp_path):
    pa = write_preset(tmp_path, "a", "limits:\n  memory: 1G\n  pids: 100\n")
    la = load(agent("spec:\n  presets: [a]\n  limits:\n    pids: 50\n"), tmp_path)
    assert la.origins["spec.limits.memory"] == (str(pa), 8)
    assert la.origins["spec.limits.pids"] == ("a.yaml", 8)


def test_error_in_preset_value_is_located_in_the_preset_file(tmp_path):
    pa = write_preset(tmp_path, "a", "limits:\n  memory: lots\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [a]\n"), tmp_path)
    p = ei.value.problems[0]
    assert (p.file, p.line, p.field) == (str(pa), 8, "spec.limits.memory")


def test_merge_is_deterministic(tmp_path):
    write_preset(tmp_path, "a", "limits: {memory: 1G}\nmounts:\n  - {host: /a, path: /x}\nenv: {A: '1'}\n")
    write_preset(tmp_path, "b", "limits: {memory: 2G}\nmounts:\n  - {host: /b, path: /x}\nenv: {B: '1'}\n")
    write_preset(tmp_path, "c", "mounts:\n  - {host: /c, path: /y}\nenv: {A: '2'}\n")
    text = agent("spec:\n  presets: [a, b, c]\n")
    first = load(text, tmp_path)
    for _ in range(5):
        again = load(text, tmp_path)
        assert dump_resolved(again) == dump_resolved(first)
        assert again.conflicts == first.conflicts
        assert again.origins == first.origins


def test_order_matters_exactly_as_listed(tmp_path):
    names = [f"p{i}" for i in range(6)]
    for i, n in enumerate(names):
        write_preset(tmp_path, n, f"limits:\n  pids: {100 + i}\n")
    rng = random.Random(7)
    for _ in range(5):
        order = names[:]
        rng.shuffle(order)
        la = load(agent(f"spec:\n  presets: [{', '.join(order)}]\n"), tmp_path)
        assert la.presets == order
        assert la.spec.spec.limits.pids == 100 + int(order[-1][1:])


def test_mounts_merge_by_sandbox_path(tmp_path):
    write_preset(tmp_path, "a", "mounts:\n  - {host: /a, path: /x}\n  - {host: /k, path: /keep}\n")
    la = load(agent("spec:\n  riskTier: L1\n  presets: [a]\n  mounts:\n"
                    "    - {host: /b, path: /x/, mode: rw}\n    - {host: /n, path: /new}\n"), tmp_path)
    ms = [(m.host, m.path, m.mode) for m in la.spec.spec.mounts]
    assert ms == [("/b", "/x", "rw"), ("/k", "/keep", "ro"), ("/n", "/new", "ro")]
    ov = [c for c in la.conflicts if c.field == "spec.mounts[path=/x]"]
    assert ov and ov[0].kind == "override"


def test_tools_and_credentials_merge_by_name(tmp_path):
    write_preset(tmp_path, "a", "tools:\n  - {name: git, command: [git-mcp], allow: [log]}\n"
                                "  - {name: fs, command: [fs-mcp], allow: [read_*]}\n"
                                "credentials:\n  - {name: gh, env: GH, ref: 'env:GH', hosts: [github.com], inject: {header: Authorization}}\n")
    la = load(agent("spec:\n  riskTier: L3\n  presets: [a]\n  tools:\n    - {name: git, command: [git-mcp], allow: [log, diff]}\n"
                    "  credentials:\n    - {name: gh, env: GH2, ref: 'env:GH', hosts: [api.github.com], inject: {header: Authorization}}\n"), tmp_path)
    assert [(t.name, t.allow) for t in la.spec.spec.tools] == [("git", ["log", "diff"]), ("fs", ["read_*"])]
    assert [(c.name, c.env) for c in la.spec.spec.credentials] == [("gh", "GH2")]


def test_egress_lists_concatenate_and_dedupe(tmp_path):
    write_preset(tmp_path, "a", "egress:\n  allow:\n    - {host: pypi.org}\n    - {host: a.example}\n"
                                "  deny:\n    - {host: evil.example}\n")
    write_preset(tmp_path, "b", "egress:\n  allow:\n    - {host: pypi.org}\n    - {host: b.example}\n")
    la = load(agent("spec:\n  presets: [a, b]\n  egress:\n    allow:\n    - {host: c.example}\n"
                    "    deny:\n    - {host: evil.example}\n"), tmp_path)
    assert [r.host for r in la.spec.spec.egress.allow] == ["pypi.org", "a.example", "b.example", "c.example"]
    assert [r.host for r in la.spec.spec.egress.deny] == ["evil.example"]
    assert not [c for c in la.conflicts if "egress" in c.field]


def test_command_and_other_lists_are_replaced(tmp_path):
    write_preset(tmp_path, "a", "command: [a, b, c]\nsecurity:\n  localPorts: [80, 81]\n")
    la = load(agent("spec:\n  presets: [a]\n  command: [x]\n  security:\n    localPorts: [90]\n"), tmp_path)
    assert la.spec.spec.command == ["x"]
    assert la.spec.spec.security.local_ports == [90]
    kinds = {c.field: c.kind for c in la.conflicts}
    assert kinds == {"spec.command": "override", "spec.security.localPorts": "override"}


def test_list_like_environment_variables_are_appended_not_replaced(tmp_path):
    write_preset(tmp_path, "a", "env:\n  NODE_OPTIONS: --max-old-space-size=768\n  PYTHONPATH: /opt/a\n  X: a\n")
    la = load(agent("spec:\n  presets: [a]\n  env:\n    NODE_OPTIONS: --enable-source-maps\n    PYTHONPATH: /opt/b\n"
                    "    X: b\n"), tmp_path)
    env = la.spec.spec.env
    assert env["NODE_OPTIONS"] == "--max-old-space-size=768 --enable-source-maps"
    assert env["PYTHONPATH"] == "/opt/a:/opt/b"
    assert env["X"] == "b"  # everything else: the later one wins (an override, recorded)
    assert {c.field for c in la.conflicts} == {"spec.env.X"}
    # options with arguments stay whole: two --require preloads both survive
    write_preset(tmp_path, "r", "env:\n  NODE_OPTIONS: --require /r/a.js\n")
    la = load(agent("spec:\n  presets: [r]\n  env:\n    NODE_OPTIONS: --require /r/b.js\n"), tmp_path)
    assert la.spec.spec.env["NODE_OPTIONS"] == "--require /r/a.js --require /r/b.js"


def test_conflict_between_presets_vs_override_by_agent(tmp_path):
    pa = write_preset(tmp_path, "a", "limits:\n  memory: 1G\n  pids: 64\n")
    pb = write_preset(tmp_path, "b", "limits:\n  memory: 2G\n  pids: 64\n")
    la = load(agent("spec:\n  presets: [a, b]\n  limits:\n    memory: 3G\n"), tmp_path)
    by = [(c.field, c.kind) for c in la.conflicts]
    assert by == [("spec.limits.memory", "conflict"), ("spec.limits.memory", "override")]
    c = la.conflicts[0]
    assert (c.winner.file, c.winner.line, c.winner.value) == (str(pb), 8, "'2G'")
    assert (c.loser.file, c.loser.line, c.loser.value) == (str(pa), 8, "'1G'")
    o = la.conflicts[1]
    assert o.winner.file == "a.yaml" and o.winner.line == 8 and o.loser.file == str(pb)
    # Same value set twice is not a conflict (pids: 64 in both).
    assert not [c for c in la.conflicts if c.field == "spec.limits.pids"]


def test_conflicts_do_not_fail_loading_but_strict_validate_does(tmp_path):
    write_preset(tmp_path, "a", "limits:\n  memory: 1G\n")
    write_preset(tmp_path, "b", "limits:\n  memory: 2G\n")
    f = tmp_path / "agent.yaml"
    f.write_text(agent("spec:\n  presets: [a, b]\n"))
    rep = validate_file(f, preset_dirs=[tmp_path])
    assert rep.ok and rep.conflicts[0].kind == "conflict"
    strict = validate_file(f, preset_dirs=[tmp_path], strict=True)
    assert not strict.ok
    assert strict.problems[0].field == "spec.limits.memory"
    assert "--strict" in strict.problems[0].message
    # An override alone does not fail --strict.
    f.write_text(agent("spec:\n  presets: [a]\n  limits:\n    memory: 3G\n"))
    assert validate_file(f, preset_dirs=[tmp_path], strict=True).ok


def test_nested_presets_depth_first_each_once(tmp_path):
    write_preset(tmp_path, "base", "env: {ORDER: base}\nlimits: {pids: 10}\n")
    write_preset(tmp_path, "mid", "presets: [base]\nenv: {ORDER: mid}\n")
    write_preset(tmp_path, "other", "presets: [base]\nlimits: {nofile: 128}\n")
    la = load(agent("spec:\n  presets: [mid, other]\n"), tmp_path)
    assert la.presets == ["base", "mid", "other"]
    assert la.spec.spec.env == {"ORDER": "mid"}
    assert la.spec.spec.limits.pids == 10 and la.spec.spec.limits.nofile == 128
    # The agent keeps only the names it listed itself.
    assert la.spec.spec.presets == ["mid", "other"]
    # A preset overriding what it includes is an override, not a conflict.
    assert [(c.field, c.kind) for c in la.conflicts] == [("spec.env.ORDER", "override")]


def test_cycle_is_an_error_naming_the_cycle(tmp_path):
    write_preset(tmp_path, "a", "presets: [b]\n")
    write_preset(tmp_path, "b", "presets: [c]\n")
    pc = write_preset(tmp_path, "c", "presets: [a]\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [a]\n"), tmp_path)
    p = ei.value.problems[0]
    assert "a -> b -> c -> a" in p.message
    assert (p.file, p.line) == (str(pc), 7)


def test_self_include_is_a_cycle(tmp_path):
    write_preset(tmp_path, "a", "presets: [a]\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [a]\n"), tmp_path)
    assert "a -> a" in ei.value.problems[0].message


def test_unknown_preset_lists_available_and_reference_line(tmp_path):
    write_preset(tmp_path, "mine")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets:\n    - python\n    - pyhton\n"), tmp_path)
    p = ei.value.problems[0]
    assert (p.file, p.line) == ("a.yaml", 8)
    assert "unknown preset 'pyhton'" in p.message
    assert "did you mean 'python'" in p.message
    assert "mine" in p.message and "strict" in p.message


def test_unknown_nested_preset_is_located_in_the_preset(tmp_path):
    pa = write_preset(tmp_path, "a", "presets: [ghost]\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [a]\n"), tmp_path)
    p = ei.value.problems[0]
    assert p.file == str(pa) and p.line == 7 and "ghost" in p.message


def test_user_preset_shadows_builtin(tmp_path):
    write_preset(tmp_path, "python", "env: {MINE: '1'}\n", description="my python")
    la = load(agent("spec:\n  presets: [python]\n"), tmp_path)
    assert la.spec.spec.env == {"MINE": "1"}
    infos = {i.name: i for i in list_presets([tmp_path])}
    assert infos["python"].shadows_builtin and not infos["python"].builtin
    assert infos["python"].description == "my python"
    assert infos["strict"].builtin and not infos["strict"].shadows_builtin
    assert BUILTINS <= set(infos)


def test_first_user_dir_wins(tmp_path):
    d1, d2 = tmp_path / "one", tmp_path / "two"
    write_preset(d1, "x", "env: {WHO: one}\n")
    write_preset(d2, "x", "env: {WHO: two}\n")
    la = load_agent_text(agent("spec:\n  presets: [x]\n"), "a.yaml", preset_dirs=[d1, d2])
    assert la.spec.spec.env == {"WHO": "one"}


def test_preset_name_must_match_file_name(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("apiVersion: agentvm/v1\nkind: Preset\nmetadata:\n  name: y\nspec: {}\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [x]\n"), tmp_path)
    assert ei.value.problems[0].field == "metadata.name" and ei.value.problems[0].line == 4


def test_broken_user_preset_is_an_error_when_used_and_listed_as_invalid(tmp_path):
    (tmp_path / "bad.yaml").write_text("apiVersion: agentvm/v1\nkind: Preset\nmetadata: {name: bad\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [bad]\n"), tmp_path)
    assert ei.value.problems[0].file == str(tmp_path / "bad.yaml")
    info = {i.name: i for i in list_presets([tmp_path])}["bad"]
    assert info.error and "invalid YAML" in info.error


def test_preset_with_unknown_field_fails_the_agent(tmp_path):
    pa = write_preset(tmp_path, "a", "limits:\n  memroy: 1G\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [a]\n"), tmp_path)
    p = ei.value.problems[0]
    assert (p.file, p.line, p.field) == (str(pa), 8, "spec.limits.memroy")


def test_env_var_defaults_for_preset_dirs(tmp_path, monkeypatch):
    d1, home = tmp_path / "p1", tmp_path / "home"
    monkeypatch.setenv("AGENTVM_PRESET_PATH", f"{d1}::{tmp_path / 'missing'}")
    monkeypatch.setenv("AGENTVM_HOME", str(home))
    assert default_preset_dirs() == [d1, tmp_path / "missing", home / "presets"]
    write_preset(home / "presets", "fromhome", "env: {H: '1'}\n")
    la = load_agent_text(agent("spec:\n  presets: [fromhome]\n"), "a.yaml")
    assert la.spec.spec.env == {"H": "1"}


def test_tier_from_preset_is_checked_after_merge(tmp_path):
    write_preset(tmp_path, "ro-only", "riskTier: L0\n")
    with pytest.raises(SpecError) as ei:
        load(agent("spec:\n  presets: [ro-only]\n  mounts:\n    - {host: /a, path: /b, mode: rw}\n"), tmp_path)
    assert ei.value.problems[0].field == "spec.mounts[0].mode"
    assert ei.value.problems[0].file == "a.yaml"


def test_preset_cannot_be_validated_with_invalid_nested(tmp_path):
    p = write_preset(tmp_path, "a", "presets: [b]\n")
    write_preset(tmp_path, "b", "limits: {pids: 1}\n")
    rep = validate_file(p, preset_dirs=[tmp_path])
    assert not rep.ok and rep.kind == "Preset"
    assert rep.problems[0].field == "spec.limits.pids" and rep.problems[0].file == str(tmp_path / "b.yaml")
