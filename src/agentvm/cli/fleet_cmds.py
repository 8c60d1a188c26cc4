"""`agentvm plan | apply | status | rollback`: promotion of a fleet repository's exact commit
(docs/promotion.md). The daemon reads the repository itself (it must be on the daemon's host)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from agentvm.errors import ConfigError


def _client():
    from agentvm.daemon.client import Client

    return Client()


def _repo(repo: str | None) -> str:
    p = Path(repo or ".").resolve()
    if not p.is_dir():
        raise ConfigError(f"{p} is not a directory", hint="--repo names the fleet's git repository")
    return str(p)


def _replay_doc(replay: bool, since, last: int | None):
    if not replay and since is None and last is None:
        return None
    return {"since": since, "last": last or 1000}


def print_plan(plan: dict) -> None:
    click.echo(f"plan: {plan['repo']} at {plan['commit']}" + (f" ({plan['ref']})" if plan.get("ref") and
                                                              plan["ref"] != plan["commit"] else ""))
    click.echo(f"  now applied: {plan['previous'] or '(nothing from a fleet yet)'}"
               + (f"; signed by {plan['signed']}" if plan.get("signed") else ""))
    marks = {"create": "+", "update": "~", "remove": "-"}
    same = []
    for a in plan["actions"]:
        if a["kind"] == "unchanged":
            same.append(a["name"])
            continue
        click.echo(f"  {marks[a['kind']]} {a['kind']:<7} {a['name']}" + (f"  ({a['path']})" if a.get("path") else "")
                   + ("  restart" if a.get("restart") else ""))
        for c in a.get("changes") or []:
            if c != "new agent":
                click.echo(f"        {c}")
        for w in a.get("widening") or []:
            click.echo(f"        WIDENS: {w}")
        r = a.get("replay")
        if r:
            click.echo(f"        replay of {r['replayed']} recorded decisions: {len(r['breakage'])} would break, "
                       f"{len(r['widening'])} would newly be allowed")
            for b in r["breakage"][:10]:
                click.echo(f"          BREAKS: {b['request']} ({b['count']}x allowed today)")
            for w in r["widening"][:10]:
                click.echo(f"          ALLOWS: {w['request']} ({w['count']}x denied today)")
    if same:
        click.echo(f"  = unchanged: {', '.join(same)}")
    if plan.get("unmanaged"):
        click.echo(f"  not from a fleet (left alone): {', '.join(plan['unmanaged'])}")
    click.echo(f"  {plan['changes']} change(s), {plan['widening']} widening; plan digest {plan['digest']}")


@click.command()
@click.option("--repo", type=click.Path(file_okay=False), help="The fleet's git repository (default: this folder).")
@click.option("--commit", "ref", default="HEAD", show_default=True, help="A commit, branch or tag.")
@click.option("--replay", is_flag=True, help="Replay each changed agent's recorded egress decisions against its new policy.")
@click.option("--since", type=float, help="Replay decisions from this Unix time on.")
@click.option("--last", type=int, help="Replay at most this many recent decisions per agent (default 1000).")
@click.option("--fail-on-breakage", is_flag=True, help="Exit 1 when the replay finds a request the new policy would break.")
@click.option("--json", "as_json", is_flag=True)
def plan(repo, ref, replay, since, last, fail_on_breakage, as_json):
    """Show what applying a commit would change (changes nothing)."""
    doc = {"repo": _repo(repo), "commit": ref}
    rp = _replay_doc(replay or fail_on_breakage, since, last)
    if rp is not None:
        doc["replay"] = rp
    p = _client().fleet("plan", doc)
    if as_json:
        click.echo(json.dumps(p, sort_keys=True))
    else:
        print_plan(p)
    broken = sum(len((a.get("replay") or {}).get("breakage", [])) for a in p["actions"])
    return 1 if fail_on_breakage and broken else 0


@click.command()
@click.option("--repo", type=click.Path(file_okay=False), help="The fleet's git repository (default: this folder).")
@click.option("--commit", "ref", required=True, help="The full commit id to apply (a ref needs --yes).")
@click.option("--yes", is_flag=True, help="Apply the commit a branch, tag or short id resolves to (it is shown first).")
@click.option("--plan-digest", help="Apply only if the plan is still this one (from `agentvm plan`).")
@click.option("--canary", is_flag=True, help="Every updated agent must stay up and pass its health check, or it is "
              "rolled back and the apply stops.")
@click.option("--json", "as_json", is_flag=True)
def apply(repo, ref, yes, plan_digest, canary, as_json):
    """Apply exactly one commit of the fleet repository."""
    from agentvm.fleet import is_full_id

    c = _client()
    p = c.fleet("plan", {"repo": _repo(repo), "commit": ref})
    if not is_full_id(ref):
        click.echo(f"agentvm: {ref} resolves to {p['commit']}", err=True)
        if not yes:
            raise ConfigError(f"apply takes a full commit id; {ref!r} is a ref", code="fleet.not-a-commit-id",
                              hint=f"agentvm apply --commit {p['commit']} (or add --yes to apply what {ref} names now)")
    if not as_json:
        print_plan(p)
    if plan_digest and plan_digest != p["digest"]:
        raise ConfigError("the plan changed since it was shown", code="fleet.plan-changed",
                          hint="run `agentvm plan` again and review it")
    r = c.fleet("apply", {"repo": p["repo"], "commit": p["commit"], "digest": plan_digest or p["digest"],
                          "canary": canary})
    if as_json:
        click.echo(json.dumps(r, sort_keys=True))
    else:
        _say(r)
    return 0 if r["result"] in ("applied", "rolled-back") else 1


def _say(r: dict) -> None:
    if r["failure"]:
        f = r["failure"]
        click.echo(f"agentvm: {r['result']}: {f['agent']}: {f['message']}", err=True)
    click.echo(f"{r['result']}: {r['commit']} ({len(r['done'])} agent(s) changed"
               + (f": {', '.join(r['done'])}" if r["done"] else "") + ")")


@click.command()
@click.option("--json", "as_json", is_flag=True)
def status(as_json):
    """Per agent: the commit it runs, the desired commit, and drift. Exit 1 when anything drifted."""
    s = _client().fleet("status")
    if as_json:
        click.echo(json.dumps(s, sort_keys=True))
        return 1 if s["drift"] else 0
    click.echo(f"desired commit: {s['desired'] or '(nothing applied from a fleet)'}")
    for a in s["agents"]:
        commit = (a["commit"] or "-")[:12]
        how = "not from a fleet (left alone)" if a.get("unmanaged") else ("; ".join(a["drift"]) or "in sync")
        click.echo(f"  {a['name']:<24} {a['state']:<9} {commit:<12} " + how)
    last = s["promotions"][:1]
    if last:
        x = last[0]
        click.echo(f"last promotion: {x['commit'][:12]} {x['result']} by {x['actor']} at "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(x['time']))}")
    click.echo("drift" if s["drift"] else "no drift")
    gate = s.get("gate") or {}
    if gate.get("warning"):  # an unconfined or shared gate: said every time, not only at `up`
        click.echo(f"warning: {gate['warning']}", err=True)
    return 1 if s["drift"] else 0


@click.command()
@click.option("--to", help="A commit applied earlier (default: the one before the last promotion).")
@click.option("--json", "as_json", is_flag=True)
def rollback(to, as_json):
    """Go back to the previous promotion (or --to an earlier one), with the same machinery."""
    r = _client().fleet("rollback", {"to": to} if to else {})
    if as_json:
        click.echo(json.dumps(r, sort_keys=True))
    else:
        _say(r)
    return 0 if r["result"] in ("applied", "rolled-back") else 1
