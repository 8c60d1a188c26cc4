"""``agentvm doctor``: report the host's primitives; non-zero if the default substrate
cannot give its guarantees."""

from __future__ import annotations

import json

import click

from agentvm.errors import EXIT_POLICY


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option("--no-smoke", is_flag=True, help="Skip the live sandbox smoke test.")
@click.option("--substrate", type=click.Choice(["bwrap", "gvisor"]), default="bwrap", show_default=True,
              help="The substrate to check.")
def doctor(as_json: bool, no_smoke: bool, substrate: str) -> int:
    """Check what this host can guarantee (exit 77 if the substrate cannot)."""
    from agentvm.doctor import run_doctor

    rep = run_doctor(smoke=not no_smoke, substrate=substrate)
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=2, sort_keys=True))
        return 0 if rep.ok else EXIT_POLICY
    click.echo(f"agentvm doctor - substrate {rep.substrate} on kernel {rep.facts.get('kernel')}")
    for p in rep.primitives:
        need = "required" if p.name in rep.required else "optional"
        mark = click.style(" ok ", fg="green") if p.ok else click.style("FAIL" if need == "required" else " -- ", fg="red" if need == "required" else "yellow")
        click.echo(f"  [{mark}] {p.name:<15} {p.detail}  ({need})")
    click.echo("  tuning and stronger substrates (optional):")
    for p in rep.extras:
        mark = click.style(" ok ", fg="green") if p.ok else click.style(" -- ", fg="yellow")
        click.echo(f"  [{mark}] {p.name:<15} {p.detail}")
    _workspaces(rep.workspaces)
    if rep.ok:
        click.echo(f"result: the {rep.substrate} substrate can give all its guarantees on this host")
        return 0
    missing = [p.name for p in rep.primitives if p.name in rep.required and not p.ok]
    click.echo(f"result: NOT OK - missing: {', '.join(missing)}; `agentvm run` will refuse to start", err=True)
    return EXIT_POLICY


def _workspaces(u: dict | None) -> None:
    if not u:
        return
    from agentvm.workspace import human

    click.echo(f"  workspaces: {u['count']} in {u['path']}: {human(u['committed'])} committed, {human(u['used'])} "
               f"used; {human(u['fs_free'])} free on its filesystem ({u['fs_use']:.0%} full)")
    for w in u.get("warnings", []):
        click.echo(click.style("  warning: ", fg="yellow") + w)
