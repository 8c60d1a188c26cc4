"""``agentvm template add FILE | ls``: agent files registered by name as E2B templates
(docs/e2b.md). ``base`` is built in: the default anonymous policy."""

from __future__ import annotations

import json

import click


@click.group()
def template():
    """E2B templates: agent files by name (Sandbox.create(template=NAME))."""


@template.command("add")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", help="Template name (default: the agent's metadata.name).")
@click.option("--port", "ports", type=int, multiple=True, help="A sandbox port get_host() may reach (repeatable).")
def add(file, name, ports):
    """Register (or replace) a template from an agent file."""
    from agentvm.e2b import templates

    t = templates.add(file, name, list(ports))
    click.echo(f"template {t.name} <- {t.source}" + (f" (ports {', '.join(map(str, t.ports))})" if t.ports else ""))


@template.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json):
    """List templates."""
    from agentvm.e2b import templates

    rows = [{"name": t.name, "source": t.source, "ports": list(t.ports)} for t in templates.ls()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        click.echo(f"{r['name']:<24} {r['source']}" + (f"  ports {r['ports']}" if r["ports"] else ""))
