"""``agentvm run``: one command in an ephemeral sandbox (or in a declared agent's sandbox).

Contract (stable; see docs/cli.md)::

    agentvm run [-f AGENT.yaml] [--mount HOST:PATH[:ro|rw]]... [--timeout DURATION]
                [--memory SIZE] [--env K=V]... [--json] [--tty/--no-tty]
                [--degrade PRIMITIVE]... -- CMD [ARGS...]

Exit code: the command's own; 124 on timeout; 77 when refused (policy, missing primitive);
78 for an invalid agent file or option; 125 when agent-vm or the substrate failed; 128+N
when the command died of signal N.
"""

from __future__ import annotations

import json
import sys

import click

from agentvm.errors import ConfigError


def _parse_env(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise ConfigError(f"invalid --env {v!r}", hint="use --env NAME=VALUE")
        out[k] = val
    return out


@click.command(context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@click.option("-f", "--file", "agent_file", type=click.Path(dir_okay=False), help="Agent file (YAML).")
@click.option("--mount", "mounts", multiple=True, metavar="HOST:PATH[:ro|rw]", help="Grant a host folder.")
@click.option("--timeout", metavar="DURATION", help="Wall-clock timeout, e.g. 30s, 5m.")
@click.option("--memory", metavar="SIZE", help="Memory limit, e.g. 256M, 2G.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Set a variable in the sandbox.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable result as the last stdout line.")
@click.option("--tty/--no-tty", default=None, help="Give the sandbox a terminal (default: if stdin/stdout are terminals).")
@click.option(
    "--degrade",
    multiple=True,
    metavar="PRIMITIVE",
    help="Run without a missing primitive (e.g. landlock). Printed and recorded. Never silent.",
)
@click.option("--preset-path", "preset_dirs", multiple=True, type=click.Path(file_okay=False), hidden=True)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(agent_file, mounts, timeout, memory, envs, as_json, tty, degrade, preset_dirs, command):
    """Run CMD in a fresh sandbox and propagate its exit code."""
    from agentvm.policy import Policy, parse_mount_arg, with_overrides
    from agentvm.units import parse_duration, parse_size

    if agent_file:
        from pathlib import Path

        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent

        loaded = load_agent(Path(agent_file), preset_dirs=[Path(p) for p in preset_dirs] or None)
        policy = compile_policy(loaded.spec)
    else:
        if not command:
            raise ConfigError("nothing to run", hint="agentvm run -- CMD [ARGS...], or agentvm run -f AGENT.yaml")
        policy = Policy(name="run")
    try:
        t = parse_duration(timeout) if timeout is not None else None
        m = parse_size(memory) if memory is not None else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    policy = with_overrides(
        policy,
        command=tuple(command) or None,
        mounts=tuple(parse_mount_arg(x) for x in mounts),
        env=_parse_env(envs),
        timeout=t,
        memory=m,
    )
    if not policy.command:
        raise ConfigError("the agent file declares no command and none was given after --")
    if degrade:
        click.secho(
            "agentvm: WARNING: running DEGRADED without: " + ", ".join(degrade) + " (recorded in the audit log)",
            fg="red",
            bold=True,
            err=True,
        )

    from agentvm.runtime import Runtime

    rt = Runtime()
    result = rt.run(policy, degrade=tuple(degrade), tty=tty if tty is not None else None)
    _report(result, as_json)
    return result.exit_code


def _report(result, as_json: bool) -> None:
    if as_json:
        sys.stdout.flush()
        click.echo(json.dumps(result.to_dict(), sort_keys=True))
        return
    err = result.setup_error
    if err:
        if err.get("step") == "exec":
            click.echo(f"agentvm: cannot execute: {err.get('message')}", err=True)
        else:
            click.echo(f"agentvm: sandbox setup failed at step '{err.get('step')}': {err.get('message')}", err=True)
    if result.timed_out:
        click.echo(f"agentvm: timed out after {result.duration:.1f}s; the sandbox was killed", err=True)
    if result.oom_killed:
        click.echo("agentvm: the memory limit was hit (a process was OOM-killed inside the sandbox)", err=True)
    if result.pids_limit_hit:
        click.echo("agentvm: the process limit was hit (fork refused inside the sandbox)", err=True)
    if not result.teardown.get("verified"):
        click.echo(f"agentvm: error: teardown NOT verified: {json.dumps(result.teardown)}", err=True)
