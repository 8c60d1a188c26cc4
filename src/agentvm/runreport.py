"""What ``agentvm run`` prints on stderr about a run (timeout, limits hit, denied egress, an
unverified teardown) and about a refusal, rendered from the run's result dict.

One renderer for both paths: the embedded run prints it itself; through the daemon the thin
client gets the text already rendered (``agentvm.cli.fastrun``), so it needs no JSON parser,
or the result as JSON (``--json`` and the API) and renders it with this same code.
"""

from __future__ import annotations

import json


def error_text(code: str, message: str, hint: str = "") -> str:
    """An agent-vm error as every command prints it."""
    out = f"agentvm: error [{code}]: {message}\n"
    if hint:
        out += f"  hint: {hint}\n"
    return out


def render(result: dict) -> str:
    """The stderr report of a run (``""`` when there is nothing to say)."""
    lines: list[str] = []
    say = lines.append
    err = result.get("setup_error")
    if err:
        if err.get("step") == "exec":
            say(f"agentvm: cannot execute: {err.get('message')}")
        else:
            say(f"agentvm: sandbox setup failed at step '{err.get('step')}': {err.get('message')}")
        if err.get("hint"):
            say(f"  hint: {err['hint']}")
    lim = result.get("limits") or {}
    if result.get("timed_out"):
        say(f"agentvm: timed out after {result.get('duration', 0.0):.1f}s; the sandbox was killed "
            "(raise it with --timeout or limits.timeout in the agent file)")
    if result.get("oom_killed"):
        from agentvm.units import format_size

        limit = f" ({format_size(lim['memory'])})" if lim.get("memory") else ""
        say(f"agentvm: the memory limit{limit} was hit (a process was OOM-killed inside the sandbox): raise it with "
            "--memory 2G or limits.memory in the agent file (the presets 'jupyter' and 'browser' give 2G)")
    if result.get("pids_limit_hit"):
        limit = f" ({lim['pids']})" if lim.get("pids") else ""
        say(f"agentvm: the task limit{limit} was hit (a fork or thread was refused inside the sandbox; threads "
            "count): raise limits.pids in the agent file (the presets 'build' and 'browser' give 1024)")
    disk = result.get("disk") or {}
    if disk.get("pool_full"):
        size, free = disk.get("pool_size") or 0, disk.get("pool_free") or 0
        say(f"agentvm: the workspace pool is full: {_size(max(0, size - free))} of {_size(size)} used; the agent's "
            f"writes failed with ENOSPC (its own use: {_size(disk.get('used') or 0)} of its limit "
            f"{_size(disk.get('limit') or 0)}). Other agents overcommitted the pool "
            "(AGENTVM_WORKSPACE_OVERCOMMIT > 1): stop an agent, free space on the host, or lower the factor")
    elif disk.get("limit_hit"):
        say(f"agentvm: the workspace's disk limit ({_size(disk.get('limit') or 0)}) was hit: "
            f"{_size(disk.get('used') or 0)} used; writes past it failed with EDQUOT (Disk quota exceeded): "
            "raise limits.disk in the agent file or remove files from the workspace")
    eg = result.get("egress")
    if eg and eg.get("denied"):
        from agentvm.gate.policy import _safe as printable  # what a sandbox sent: printable ASCII only

        total = sum(d["count"] for d in eg["denied"])
        say(f"agentvm: egress: {eg['allowed']} allowed, {total} denied (log: {eg['log']})")
        for d in eg["denied"][:20]:
            why = f": {printable(d['reason'], 400)}" if d.get("reason") else ""
            say(f"agentvm:   denied {printable(d['target'], 300)} by {printable(d['rule'], 200)} x{d['count']}{why}")
            if d.get("how_to_allow"):
                say(f"agentvm:     to allow it: {printable(d['how_to_allow'], 1000)}")
    teardown = result.get("teardown") or {}
    if not teardown.get("verified"):
        say(f"agentvm: error: teardown NOT verified: {json.dumps(teardown)}")
    return "".join(ln + "\n" for ln in lines)


def _size(n: int) -> str:
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.1f}{unit}"
    return f"{n}B"
