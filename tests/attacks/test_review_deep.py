"""A review layer with folders nested 1 200 deep (security review 2026-11-28, finding 7: the
recursive layer walk died with RecursionError, so `agentvm diff` failed with `internal` and the
agent kept the operator from reviewing or accepting anything).

Real bubblewrap sandbox, real `mode: review` grant, the real CLI: the diff now works and shows
the deep folder as REFUSED next to the agent's other changes; a whole accept is refused (all or
nothing), a partial accept of the other change applies it, and discard removes the deep layer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from _attacklib import needs_root
from test_review_grant_attacks import cli, folder, layer_name, layers_of, sandbox  # noqa: F401 (fixture)

pytestmark = [pytest.mark.attack, needs_root]

DEEP = textwrap.dedent(r"""
    import os
    open("/src/a.txt", "w").write("changed\n")
    fd = os.open("/src", os.O_RDONLY | os.O_DIRECTORY)
    os.mkdir("deep", dir_fd=fd)
    fd = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    for _ in range(1200):
        os.mkdir("d", dir_fd=fd)
        fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(os.open("payload", os.O_WRONLY | os.O_CREAT, 0o755, dir_fd=fd))
    print("deep made")
""")


def test_a_deep_layer_is_reviewed_refused_and_discarded(avm_home, folder):
    (folder / "deep.py").write_text(DEEP)
    rc, out = sandbox(folder, "exec python3 /src/deep.py")
    assert rc == 0 and "deep made" in out, out
    name = layer_name(avm_home, folder)
    d = cli("diff", name)
    assert d.returncode == 0, d.stderr[-2000:]
    assert "internal" not in d.stderr and "RecursionError" not in d.stderr
    assert "+changed" in d.stdout, d.stdout[-2000:]
    assert any(ln.startswith("REFUSED /src/deep/") and "nested over" in ln for ln in d.stdout.splitlines()), \
        d.stdout[-2000:]
    whole = cli("accept", name)
    assert whole.returncode == 77 and "review.refused" in whole.stderr, (whole.returncode, whole.stderr[-1000:])
    assert (folder / "a.txt").read_text() == "original\n" and not (folder / "deep").exists()
    part = cli("accept", name, "/src/a.txt")
    assert part.returncode == 0, part.stderr[-1000:]
    assert (folder / "a.txt").read_text() == "changed\n" and not (folder / "deep").exists()
    gone = subprocess.run([sys.executable, "-m", "agentvm", "discard", name], capture_output=True, text=True,
                          timeout=120)
    assert gone.returncode == 0, gone.stderr[-1000:]
    assert not layers_of(avm_home, folder)
