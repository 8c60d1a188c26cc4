"""How a gVisor start failure is explained: runsc itself only says that the sandbox process
went away ("cannot read client sync file: ... EOF"); the reason is in the boot (or gofer)
process's own log, which every run now writes (``--debug-log=<run dir>/runsc-debug/``)."""

from __future__ import annotations

from agentvm.backends.gvisor import _runsc_error

RUNSC = ("I1128 07:53:38.540000   29360 main.go:217] Args: [runsc run]\n"
         "W1128 07:53:38.700000   29360 error.go:48] FATAL ERROR: running container: creating container: cannot create "
         "sandbox: cannot read client sync file: waiting for sandbox to start: EOF\n")
BOOT = ("I1128 07:53:38.559474   29364 main.go:216] ***************************\n"
        "I1128 07:53:38.600000   29364 loader.go:100] Platform: ptrace\n"
        "W1128 07:53:38.650000   29364 error.go:48] FATAL ERROR: error setting up chroot: error mounting proc: "
        "resource temporarily unavailable\n")


def _logs(tmp_path, boot: str | None):
    (tmp_path / "runsc.log").write_text(RUNSC)
    if boot is not None:
        d = tmp_path / "runsc-debug"
        d.mkdir()
        (d / "runsc.log.20261128-075338.540928.run.txt").write_text(RUNSC)
        (d / "runsc.log.20261128-075338.542031.boot.txt").write_text(boot)
    return tmp_path / "runsc.log"


def test_a_sandbox_that_died_while_starting_is_explained_by_its_boot_log(tmp_path):
    why = _runsc_error(_logs(tmp_path, BOOT))
    assert why.startswith("W1128") and "cannot read client sync file" in why
    assert "the sandbox's boot process said:" in why and "error mounting proc: resource temporarily unavailable" in why


def test_without_the_boot_log_the_runsc_error_is_still_said(tmp_path):
    why = _runsc_error(_logs(tmp_path, None))
    assert "cannot read client sync file" in why and "boot process" not in why


def test_a_boot_log_with_only_info_lines_gives_its_last_line(tmp_path):
    """No warning at all: where the sandbox process stopped is the best clue there is."""
    why = _runsc_error(_logs(tmp_path, BOOT.rsplit("W1128", 1)[0]))
    assert "the sandbox's boot process said" not in why
    assert why.endswith("the sandbox's boot process's last line: I1128 07:53:38.600000   29364 loader.go:100] Platform: ptrace")
