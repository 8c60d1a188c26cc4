"""agentvm.spec.loader: parsing with lines, validation and error locations."""

from __future__ import annotations


import pytest

from agentvm.errors import EXIT_CONFIG, SpecError
from agentvm.spec.loader import dump_resolved, load_agent, load_agent_text, load_preset_text
from agentvm.spec.models import AgentSpec

from _spec_helpers import agent


def problems_of(text: str, **kw) -> list:
    with pytest.raises(SpecError) as ei:
        load_agent_text(text, "a.yaml", preset_dirs=kw.pop("preset_dirs", []), **kw)
    assert ei.value.exit_code == EXIT_CONFIG
    assert ei.value.problems, "a SpecError from the loader always lists its problems"
    return ei.value.problems


def one(problems: list, field: str):
    hits = [p for p in problems if p.field == field]
    assert hits, f"no problem for {field}: {[p.render() for p in problems]}"
    return hits[0]


def test_minimal_agent_gets_defaults():
    la = load_agent_text(agent(), "a.yaml", preset_dirs=[])
    assert isinstance(la.spec, AgentSpec)
    assert la.spec.metadata.name == "t"
    assert la.spec.spec.limits.memory == 512 * 1024**2
    assert la.presets == [] and la.conflicts == []
    assert la.source == "a.yaml"
    assert la.origins["metadata.name"] == ("a.yaml", 4)


def test_sizes_and_durations_are_parsed_and_origins_point_at_lines():
    la = load_agent_text(agent("""\
        spec:
          limits:
            memory: 256M
            timeout: 1m30s
          mounts:
            - host: /srv/data
              path: /data
        """), "a.yaml", preset_dirs=[])
    lim = la.spec.spec.limits
    assert lim.memory == 256 * 1024**2 and lim.timeout == 90.0
    assert la.origins["spec.limits.memory"] == ("a.yaml", 7)
    assert la.origins["spec.limits.timeout"] == ("a.yaml", 8)
    assert la.origins["spec.mounts[0].host"] == ("a.yaml", 10)
    assert la.origins["spec.mounts[0].path"] == ("a.yaml", 11)


def test_bad_yaml_syntax_reports_file_and_line():
    probs = problems_of(agent("spec:\n  limits: {memory: 1G\n  pids: 3\n"))
    assert probs[0].file == "a.yaml"
    assert probs[0].line in (6, 7)
    assert "invalid YAML" in probs[0].message


def test_tab_indentation_is_a_located_syntax_error():
    probs = problems_of(agent("spec:\n\tlifecycle: ephemeral\n"))
    assert probs[0].line == 6 and "invalid YAML" in probs[0].message


def test_duplicate_keys_name_both_lines():
    probs = problems_of(agent("spec:\n  limits:\n    memory: 1G\n    pids: 64\n    memory: 2G\n"))
    p = one(probs, "spec.limits.memory")
    assert p.line == 9
    assert "duplicate key 'memory'" in p.message and "line 7" in p.message


def test_duplicate_top_level_key():
    probs = problems_of(agent("spec: {}\nspec: {}\n"))
    assert one(probs, "spec").line == 6


@pytest.mark.parametrize(
    "text, needle",
    [
        ("- a\n- b\n", "top level must be a mapping"),
        ("just a string\n", "top level must be a mapping"),
        ("", "empty"),
        ("# only a comment\n", "empty"),
        (agent() + "---\n" + agent(), "one YAML document"),
    ],
)
def test_top_level_shape(text, needle):
    probs = problems_of(text)
    assert needle in probs[0].message


def test_second_document_is_located():
    probs = problems_of(agent() + "---\n" + agent())
    assert probs[0].line == 6  # the first line of the second document


def test_anchors_and_aliases_are_fine():
    la = load_agent_text(agent("""\
        spec:
          mounts:
            - &m {host: /srv/a, path: /a}
            - {host: /srv/b, path: /b, mode: ro}
          env:
            A: &v "x"
            B: *v
        """), "a.yaml", preset_dirs=[])
    assert la.spec.spec.env == {"A": "x", "B": "x"}
    assert [m.path for m in la.spec.spec.mounts] == ["/a", "/b"]


def test_merge_keys_are_supported_explicit_keys_win():
    text = agent("""\
        spec:
          limits:
            <<: {pids: 64, nofile: 1024}
            pids: 100
        """)
    la = load_agent_text(text, "a.yaml", preset_dirs=[])
    assert la.spec.spec.limits.pids == 100 and la.spec.spec.limits.nofile == 1024


def test_recursive_alias_is_an_error_not_a_hang():
    probs = problems_of(agent("spec:\n  command: &c [a, *c]\n"))
    assert "recursive" in probs[0].message and probs[0].line == 6


