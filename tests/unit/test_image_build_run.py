"""A build's `run` commands: their output shown as it comes (prefixed), the last lines in the
error of one that fails, a time limit (without bubblewrap: a stand-in runs the command)."""

from __future__ import annotations

import pytest


def _fake_bwrap(tmp_path):
    """Stands in for bubblewrap: drops bwrap's options and runs the build command on the host."""
    exe = tmp_path / "fake-bwrap"
    exe.write_text('#!/bin/sh\nwhile [ "$1" != /bin/sh ]; do shift; done\nexec "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def test_a_build_commands_output_is_shown_as_it_comes(tmp_path):
    import time

    from agentvm.images.build import RUN_PREFIX, _run_in

    seen = []
    t0 = time.monotonic()
    _run_in(tmp_path, "echo one; echo two >&2; sleep 1.5; printf 'three\\033]0;title\\007'",
            _fake_bwrap(tmp_path), lambda s: seen.append((time.monotonic() - t0, s)))
    assert [s for _, s in seen] == [RUN_PREFIX + "one", RUN_PREFIX + "two", RUN_PREFIX + "three\\x1b]0;title\\x07"]
    assert seen[0][0] < 1.0 < seen[-1][0], seen  # the first line was shown before the command ended


def test_a_failing_build_command_names_its_last_lines(tmp_path):
    from agentvm.images import ImageError
    from agentvm.images.build import _run_in

    seen = []
    with pytest.raises(ImageError) as ei:
        _run_in(tmp_path, "for i in 1 2 3 4 5 6 7; do echo line$i; done; exit 3", _fake_bwrap(tmp_path), seen.append)
    assert len(seen) == 7
    assert ei.value.message == "run: 'for i in 1 2 3 4 5 6 7; do echo line$i; done; exit 3' failed (exit 3): " \
                               "line3 | line4 | line5 | line6 | line7"


def test_a_build_command_over_its_time_is_stopped(tmp_path, monkeypatch):
    import time

    from agentvm.images import ImageError, build

    monkeypatch.setattr(build, "RUN_TIMEOUT", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ImageError, match="took over 0.5s"):
        build._run_in(tmp_path, "echo started; exec sleep 30", _fake_bwrap(tmp_path), lambda s: None)
    assert time.monotonic() - t0 < 10
