"""`agentvm validate | compile | presets | schema` through click's CliRunner."""

from __future__ import annotations


import json

import pytest
import yaml
from click.testing import CliRunner

from agentvm.cli import cli, main
from agentvm.errors import EXIT_CONFIG
from agentvm.spec.loader import load_agent_text

from _spec_helpers import agent, write_preset


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.delenv("AGENTVM_PRESET_PATH", raising=False)
    monkeypatch.delenv("AGENTVM_HOME", raising=False)
    return CliRunner()


@pytest.fixture
def good(tmp_path):
    f = tmp_path / "good.yaml"
    f.write_text(agent("spec:\n  presets: [python]\n  limits:\n    memory: 256M\n"))
    return f


@pytest.fixture
def bad(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(agent("spec:\n  limits:\n    memory: lots\n"))
    return f


def test_validate_ok(runner, good):
    r = runner.invoke(cli, ["validate", str(good)])
    assert r.exit_code == 0, r.output
    assert f"{good}: ok" in r.stdout


def test_validate_bad_prints_file_line_field_and_exits_78(runner, good, bad):
    r = runner.invoke(cli, ["validate", str(good), str(bad)])
    assert r.exit_code == EXIT_CONFIG
    assert f"{bad}:7: spec.limits.memory: invalid size 'lots'" in r.stdout
    assert f"{good}: ok" in r.stdout


def test_validate_reports_unknown_field_suggestion(runner, tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text(agent("spec:\n  lifecylce: persistent\n"))
    r = runner.invoke(cli, ["validate", str(f)])
    assert r.exit_code == EXIT_CONFIG
    assert f"{f}:6: spec.lifecylce: unknown field 'lifecylce'; did you mean 'lifecycle'?" in r.stdout


def test_validate_json(runner, good, bad):
    r = runner.invoke(cli, ["validate", "--json", str(good), str(bad)])
    assert r.exit_code == EXIT_CONFIG
    data = json.loads(r.stdout)
    assert [d["ok"] for d in data] == [True, False]
    assert data[0]["presets"] == ["python"]
    assert data[1]["problems"][0] == {
        "file": str(bad), "line": 7, "field": "spec.limits.memory",
        "message": "invalid size 'lots': use bytes or a suffix K, M, G, T (e.g. '256M')",
    }


def test_validate_detects_preset_files(runner, tmp_path):
    p = write_preset(tmp_path, "mine", "limits:\n  pids: 2\n")
    r = runner.invoke(cli, ["validate", "--json", str(p)])
    assert r.exit_code == EXIT_CONFIG
    d = json.loads(r.stdout)[0]
    assert d["kind"] == "Preset" and d["problems"][0]["field"] == "spec.limits.pids"
    assert d["problems"][0]["line"] == 8


def test_validate_conflicts_warn_and_strict_fails(runner, tmp_path):
    write_preset(tmp_path / "p", "a", "limits:\n  memory: 1G\n")
    write_preset(tmp_path / "p", "b", "limits:\n  memory: 2G\n")
    f = tmp_path / "a.yaml"
    f.write_text(agent("spec:\n  presets: [a, b]\n"))
    r = runner.invoke(cli, ["validate", "--preset-path", str(tmp_path / "p"), str(f)])
    assert r.exit_code == 0, r.output
    assert "warning: conflict: spec.limits.memory" in r.stderr
    r = runner.invoke(cli, ["validate", "--strict", "--preset-path", str(tmp_path / "p"), str(f)])
    assert r.exit_code == EXIT_CONFIG
    assert f"{tmp_path / 'p' / 'b.yaml'}:8: spec.limits.memory: presets conflict" in r.stdout


def test_validate_missing_file(runner, tmp_path):
    r = runner.invoke(cli, ["validate", str(tmp_path / "nope.yaml")])
    assert r.exit_code == EXIT_CONFIG
    assert "cannot read file" in r.stdout


def test_validate_syntax_error_has_line(runner, tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(agent("spec:\n  command: [a, b\n"))
    r = runner.invoke(cli, ["validate", str(f)])
    assert r.exit_code == EXIT_CONFIG
    assert f"{f}:7: invalid YAML" in r.stdout or f"{f}:6: invalid YAML" in r.stdout


def test_compile_yaml_round_trips(runner, good):
    r = runner.invoke(cli, ["compile", str(good)])
    assert r.exit_code == 0, r.output
    assert "# merge order: python -> " in r.stderr
    assert "override: spec.limits.memory" in r.stderr
    data = yaml.safe_load(r.stdout)
    assert data["spec"]["limits"]["memory"] == 256 * 1024**2
    assert data["spec"]["env"]["PYTHONUNBUFFERED"] == "1"
    again = load_agent_text(r.stdout, "compiled.yaml", preset_dirs=[])
    assert again.spec.spec.limits.memory == 256 * 1024**2


def test_compile_json(runner, good):
    r = runner.invoke(cli, ["compile", "--json", str(good)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "Agent" and data["spec"]["riskTier"] == "L2"


def test_compile_invalid_exits_78_with_location(runner, bad):
    r = runner.invoke(cli, ["compile", str(bad)])
    assert r.exit_code == EXIT_CONFIG
    assert f"{bad}:7: spec.limits.memory" in r.stderr
    assert r.stdout == ""


def test_compile_multiline_command_is_a_literal_block(runner, tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text(agent("spec:\n  command:\n    - sh\n    - |\n      echo a\n      echo b\n"))
    r = runner.invoke(cli, ["compile", str(f)])
    assert r.exit_code == 0, r.output
    assert "- |" in r.stdout
    assert yaml.safe_load(r.stdout)["spec"]["command"] == ["sh", "echo a\necho b\n"]


def test_presets_table_and_json(runner, tmp_path):
    write_preset(tmp_path, "python", "env: {X: '1'}\n", description="my own python")
    write_preset(tmp_path, "zeta", description="last one")
    r = runner.invoke(cli, ["presets", "--preset-path", str(tmp_path)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ORIGIN", "DESCRIPTION"]
    py = next(line for line in lines if line.startswith("python"))
    assert "shadows builtin" in py and "my own python" in py
    assert any(line.startswith("strict") and "builtin" in line for line in lines)
    r = runner.invoke(cli, ["presets", "--json", "--preset-path", str(tmp_path)])
    data = {d["name"]: d for d in json.loads(r.stdout)}
    assert data["zeta"]["builtin"] is False and data["zeta"]["description"] == "last one"
    assert data["python"]["shadowsBuiltin"] is True
    assert data["debug"]["builtin"] is True


def test_preset_path_option_is_used_by_compile(runner, tmp_path):
    write_preset(tmp_path / "p", "mine", "env: {MINE: 'yes'}\n")
    f = tmp_path / "a.yaml"
    f.write_text(agent("spec:\n  presets: [mine]\n"))
    r = runner.invoke(cli, ["compile", "--json", str(f)])
    assert r.exit_code == EXIT_CONFIG
    err = json.loads(r.stdout)  # with --json the error is JSON on stdout
    assert err["error"] == "spec.invalid" and "unknown preset 'mine'" in err["problems"][0]["message"]
    r = runner.invoke(cli, ["compile", "--json", "--preset-path", str(tmp_path / "p"), str(f)])
    assert r.exit_code == 0 and json.loads(r.stdout)["spec"]["env"] == {"MINE": "yes"}


def test_schema_command(runner):
    r = runner.invoke(cli, ["schema"])
    assert r.exit_code == 0
    s = json.loads(r.stdout)
    assert s["$id"] and "spec" in s["properties"]


def test_main_returns_exit_codes(good, bad, capsys):
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(bad)]) == EXIT_CONFIG
    assert main(["compile", str(bad)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{bad}:7: spec.limits.memory" in err


def test_validate_takes_image_files(tmp_path):
    """An image file (kind: Image) is checked as `agentvm image build` checks it before it starts."""
    from click.testing import CliRunner

    from agentvm.cli import cli

    good = tmp_path / "img.yaml"
    (tmp_path / "hello.py").write_text("print(1)\n")
    good.write_text("apiVersion: agentvm/v1\nkind: Image\nmetadata: {name: img}\n"
                    "spec:\n  packages: [python3-minimal]\n  files: [{src: hello.py, dest: /usr/lib/h.py}]\n")
    r = CliRunner().invoke(cli, ["validate", str(good)])
    assert r.exit_code == 0 and r.output == f"{good}: ok\n", r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: agentvm/v1\nkind: Image\nmetadata: {name: bad}\n"
                   "spec:\n  files: [{src: missing.py, dest: /x}]\n")
    r = CliRunner().invoke(cli, ["validate", str(bad)])
    assert r.exit_code == 78 and r.output == f"{bad}: files: missing.py does not exist (relative to {tmp_path})\n"
    bad.write_text("apiVersion: agentvm/v1\nkind: Image\nmetadata: {name: bad}\nspec: {packages: [Not_A_Package]}\n")
    r = CliRunner().invoke(cli, ["validate", str(bad)])
    assert r.exit_code == 78 and "spec.packages: Value error, 'Not_A_Package' is not a Debian package name" in r.output
