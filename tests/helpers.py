"""Plain helpers shared by every test directory (fixtures live in conftest.py files)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the default substrate's full guarantees need root (dedicated uids, cgroups)")


def agentvm_cmd() -> list[str]:
    return [sys.executable, "-m", "agentvm"]


def av(*args: str, check: bool = True, input: bytes | None = None, timeout: float = 120):
    """Run the real CLI -> CompletedProcess (bytes); ``check``: a non-zero exit fails the test
    with the command's output."""
    import subprocess

    r = subprocess.run(agentvm_cmd() + list(args), capture_output=True, input=input, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"agentvm {' '.join(args)} -> {r.returncode}\n{r.stdout.decode()}\n{r.stderr.decode()}")
    return r


def stop_daemon(home) -> None:
    """`agentvm down` for the installation at ``home``; a daemon still there after it (its pid
    file left behind) is killed."""
    import signal
    from pathlib import Path

    av("down", check=False)
    pidf = Path(home) / "run" / "daemon.pid"
    if pidf.exists():
        try:
            os.kill(int(pidf.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def last_json(stdout: str | bytes) -> dict:
    """The ``--json`` result of ``agentvm run``: the last non-empty stdout line."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no --json line on stdout"
    try:
        return json.loads(lines[-1])
    except ValueError as exc:  # pragma: no cover - diagnostic
        raise AssertionError(f"last stdout line is not JSON: {lines[-1][:500]!r}") from exc


def parse_table(stdout: str) -> dict[str, list[str]]:
    """``name field field...`` lines (what the attack probes print) -> {name: fields}."""
    out = {}
    for ln in stdout.splitlines():
        parts = ln.split()
        if parts:
            out[parts[0]] = parts[1:]
    return out


def write_agent(directory, name: str, spec: str):
    """``directory/NAME.yaml``: an agent file whose ``spec:`` is ``spec`` (dedented YAML)."""
    import textwrap
    from pathlib import Path

    p = Path(directory) / f"{name}.yaml"
    p.write_text(f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
                 + textwrap.indent(textwrap.dedent(spec), "  "))
    return p


def release_workspaces(home) -> None:
    """Whatever a test left mounted under ``<home>/run/ws`` (images, the pool) unmounted, and the
    loop devices backed by files under the home detached: a home removed under an attached loop
    device keeps its space (and one of the host's few loop devices) allocated."""
    import subprocess
    from pathlib import Path

    h = Path(home)
    ws = h / "run" / "ws"
    for d in sorted(ws.glob("*"), reverse=True) if ws.is_dir() else ():
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
    r = subprocess.run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        dev, _, back = line.strip().partition(" ")
        if back.strip().removesuffix(" (deleted)").startswith(str(h) + "/"):
            subprocess.run(["losetup", "-d", dev], capture_output=True)
