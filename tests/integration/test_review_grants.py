"""Review-mode grants in the real sandbox (bubblewrap, idmapped grant, overlay): the agent's
writes reach the host folder only through `agentvm accept`; `agentvm diff` shows each kind of
change right; a host change since the start is a conflict and nothing of it is applied; an
agent's layer continues across its runs; diff/accept/discard go on the audit chain.

The sandbox is started through the public runtime (agentvm.runtime.Runtime) with a policy
holding a review grant; diff/accept/discard through the real CLI."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agentvm import review
from tests.helpers import needs_root

pytestmark = [needs_root]


@pytest.fixture
def folder():
    d = Path(f"/tmp/agentvm-grant-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "a.txt").write_text("one\ntwo\n")
    (d / "b.txt").write_text("bee\n")
    (d / "bin.dat").write_bytes(b"\xff\0\1\2\3")
    (d / "gone.txt").write_text("bye\n")
    (d / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(d / "run.sh", 0o644)
    (d / "ln").symlink_to("a.txt")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_in_sandbox(script: str, folder: Path, *, agent: str | None = None) -> tuple[int, str]:
    """Run ``script`` with ``folder`` granted in review mode at /src -> (exit code, output)."""
    from agentvm.policy import Policy
    from agentvm.runtime import Runtime

    pol = Policy(name=agent or "run", agent=agent is not None, command=("/bin/sh", "-c", script),
                 mounts=(review.review_mount(str(folder), "/src"),), network="none", workspace=None)
    import tempfile

    with tempfile.TemporaryFile() as out:
        rt = Runtime()
        try:
            res = rt.run(pol, tty=False, stdio=(0, out.fileno(), out.fileno()))
        finally:
            rt.close()
        out.seek(0)
        return res.exit_code, out.read().decode(errors="replace")


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "agentvm", *args], capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"agentvm {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def layers_of(home: Path, folder: Path) -> list[dict]:
    """The layers over ``folder`` (the session's home holds other tests' layers too)."""
    return [x for x in review.list_layers(home) if str(folder) in x["grants"]]


def only_layer(home: Path, folder: Path) -> str:
    layers = layers_of(home, folder)
    assert len(layers) == 1, layers
    return layers[0]["name"]


def tree(root: Path) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = os.lstat(p)
            body = p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p) if stat.S_ISLNK(st.st_mode) else b""
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), body)
    return out


EDITS = r"""
cd /src || exit 3
echo three >> a.txt
printf '\377\0\1\2\4' > bin.dat
rm gone.txt
chmod 755 run.sh
rm ln && ln -s b.txt ln
mkdir -p new/deeper && echo fresh > new/deeper/n.txt
grep -q three a.txt && echo SEES-OWN
"""


def test_writes_reach_the_host_only_through_accept_and_diff_shows_each_kind(avm_home, folder):
    before = tree(folder)
    code, out = run_in_sandbox(EDITS, folder)
    assert code == 0 and "SEES-OWN" in out, out
    assert tree(folder) == before, "the host folder changed before accept"
    name = only_layer(avm_home, folder)
    assert name.startswith("run-"), "an anonymous run's layer is named by the run"

    d = cli("diff", name).stdout
    assert f"modified /src/a.txt" in d and "+three" in d and "@@" in d  # a unified diff for text
    assert "modified /src/bin.dat" in d and "Binary files differ" in d
    assert "mode /src/run.sh: 0644 -> 0755" in d
    assert "deleted /src/gone.txt (file)" in d
    assert "symlink /src/ln -> b.txt (was -> a.txt)" in d
    assert "new folder /src/new" in d and "new file /src/new/deeper/n.txt" in d and "+fresh" in d
    rid = d.strip().splitlines()[-1].split()[-1]
    one = cli("diff", name, "/src/a.txt").stdout
    assert "a.txt" in one and "bin.dat" not in one

    r = cli("accept", name, "--expect", rid)
    assert "applied" in r.stdout
    assert (folder / "a.txt").read_text() == "one\ntwo\nthree\n"
    assert (folder / "bin.dat").read_bytes() == b"\xff\0\1\2\4"
    assert not (folder / "gone.txt").exists()
    assert stat.S_IMODE(os.lstat(folder / "run.sh").st_mode) == 0o755
    assert os.readlink(folder / "ln") == "b.txt"
    assert (folder / "new" / "deeper" / "n.txt").read_text() == "fresh\n"
    assert "no changes" in cli("diff", name).stdout

    cli("discard", name)
    assert layers_of(avm_home, folder) == []
    from agentvm.audit import AuditLog

    kinds = [r.kind for r in AuditLog(avm_home / "audit" / "audit.db").records()]
    assert {"review.diffed", "review.accepted", "review.discarded"} <= set(kinds)


def test_a_conflicting_host_change_refuses_the_accept_and_applies_nothing(avm_home, folder):
    code, out = run_in_sandbox("echo agent >> /src/a.txt && echo agent >> /src/b.txt", folder)
    assert code == 0, out
    name = only_layer(avm_home, folder)
    (folder / "a.txt").write_text("the operator's edit\n")  # the host changed it meanwhile
    d = cli("diff", name).stdout
    assert "CONFLICT: changed on the host since the sandbox started" in d
    r = cli("accept", name, check=False)
    assert r.returncode == 1 and "review.conflict" in r.stderr and "a.txt" in r.stderr, r.stderr
    assert (folder / "a.txt").read_text() == "the operator's edit\n"
    assert (folder / "b.txt").read_text() == "bee\n", "nothing half-applied"
    cli("accept", name, "b.txt")
    assert (folder / "b.txt").read_text() == "bee\nagent\n"
    assert (folder / "a.txt").read_text() == "the operator's edit\n"
    cli("discard", name)


def test_an_agents_layer_continues_across_its_runs(avm_home, folder):
    agent = "rev-" + secrets.token_hex(3)
    code, out = run_in_sandbox("echo first > /src/x.txt", folder, agent=agent)
    assert code == 0, out
    code, out = run_in_sandbox("cat /src/x.txt && echo second > /src/y.txt", folder, agent=agent)
    assert code == 0 and "first" in out, out
    assert review.list_layers(avm_home)[0]["name"] == agent
    d = cli("diff", agent).stdout
    assert "new file /src/x.txt" in d and "new file /src/y.txt" in d
    assert not (folder / "x.txt").exists() and not (folder / "y.txt").exists()
    cli("discard", agent)
    assert not (folder / "x.txt").exists()
    code, out = run_in_sandbox("cat /src/x.txt 2>&1; true", folder, agent=agent)
    assert "No such file" in out, "a discarded layer is gone for the next run too"
    cli("discard", agent)


def test_host_trusted_names_stay_read_only_in_the_layer(avm_home, folder):
    (folder / ".git").mkdir()
    (folder / ".git" / "hooks").mkdir()
    code, out = run_in_sandbox(
        "echo evil > /src/.git/hooks/pre-commit 2>/dev/null && echo HOOK; "
        "echo evil > /src/.envrc 2>/dev/null && echo ENVRC; "
        "mkdir -p /src/.vscode 2>/dev/null; echo '{}' > /src/.vscode/tasks.json 2>/dev/null && echo VSCODE; "
        "echo ok > /src/Makefile && echo MAKEFILE", folder)
    assert "MAKEFILE" in out and not any(w in out for w in ("HOOK", "ENVRC", "VSCODE")), out
    name = only_layer(avm_home, folder)
    d = cli("diff", name).stdout
    assert "new file /src/Makefile" in d and ".git" not in d and ".envrc" not in d
    cli("discard", name)
    assert sorted(os.listdir(folder)) == sorted(["a.txt", "b.txt", "bin.dat", "gone.txt", "run.sh", "ln", ".git"])


def _gvisor_unavailable() -> str | None:
    from tests.contract.conftest import skip_reason

    return skip_reason("gvisor")


@pytest.mark.skipif(_gvisor_unavailable() is not None, reason=str(_gvisor_unavailable()))
def test_gvisor_refuses_a_review_grant_before_anything_starts(avm_home, folder):
    from agentvm.errors import AgentVMError
    from agentvm.policy import Policy
    from agentvm.runtime import Runtime

    pol = Policy(name="run", command=("/bin/true",), substrate="gvisor",
                 mounts=(review.review_mount(str(folder), "/src"),), network="none", workspace=None)
    rt = Runtime()
    try:
        with pytest.raises(AgentVMError) as ei:
            rt.run(pol, tty=False, stdio=(0, 1, 2))
    finally:
        rt.close()
    # refused by the substrate: never run as a plain rw grant
    assert ei.value.code == "policy.review-unsupported" and "review" in ei.value.message
    assert layers_of(avm_home, folder) == []
    assert sorted(os.listdir(folder)) == ["a.txt", "b.txt", "bin.dat", "gone.txt", "ln", "run.sh"]
