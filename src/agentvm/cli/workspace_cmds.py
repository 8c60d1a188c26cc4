"""``agentvm workspace ls | rm NAME | prune --unused-for D``: the durable workspaces (in the
pool, or images under ``<home>/workspaces``) - those kept after their agent was removed, and those of agents run
with ``run -f`` only. Works with or without the daemon (it reads the daemon's state to tell
which workspaces an agent still owns); a removal goes on the audit chain
(``workspace.removed``, with the bytes it freed), and a workspace in use is never removed.
"""

from __future__ import annotations

import json
import time

import click

from agentvm.cli.common import recorder  # noqa: F401 - (review_cmds imports it from here)


def _paths():
    from agentvm.paths import default_paths

    return default_paths()


def _owners(paths):
    from agentvm.workspace import registered_agents

    return registered_agents(paths.home)


def _when(t: float) -> str:
    ago = max(0.0, time.time() - t)
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if ago >= secs:
            return f"{int(ago // secs)}{unit} ago"
    return "just now"


@click.group()
def workspace():
    """Durable agent workspaces: list them, remove one, prune the unused."""


@workspace.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls_cmd(as_json):
    """Every workspace: name, size, used, last use, owning agent or "(removed)"."""
    from agentvm.workspace import human, list_workspaces, usage

    paths = _paths()
    owners = _owners(paths)
    rows = list_workspaces(paths.workspaces, runtime=paths.runtime, owners=owners)
    if as_json:
        click.echo(json.dumps({"workspaces": [w.to_dict() for w in rows], "usage": usage(paths.workspaces).to_dict()},
                              sort_keys=True))
        return 0
    if not rows:
        click.echo(f"no workspaces ({paths.workspaces})")
        return 0
    click.echo(f"{'NAME':<32} {'SIZE':>8} {'USED':>8}  {'LAST USE':<12} AGENT")
    for w in rows:
        owner = w.owner if w.owner else ("?" if owners is None else "(removed)")
        size = human(w.size) if w.kind in ("image", "pool") else "-"
        click.echo(f"{w.name:<32} {size:>8} {human(w.used):>8}  {_when(w.last_use):<12} {owner}"
                   + ("  [in use]" if w.in_use else ""))
    u = usage(paths.workspaces)
    click.echo(f"{u.count} workspaces: {human(u.committed)} committed, {human(u.used)} used; "
               f"{human(u.fs_free)} free on the filesystem ({u.fs_use:.0%} full)")
    if u.pool and u.pool.get("free") is not None:
        click.echo(f"pool: {human(u.pool['free'])} free of {human(u.pool['size'])} "
                   f"({human(u.pool['reserved'])} reserved on the host)")
    click.echo(f"new workspaces: {u.backend}")
    return 0


@workspace.command("rm")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
def rm_cmd(names):
    """Remove workspaces (refused while one is in use, or while its agent is registered)."""
    from agentvm.errors import PolicyDenied
    from agentvm.workspace import human, remove_workspace

    paths = _paths()
    owners = _owners(paths)
    record = recorder(paths)
    for name in names:
        if owners is not None and name in owners:
            raise PolicyDenied(f"the workspace {name!r} belongs to the agent {name!r}, still registered with the daemon",
                               hint=f"`agentvm rm {name}` removes the agent and its workspace", code="workspace.owned")
        freed = remove_workspace(paths.workspaces, name, runtime=paths.runtime, record=record)
        click.echo(f"{name}: workspace removed ({human(freed)} freed)")
    return 0


def _duration():
    from agentvm.cli.common import duration

    return duration()


@workspace.command("prune")
@click.option("--unused-for", "unused_for", type=_duration(), required=True, metavar="DURATION",
              help="Remove those last used longer ago than this (e.g. 7d, 12h).")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True)
def prune_cmd(unused_for, dry_run, as_json):
    """Remove the workspaces no agent owns that were last used longer ago than --unused-for."""
    from agentvm.workspace import human, prune

    paths = _paths()
    out = prune(paths.workspaces, unused_for, runtime=paths.runtime, owners=_owners(paths), dry_run=dry_run,
                record=recorder(paths))
    if as_json:
        click.echo(json.dumps({"removed" if not dry_run else "would_remove": [{"name": n, "bytes": b} for n, b in out],
                               "bytes": sum(b for _, b in out)}, sort_keys=True))
        return 0
    verb = "would remove" if dry_run else "removed"
    for n, b in out:
        click.echo(f"{n}: {verb} ({human(b)})")
    click.echo(f"{len(out)} workspaces {verb}, {human(sum(b for _, b in out))}"
               + (" would be freed" if dry_run else " freed"))
    return 0
