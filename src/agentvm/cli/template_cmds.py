"""``agentvm template add FILE | set NAME | ls``: agent files registered by name as E2B
templates, each one tenant's or public (docs/e2b.md "Templates and tenants"). ``base`` is
built in and public: the default anonymous policy."""

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
@click.option("--tenant", help="The only tenant whose API keys may create from it (default: 'default').")
@click.option("--public", is_flag=True, help="Every tenant may create from it (only for templates that grant "
                                              "nothing of one tenant's: no host folders, no credentials).")
def add(file, name, ports, tenant, public):
    """Register (or replace) a template from an agent file."""
    from agentvm.e2b import templates

    t = templates.add(file, name, list(ports), tenant=tenant, public=public)
    click.echo(f"template {t.name} <- {t.source} for {_owner(t)}"
               + (f" (ports {', '.join(map(str, t.ports))})" if t.ports else ""))


def _owner(t) -> str:
    return "every tenant (public)" if t.public else f"tenant {t.tenant}" if t.tenant else \
        "no tenant (registered before templates had tenants; `agentvm template set NAME --tenant T`)"


@template.command("set")
@click.argument("name")
@click.option("--tenant", help="The only tenant whose API keys may create from it.")
@click.option("--public", is_flag=True, help="Every tenant may create from it.")
def set_owner(name, tenant, public):
    """Give a registered template to one tenant, or to every tenant."""
    from agentvm.e2b import templates

    t = templates.assign(name, tenant=tenant, public=public)
    click.echo(f"template {t.name} for {_owner(t)}")


@template.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json):
    """List templates."""
    from agentvm.e2b import templates

    tpls = templates.ls()
    rows = [{"name": t.name, "source": t.source, "ports": list(t.ports), "tenant": t.tenant, "public": t.public}
            for t in tpls]
    if as_json:
        click.echo(json.dumps(rows))
        return
    for t, r in zip(tpls, rows):
        click.echo(f"{r['name']:<24} {r['source']}" + (f"  ports {r['ports']}" if r["ports"] else "")
                   + f"  for {_owner(t)}")
