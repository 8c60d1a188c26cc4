"""Helpers shared by the attack suite (plain functions; fixtures live in conftest.py).

Every attack runs real hostile code inside the real sandbox through the real CLI; the
helpers here only build inputs (C programs, agent files, canaries) and inspect the host.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess


from tests.helpers import ROOT, last_json, needs_root, parse_table  # noqa: F401 (re-exported)


def token(prefix: str = "canary") -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def body(stdout: str) -> str:
    """stdout without the trailing --json line."""
    lines = stdout.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if lines and lines[-1].startswith("{"):
        lines.pop()
    return "\n".join(lines)


def real_uid_processes(uid: int) -> list[tuple[int, str]]:
    """Every host process whose real, effective or saved uid is ``uid`` (reads every
    /proc/<pid>/status: a non-dumpable process's /proc dir is owned by root, so the owner of
    the directory is not a reliable filter)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                st = fh.read()
        except OSError:
            continue
        state, uids = "?", []
        for line in st.splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                uids = [int(x) for x in line.split()[1:]]
        if uid in uids[:3] and state not in ("Z", "X"):
            out.append((int(name), state))
    return out


def describe_pids(pids) -> str:
    out = []
    for pid, _state in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        out.append(f"{pid}: {cmd[:200]}")
    return "; ".join(out)


def agent_yaml(path, name: str, command: list[str] | None = None, disk: str = "32M", extra_limits: str = "") -> str:
    cmd = command or ["/bin/true"]
    text = (
        "apiVersion: agentvm/v1\n"
        "kind: Agent\n"
        "metadata:\n"
        f"  name: {name}\n"
        "spec:\n"
        f"  command: {json.dumps(cmd)}\n"
        "  limits:\n"
        f"    disk: {disk}\n"
        f"{extra_limits}"
    )
    with open(path, "w") as fh:
        fh.write(text)
    return str(path)


def compile_static(src: str, out: str, extra: tuple[str, ...] = ()) -> None:
    c = out + ".c"
    with open(c, "w") as fh:
        fh.write(src)
    r = subprocess.run(["gcc", "-static", "-O1", "-w", "-o", out, c, *extra], capture_output=True, text=True)
    assert r.returncode == 0, f"gcc failed:\n{r.stderr}"
    os.chmod(out, 0o755)


def dump(r) -> str:
    """A CompletedProcess as evidence for an assertion message."""
    so = r.stdout if isinstance(r.stdout, str) else r.stdout.decode(errors="replace")
    se = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    return f"\n--- exit {r.returncode}\n--- stdout:\n{so[-4000:]}\n--- stderr:\n{se[-4000:]}"
