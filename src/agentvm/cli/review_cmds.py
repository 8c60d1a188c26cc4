"""``agentvm diff NAME [PATH]``, ``agentvm accept NAME [PATHS...]``, ``agentvm discard NAME``,
``agentvm reviews``: the layers of review-mode grants (``mode: review``; agentvm.review).

NAME is the agent's name, or the run's id for an ``agentvm run`` without ``-f``. These work on
the layers under ``<home>/reviews`` directly (no daemon needed); accept and discard go on the
audit chain (``review.accepted``, ``review.discarded``), and so does every diff shown
(``review.diffed``, with the review id it showed).
"""

from __future__ import annotations

import json

import click


def _paths():
    from agentvm.paths import default_paths

    return default_paths()


def _record(paths):
    from agentvm.cli.workspace_cmds import recorder

    return recorder(paths)


@click.command("diff")
@click.argument("name")
@click.argument("path", required=False)
@click.option("--json", "as_json", is_flag=True, help="The changes as JSON.")
def diff(name, path, as_json):
    """What the agent changed in its review-mode grants: a unified diff for text, a line for
    binary files, mode and symlink changes, deletions; conflicts and refused entries flagged."""
    from agentvm import review

    paths = _paths()
    rv = review.load(paths.home, name, (path,) if path else ())
    # rendered first: a file the agent rewrote while it was shown withholds the id, and the
    # record says the id was not shown (it then names no content the operator saw)
    text = json.dumps(review.to_json(rv), sort_keys=True) if as_json else review.render(rv)
    shown = as_json or not rv.changed_while_shown
    _record(paths)("review.diffed", {"name": name, "review_id": rv.review_id, "changes": len(rv.changes),
                                     "conflicts": len(rv.conflicts), "path": path, "shown": shown,
                                     **({} if shown else {"changed_while_shown": rv.changed_while_shown[:20]})})
    click.echo(text, nl=as_json)
    return 0


@click.command("accept")
@click.argument("name")
@click.argument("paths_", metavar="[PATHS]...", nargs=-1)
@click.option("--expect", metavar="ID", help="Apply only if the changes are still exactly those of this review id "
              "(printed by `agentvm diff`); needed while the sandbox runs.")
@click.option("--json", "as_json", is_flag=True)
def accept(name, paths_, expect, as_json):
    """Apply the review layer's changes to the host folder: each file renamed into place, all or
    nothing; a path changed on the host since the sandbox started is a conflict (nothing applied)."""
    from agentvm import review

    paths = _paths()
    out = review.accept(paths.home, name, tuple(paths_), expect=expect, record=_record(paths))
    if as_json:
        click.echo(json.dumps(out, sort_keys=True))
    elif not out["applied"]:
        click.echo(f"{name}: nothing to apply")
    else:
        for p in out["applied"]:
            click.echo(f"applied {p}")
        click.echo(f"{name}: {len(out['applied'])} change(s) applied (review id {out['review_id']})")
    return 0


@click.command("discard")
@click.argument("name")
def discard(name):
    """Drop the review layer (refused while its sandbox runs)."""
    from agentvm import review

    paths = _paths()
    out = review.discard(paths.home, name, record=_record(paths))
    click.echo(f"{name}: review layer discarded ({out['discarded']})")
    return 0


@click.command("reviews")
@click.option("--json", "as_json", is_flag=True)
def reviews(as_json):
    """Every review layer kept: its name, agent or run, the folders, whether its sandbox runs."""
    from agentvm import review

    rows = review.list_layers(_paths().home)
    if as_json:
        click.echo(json.dumps({"reviews": rows}, sort_keys=True))
        return 0
    if not rows:
        click.echo("no review layers")
    for r in rows:
        click.echo(f"{r['name']:<32} {r['kind']:<6} {'running' if r['running'] else 'stopped':<8} "
                   + ", ".join(g or "?" for g in r["grants"]))
    return 0
