"""Usage errors exit 78 (invalid input), as docs/cli.md promises - never click's 2 - on every
command, through the entry point and through click's own standalone mode."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from agentvm.cli import cli, main
from agentvm.errors import EXIT_CONFIG

USAGE_ERRORS = [
    (["audit", "export", "--format", "xml"], "'xml' is not one of"),  # a bad choice
    (["audit", "export", "--since", "garbage"], "invalid time 'garbage'"),  # a value its converter refuses
    (["audit", "show", "--bogus"], "No such option '--bogus'"),  # unknown option of a subcommand
    (["runs", "-n", "many"], "'many' is not a valid integer"),
    (["runs", "--bogus"], "No such option '--bogus'"),
    (["logs"], "Missing argument 'NAME'"),
    (["approvals", "show"], "Missing argument"),
    (["policy", "x", "explode"], "'explode' is not one of"),
    (["image", "build"], "Missing argument"),
    (["nosuch"], "No such command 'nosuch'"),
    (["--bogus"], "No such option '--bogus'"),
    (["audit"], ""),  # a group without its subcommand: the help, and 78
]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AGENTVM_RUNTIME_DIR", str(tmp_path / "run"))


@pytest.mark.parametrize("argv,said", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_78(argv, said, capsys):
    assert main(argv) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert said in err


@pytest.mark.parametrize("argv,said", USAGE_ERRORS[:4], ids=[" ".join(a) for a, _ in USAGE_ERRORS[:4]])
def test_usage_errors_exit_78_in_standalone_mode(argv, said):
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == EXIT_CONFIG and said in r.output


@pytest.mark.parametrize("argv", [["run", "--bogus", "--", "true"], ["run", "--timeout"],
                                  ["run", "--network", "carrier-pigeon", "--", "true"], ["run"]])
def test_run_usage_errors_exit_78(argv, capsys):
    """`agentvm run` is argparse (fastrun.py hands every option to run_cmd.py): the same contract."""
    assert main(argv) == EXIT_CONFIG
    assert "agentvm: error [config.invalid]" in capsys.readouterr().err


def test_help_and_version_still_exit_0():
    assert main(["--version"]) == 0 and main(["runs", "--help"]) == 0


def test_through_the_real_entry_point():
    r = subprocess.run([sys.executable, "-m", "agentvm", "audit", "export", "--format", "xml"], capture_output=True)
    assert r.returncode == EXIT_CONFIG and b"'xml' is not one of" in r.stderr
