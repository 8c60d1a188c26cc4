"""`agentvm secret set | list | rm | revoke | restore` through click's CliRunner."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

import agentvm.cli.secret_cmds as secret_cmds
from agentvm.cli import cli, main
from agentvm.errors import EXIT_CONFIG
from agentvm.vault import Vault

CANARY = "CANARY-ghp-0a1b2c3d4e5f60718293"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def vault(home) -> Vault:
    return Vault(home / "vault")


@pytest.fixture
def runner(home):
    return CliRunner()


def run(runner, *args, input=None):
    return runner.invoke(cli, ["secret", *args], input=input)


def test_set_from_stdin_strips_one_newline(runner, vault):
    r = run(runner, "set", "tok", input="hunter2\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == "secret tok stored\n"
    assert vault.get("tok") == "hunter2"
    r = run(runner, "set", "tok", input="line1\nline2\n\n")
    assert r.stdout == "secret tok rotated\n"
    assert vault.get("tok") == "line1\nline2\n"
    run(runner, "set", "tok", input="no-newline")
    assert vault.get("tok") == "no-newline"


def test_set_empty_stdin_is_an_error(runner, vault):
    for stdin in ("", "\n"):
        r = run(runner, "set", "tok", input=stdin)
        assert r.exit_code == EXIT_CONFIG
        assert "[vault.invalid-value]" in r.stderr and "no value on stdin" in r.stderr
    assert not vault.exists("tok")


def test_set_too_large_stdin(runner, vault):
    r = run(runner, "set", "tok", input="x" * (64 * 1024 + 10))
    assert r.exit_code == EXIT_CONFIG and "[vault.invalid-value]" in r.stderr


def test_set_prompts_twice_on_a_tty(runner, vault, monkeypatch):
    monkeypatch.setattr(secret_cmds, "_stdin_is_tty", lambda: True)
    r = run(runner, "set", "tok", input=f"{CANARY}\n{CANARY}\n")
    assert r.exit_code == 0, r.output
    assert CANARY not in r.output  # hidden input
    assert "Value of secret tok" in r.output and "Repeat for confirmation" in r.output
    assert vault.get("tok") == CANARY


def test_set_from_env(runner, vault, monkeypatch):
    monkeypatch.setenv("CI_TOKEN", CANARY)
    r = run(runner, "set", "tok", "--from-env", "CI_TOKEN", input="ignored\n")
    assert r.exit_code == 0, r.output
    assert vault.get("tok") == CANARY
    assert CANARY not in r.output
    monkeypatch.delenv("CI_TOKEN")
    r = run(runner, "set", "tok", "--from-env", "CI_TOKEN")
    assert r.exit_code == EXIT_CONFIG
    assert "env:CI_TOKEN" in r.stderr and "[vault.ref-unresolved]" in r.stderr


@pytest.mark.parametrize("argv", [
    ["set", "tok", CANARY],
    ["set", "tok", "--value", CANARY],
    ["set", "tok", f"--value={CANARY}"],
    ["set", "tok", "--from-env", "X", CANARY],
])
def test_value_cannot_come_from_argv(runner, vault, argv):
    r = runner.invoke(cli, ["secret", *argv], input="from-stdin\n")
    assert r.exit_code == EXIT_CONFIG  # a usage error: invalid input (docs/cli.md)
    assert "cannot be given on the command line" in r.output
    assert CANARY not in r.output
    assert not vault.exists("tok")


def test_value_in_argv_through_main(home, capsys):
    assert main(["secret", "set", "tok", CANARY]) == EXIT_CONFIG
    out = capsys.readouterr()
    assert CANARY not in out.out + out.err
    assert "cannot be given on the command line" in out.err


def test_invalid_name(runner):
    r = run(runner, "set", "bad/name", input="v\n")
    assert r.exit_code == EXIT_CONFIG and "[vault.invalid-name]" in r.stderr


def test_list(runner, vault):
    r = run(runner, "list")
    assert r.exit_code == 0 and r.stdout == "" and "no secrets" in r.stderr
    assert json.loads(run(runner, "list", "--json").stdout) == []
    run(runner, "set", "b", input="1\n")
    run(runner, "set", "a", input="2\n")
    run(runner, "revoke", "a")
    run(runner, "revoke", "b", "--sandbox", "sb1")
    r = run(runner, "list")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "CREATED", "UPDATED", "REVOKED"]
    assert lines[1].split()[0] == "a" and lines[1].split()[-1] == "yes"
    assert lines[2].split()[0] == "b" and lines[2].endswith("sandbox sb1")
    data = json.loads(run(runner, "list", "--json").stdout)
    assert [d["name"] for d in data] == ["a", "b"]
    assert set(data[0]) == {"name", "created", "updated", "revoked", "revoked_sandboxes"}
    assert data[0]["revoked"] is True and data[1]["revoked"] is False
    assert data[1]["revoked_sandboxes"] == ["sb1"]


def test_rm(runner, vault):
    run(runner, "set", "tok", input="v\n")
    r = run(runner, "rm", "tok")
    assert r.exit_code == 0 and r.stdout == "secret tok removed\n"
    assert not vault.exists("tok")
    r = run(runner, "rm", "tok")
    assert r.exit_code == EXIT_CONFIG
    assert "agentvm: error [vault.not-found]: no secret named 'tok'" in r.stderr


def test_revoke_and_restore(runner, vault):
    run(runner, "set", "tok", input="v\n")
    gate = Vault(vault.directory)
    assert not gate.is_revoked("tok", "sb1")
    r = run(runner, "revoke", "tok", "--sandbox", "sb1")
    assert r.exit_code == 0 and r.stdout == "secret tok revoked for sandbox sb1\n"
    assert gate.is_revoked("tok", "sb1") and not gate.is_revoked("tok")
    assert run(runner, "revoke", "tok", "--sandbox", "sb1").stdout == "secret tok was already revoked for sandbox sb1\n"
    assert run(runner, "revoke", "tok").stdout == "secret tok revoked\n"
    assert gate.is_revoked("tok", "sb2")
    assert run(runner, "restore", "tok").stdout == "secret tok restored\n"
    assert not gate.is_revoked("tok", "sb2") and gate.is_revoked("tok", "sb1")
    assert run(runner, "restore", "tok", "--sandbox", "sb1").stdout == "secret tok restored for sandbox sb1\n"
    assert not gate.is_revoked("tok", "sb1")
    assert run(runner, "restore", "tok").stdout == "secret tok was not revoked\n"
    r = run(runner, "revoke", "missing")
    assert r.exit_code == EXIT_CONFIG and "[vault.not-found]" in r.stderr


def test_insecure_key_reported_with_hint(runner, vault):
    run(runner, "set", "tok", input="v\n")
    os.chmod(vault.key_path, 0o644)
    r = run(runner, "set", "tok2", input="v\n")
    assert r.exit_code == EXIT_CONFIG
    assert "[vault.key-insecure]" in r.stderr and f"hint: chmod 600 {vault.key_path}" in r.stderr


def test_list_json_error_is_json(runner, vault):
    run(runner, "set", "tok", input="v\n")
    vault.store_path.write_text("{broken")
    r = run(runner, "list", "--json")
    assert r.exit_code == EXIT_CONFIG
    assert json.loads(r.stdout)["error"] == "vault.corrupt"


def test_canary_never_in_cli_output(runner, vault, monkeypatch):
    outputs = []

    def go(*args, input=None):
        r = run(runner, *args, input=input)
        outputs.append(r.output)
        return r

    assert go("set", "canary", input=CANARY + "\n").exit_code == 0
    assert go("set", "canary", input=CANARY + "\n").exit_code == 0  # rotate
    go("list")
    go("list", "--json")
    go("revoke", "canary", "--sandbox", "sb")
    go("revoke", "canary")
    go("restore", "canary")
    go("set", "bad", input=CANARY + "\x00\n")  # value error
    go("set", "bad", input=CANARY * 3000)  # too large
    go("set", "bad", CANARY)  # argv
    go("set", CANARY + "/x", input="v\n")  # value typed as the name
    monkeypatch.setenv("CANARY_ENV", CANARY * 3000)  # too large
    go("set", "bad", "--from-env", "CANARY_ENV")
    go("set", "bad", input=b"\xff" + CANARY.encode())
    os.chmod(vault.key_path, 0o640)
    go("set", "other", input=CANARY + "\n")
    go("list", "--json")
    os.chmod(vault.key_path, 0o600)
    go("rm", "canary")
    for out in outputs:
        assert CANARY not in out, out
    assert vault.exists("canary") is False
    for p in vault.directory.iterdir():
        assert CANARY.encode() not in p.read_bytes()