def test_billion_laughs_is_capped():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev = f"*a{i-1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    probs = problems_of("\n".join(lines) + "\n")
    assert "more than" in probs[0].message


def test_unknown_tag_is_rejected():
    probs = problems_of(agent("spec:\n  lifecycle: !!python/name:os.system x\n"))
    assert probs[0].line == 6 and "constructor" in probs[0].message


def test_wrong_type_reports_line_and_yaml_field_path():
    probs = problems_of(agent("spec:\n  limits:\n    cpus: 2\n    memory: lots\n"))
    p = one(probs, "spec.limits.memory")
    assert (p.file, p.line) == ("a.yaml", 8)
    assert "invalid size" in p.message
    assert p.render() == f"a.yaml:8: spec.limits.memory: {p.message}"


def test_every_problem_is_reported_at_once():
    probs = problems_of(agent("""\
        spec:
          lifecycle: forever
          limits:
            pids: many
          mounts:
            - {host: relative/path, path: /data}
        """))
    fields = {p.field for p in probs}
    assert {"spec.lifecycle", "spec.limits.pids", "spec.mounts[0].host"} <= fields
    assert one(probs, "spec.lifecycle").line == 6
    assert one(probs, "spec.mounts[0].host").line == 10


def test_non_string_env_value_suggests_quoting():
    p = one(problems_of(agent("spec:\n  env:\n    DEBUG: 1\n")), "spec.env.DEBUG")
    assert p.line == 7 and "quote" in p.message


def test_camel_case_field_names_in_errors():
    p = one(problems_of(agent("spec:\n  security:\n    allowPtrace: maybe\n")), "spec.security.allowPtrace")
    assert p.line == 7


def test_missing_field_points_at_parent_mapping():
    text = "apiVersion: agentvm/v1\nkind: Agent\nmetadata:\n  labels: {a: b}\n"
    p = one(problems_of(text), "metadata.name")
    assert p.line == 3 and "missing" in p.message


def test_missing_top_level_field_points_at_document():
    p = one(problems_of("kind: Agent\nmetadata: {name: x}\n"), "apiVersion")
    assert p.line == 1


def test_unknown_field_is_rejected_with_suggestion():
    p = one(problems_of(agent("spec:\n  limits:\n    memroy: 1G\n")), "spec.limits.memroy")
    assert p.line == 7
    assert "unknown field 'memroy'" in p.message and "did you mean 'memory'" in p.message


def test_unknown_field_in_list_item():
    p = one(problems_of(agent("spec:\n  mounts:\n    - {host: /a, path: /b, mdoe: rw}\n")), "spec.mounts[0].mdoe")
    assert "did you mean 'mode'" in p.message


def test_snake_case_field_is_rejected_with_camel_case_suggestion():
    p = one(problems_of(agent("spec:\n  risk_tier: L3\n")), "spec.risk_tier")
    assert "riskTier" in p.message and p.line == 6


def test_unknown_field_without_close_match_lists_valid_fields():
    p = one(problems_of(agent("spec:\n  zzzqqq: 1\n")), "spec.zzzqqq")
    assert "valid fields" in p.message and "limits" in p.message


def test_rw_mount_at_l0_is_rejected_by_tier_ceiling():
    probs = problems_of(agent("""\
        spec:
          riskTier: L0
          mounts:
            - host: /srv/data
              path: /data
              mode: rw
        """))
    p = one(probs, "spec.mounts[0].mode")
    assert p.line == 10 and "risk tier" in p.message


def test_rw_mount_at_l1_is_fine():
    la = load_agent_text(agent("spec:\n  riskTier: L1\n  mounts:\n    - {host: /srv, path: /data, mode: rw}\n"),
                         "a.yaml", preset_dirs=[])
    assert la.spec.spec.mounts[0].mode == "rw"


def test_ptrace_needs_l4():
    p = one(problems_of(agent("spec:\n  security:\n    allowPtrace: true\n")), "spec.security.allowPtrace")
    assert "L4" in p.message and p.line == 7


@pytest.mark.parametrize("path", ["/proc", "/proc/self", "/etc/passwd", "/usr/local", "/", "/.agentvm/x", "/dev"])
def test_reserved_sandbox_paths_rejected(path):
    p = one(problems_of(agent(f"spec:\n  mounts:\n    - host: /srv\n      path: {path}\n")), "spec.mounts[0].path")
    assert "reserved" in p.message and p.line == 8


