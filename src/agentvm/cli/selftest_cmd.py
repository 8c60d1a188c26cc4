"""``agentvm selftest``: run the shipped red-team suite against this host."""

from __future__ import annotations

import click

from agentvm.errors import EXIT_BACKEND, EXIT_POLICY


@click.command()
@click.option("--substrate", type=click.Choice(["bwrap", "gvisor"]), default="bwrap", show_default=True,
              help="Substrate to attack.")
@click.option("--image", default=None, metavar="REF",
              help="Attack sandboxes whose root is this image (`agentvm image ls`) instead of the host's /usr.")
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable).")
@click.option("--case", "ids", multiple=True, help="Only these case ids (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option("--list", "list_only", is_flag=True, help="List the cases instead of running them.")
@click.option("--markdown", is_flag=True, help="With --list: print docs/security-tests.md.")
@click.option("--weaken", default="none", hidden=True,
              help="Run against a deliberately weakened configuration (proves the cases can fail; never for real use).")
@click.option("--keep", is_flag=True, hidden=True, help="Keep the canary environment for inspection.")
def selftest(substrate, image, categories, ids, as_json, list_only, markdown, weaken, keep):
    """Attack real sandboxes on this host; exit non-zero if anything escapes."""
    from agentvm.selftest import runner

    from agentvm.selftest.framework import POLICY_WEAKENINGS

    if substrate != "bwrap" and weaken != "none" and not set(weaken.split("+")) <= POLICY_WEAKENINGS:
        from agentvm.errors import ConfigError

        raise ConfigError(f"on the {substrate} substrate only these weakenings exist: " + ", ".join(sorted(POLICY_WEAKENINGS)))
    if list_only:
        if markdown:
            click.echo(runner.markdown())
        else:
            for c in runner.select(tuple(categories), tuple(ids)):
                click.echo(f"{c.id:<40} {c.category:<14} {c.title}")
        return 0
    report = runner.run(tuple(categories), tuple(ids), weaken=weaken, keep=keep, substrate=substrate, image=image)
    click.echo(runner.to_json(report) if as_json else runner.render_text(report))
    if report["escaped"]:
        return EXIT_POLICY
    if report["errors"]:
        return EXIT_BACKEND
    return 0
