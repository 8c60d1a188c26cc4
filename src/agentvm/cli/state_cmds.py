"""`agentvm pause|unpause|suspend|resume NAME` (issue 37): state you control.

* pause/unpause: the cgroup freezer - memory and every host resource kept, CPU zero; any
  substrate with a freezer (bubblewrap too).
* suspend/resume: the sandbox's whole state written to a root-only checkpoint and every host
  resource freed; resumed on the same policy with its processes continuing. gVisor only:
  bubblewrap refuses (``backend.suspend-unsupported``) rather than come back weaker.
"""

from __future__ import annotations

import click


def _client():
    from agentvm.daemon.client import Client

    return Client()


def _verb(action: str, doc: str):
    @click.command(name=action, help=doc)
    @click.argument("name")
    def cmd(name):
        ans = _client().action(name, action)
        extra = ""
        if action == "suspend" and ans.get("checkpoint"):
            c = ans["checkpoint"]
            extra = f" (checkpoint {c['bytes'] / 2**20:.1f} MiB in {c['seconds']:.2f}s, binding {c['binding'][:16]})"
        elif action == "resume" and "resume_seconds" in ans:
            extra = f" (resumed in {ans['resume_seconds']:.2f}s)"
        click.echo(f"{name}: {ans['state']}{extra}")
        return 0

    return cmd


pause = _verb("pause", "Freeze a sandbox (cgroup freezer): memory and resources kept, CPU zero.")
unpause = _verb("unpause", "Thaw a paused sandbox.")
suspend = _verb("suspend", "Checkpoint a sandbox to disk and free every host resource it held (gVisor).")
resume = _verb("resume", "Restore a suspended sandbox, its processes continuing (its checkpoint is checked first).")


# ---------------------------------------------------------------- snapshots, fork, restore
class _SnapshotGroup(click.Group):
    """``agentvm snapshot NAME [--tag T]`` takes one; ``snapshot ls`` / ``snapshot rm ID`` manage them."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands:
            return "take", self.commands["take"], args
        return super().resolve_command(ctx, args)


@click.group(cls=_SnapshotGroup, invoke_without_command=False,
             help="Snapshot an agent's workspace (`agentvm snapshot NAME [--tag T]`), list (`ls`) or remove (`rm`).")
def snapshot():
    pass


@snapshot.command("take", hidden=True)
@click.argument("name")
@click.option("--tag", help="A name for it (`agentvm fork NAME:TAG NEW`, `agentvm restore NAME TAG`).")
@click.option("--memory", is_flag=True, help="Its processes' memory too (gVisor: a checkpoint; the agent runs on). "
                                              "`agentvm fork` of it restores them in a new sandbox.")
def snapshot_take(name, tag, memory):
    from urllib.parse import quote

    body = {"tag": tag} if tag else {}
    if memory:
        body["memory"] = True
    s = _client().request("POST", f"/v1/sandboxes/{quote(name)}/snapshot", body)
    click.echo(f"{s['id'][:16]}  {name}{':' + tag if tag else ''}  {s['files']} files, {s['bytes']} bytes"
               + (" + memory" if s.get("memory_digest") else "")
               + (f" ({s['skipped']} links or special files left out)" if s["skipped"] else ""))
    return 0


@snapshot.command("ls")
@click.option("--json", "as_json", is_flag=True)
def snapshot_ls(as_json):
    import json
    import time

    rows = _client().request("GET", "/v1/snapshots")
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return 0
    for s in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s["created"]))
        click.echo(f"{s['id'][:16]}  {s['agent']:<20} {s['tag'] or '-':<16} {s['bytes']:>10}  {when}  "
                   f"policy {s['policy_digest'][:12]}  image {s['image'][:19]}")
    return 0


@snapshot.command("rm")
@click.argument("ref")
def snapshot_rm(ref):
    from urllib.parse import quote

    ans = _client().request("DELETE", f"/v1/snapshots/{quote(ref)}")
    click.echo(f"removed {ans['removed'][:16]}")
    return 0


@click.command(help="Start a new agent NEW from an agent (snapshotted now) or a snapshot (id, tag or NAME:TAG): "
                    "its workspace, a new uid and fresh credential placeholders.")
@click.argument("source")
@click.argument("new")
@click.option("--memory", is_flag=True, help="From an agent: snapshot its memory too and restore its processes in "
                                              "NEW (gVisor). A memory snapshot is always forked with its memory.")
def fork(source, new, memory):
    body = {"source": source, "new": new}
    if memory:
        body["memory"] = True
    row = _client().request("POST", "/v1/fork", body)
    click.echo(f"{new}: {row['state']} (fork of {source})")
    return 0


@click.command(help="Roll agent NAME back to one of its snapshots (stopped, workspace replaced, started).")
@click.argument("name")
@click.argument("snapshot_ref", metavar="SNAPSHOT")
def restore(name, snapshot_ref):
    from urllib.parse import quote

    row = _client().request("POST", f"/v1/sandboxes/{quote(name)}/restore", {"snapshot": snapshot_ref})
    click.echo(f"{name}: {row['state']} (restored to {snapshot_ref})")
    return 0
