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