@pytest.mark.parametrize("field, value", [("host", "/srv/../etc"), ("path", "/data/../x"), ("host", "/srv/./x")])
def test_dot_dot_in_paths_rejected(field, value):
    other = "path: /data" if field == "host" else "host: /srv"
    p = one(problems_of(agent(f"spec:\n  mounts:\n    - {field}: {value}\n      {other}\n")),
            f"spec.mounts[0].{field}")
    assert "'..'" in p.message and p.line == 7


def test_workdir_dot_dot_rejected():
    p = one(problems_of(agent("spec:\n  workdir: /workspace/../etc\n")), "spec.workdir")
    assert p.line == 6


def test_duplicate_mount_paths_in_one_file_are_an_error():
    probs = problems_of(agent("spec:\n  mounts:\n    - {host: /a, path: /d}\n    - {host: /b, path: /d}\n"))
    assert any("same sandbox path" in p.message for p in probs)


def test_huge_numbers_are_errors_not_crashes():
    p = one(problems_of(agent(f"spec:\n  limits:\n    memory: '{'9' * 400}G'\n")), "spec.limits.memory")
    assert "too large" in p.message
    p = one(problems_of(agent(f"spec:\n  limits:\n    timeout: {'9' * 400}m\n")), "spec.limits.timeout")
    assert "too large" in p.message


def test_preset_file_is_not_an_agent():
    text = "apiVersion: agentvm/v1\nkind: Preset\nmetadata: {name: p}\nspec: {}\n"
    p = one(problems_of(text), "kind")
    assert "Preset" in p.message


def test_load_agent_from_file(tmp_path):
    f = tmp_path / "agent.yaml"
    f.write_text(agent("spec:\n  limits:\n    memory: nope\n"))
    with pytest.raises(SpecError) as ei:
        load_agent(f, preset_dirs=[])
    assert ei.value.problems[0].file == str(f)
    assert f"{f}:7: spec.limits.memory" in str(ei.value)


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError) as ei:
        load_agent(tmp_path / "nope.yaml", preset_dirs=[])
    assert "cannot read" in ei.value.problems[0].message


def test_non_utf8_file(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_bytes(agent().encode() + b"spec: {command: [\xff]}\n")
    with pytest.raises(SpecError) as ei:
        load_agent(f, preset_dirs=[])
    assert ei.value.problems[0].line == 5


def test_dump_resolved_is_plain_camel_case_data():
    la = load_agent_text(agent("spec:\n  riskTier: L1\n  limits: {memory: 256M, timeout: 5m}\n"), "a.yaml",
                         preset_dirs=[])
    d = dump_resolved(la)
    assert d["apiVersion"] == "agentvm/v1"
    assert d["spec"]["riskTier"] == "L1"
    assert d["spec"]["limits"]["memory"] == 256 * 1024**2
    assert isinstance(d["spec"]["limits"]["memory"], int)
    assert d["spec"]["limits"]["timeout"] == 300
    assert "allowPtrace" in d["spec"]["security"]
    # The dump is itself a valid agent that resolves to the same spec.
    again = AgentSpec.model_validate(d)
    assert again == la.spec


def test_preset_standalone_validation_reports_bad_types():
    text = ("apiVersion: agentvm/v1\nkind: Preset\nmetadata:\n  name: p\ndescription: x\n"
            "spec:\n  limits:\n    memory: lots\n  bogus: 1\n")
    with pytest.raises(SpecError) as ei:
        load_preset_text(text, "p.yaml", preset_dirs=[])
    probs = ei.value.problems
    assert one(probs, "spec.limits.memory").line == 8
    assert one(probs, "spec.bogus").line == 9


def test_preset_standalone_ok():
    text = "apiVersion: agentvm/v1\nkind: Preset\nmetadata:\n  name: p\nspec:\n  limits:\n    memory: 1G\n"
    lp = load_preset_text(text, "p.yaml", preset_dirs=[])
    assert lp.resolved.spec.limits.memory == 1024**3
    assert lp.preset.metadata.name == "p" and lp.presets == ["p"]


def test_review_mount_at_l0_is_rejected_like_rw_and_compiles_as_review_at_l1():
    probs = problems_of(agent("spec:\n  riskTier: L0\n  mounts:\n    - {host: /srv, path: /data, mode: review}\n"))
    p = one(probs, "spec.mounts[0].mode")
    assert "review grants need risk tier >= L1" in p.message
    from agentvm.policy import compile_policy

    la = load_agent_text(agent("spec:\n  riskTier: L1\n  mounts:\n    - {host: /srv, path: /data, mode: review}\n"),
                         "a.yaml", preset_dirs=[])
    m = compile_policy(la.spec).mounts[0]
    assert m.review and m.writable  # never a silent read-only or rw downgrade
