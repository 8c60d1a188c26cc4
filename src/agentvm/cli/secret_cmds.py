"""``agentvm secret set | list | rm | revoke | restore``: the operator's side of the vault.

A value never travels on the command line (argv is visible in ``ps`` and shell history):
``secret set`` reads it from stdin, from a hidden prompt, or from one of agent-vm's own
environment variables (``--from-env``). No command prints a value. Errors exit with the
codes of :mod:`agentvm.errors` (78 for every vault error).
"""

from __future__ import annotations

import json
import sys
import time

import click

from agentvm.errors import AgentVMError


def _fail(err: AgentVMError, as_json: bool = False) -> None:
    """Report an error the way ``agentvm.cli.report_error`` does and exit with its code."""
    if as_json:
        click.echo(json.dumps(err.to_dict(), indent=2))
    else:
        click.echo(f"agentvm: error [{err.code}]: {err.message}", err=True)
        if err.hint:
            click.echo(f"  hint: {err.hint}", err=True)
    raise click.exceptions.Exit(err.exit_code)


def _vault():
    from agentvm.vault import default_vault

    return default_vault()


def _time(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@click.group("secret")
def secret() -> None:
    """Manage the vault: the real values behind credential placeholders.

    Agents only see placeholders; the egress gate swaps in the value stored here. Refer to a
    stored secret from an agent file as `ref: vault:NAME`. No command ever prints a value.
    """


_NO_ARGV = (
    "the value cannot be given on the command line (argv is visible in ps and shell history); "
    "pipe it on stdin, use --from-env VAR, or run on a terminal to be prompted"
)


@secret.command(
    "set",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
@click.argument("name")
@click.option("--from-env", "from_env", metavar="VAR",
              help="Read the value from agent-vm's own environment variable VAR (e.g. in CI).")
@click.option("--kind", type=click.Choice(["oauth2-refresh", "aws-sts", "github-app", "ssh-key"]),
              help="Check the value's shape before storing it: a broker's JSON entry, or an OpenSSH private key.")
@click.pass_context
def set_cmd(ctx: click.Context, name: str, from_env: str | None, kind: str | None = None) -> None:
    """Store (or rotate) the secret NAME.

    The value is read from stdin when stdin is not a terminal (one trailing newline is
    removed), else prompted for twice without echo. It is never taken from the command line.
    """
    # Extra arguments are collected instead of letting click echo them in its usage error:
    # they may be the value itself.
    if ctx.args:
        raise click.UsageError(_NO_ARGV, ctx=ctx)
    from agentvm.vault import validate_value, validate_name

    try:
        validate_name(name)
        if from_env is not None:
            value = _vault().resolve(f"env:{from_env}")
        elif not _stdin_is_tty():
            value = _read_stdin(name)
        else:
            value = click.prompt(f"Value of secret {name}", hide_input=True, confirmation_prompt=True,
                                 show_default=False)
        validate_value(value, f"secret {name!r}")
        if kind is not None:
            _check_kind(name, kind, value)
        rotated = _vault().set(name, value)
    except AgentVMError as err:
        _fail(err)
        return
    click.echo(f"secret {name} {'rotated' if rotated else 'stored'}")


def _check_kind(name: str, kind: str, value: str) -> None:
    """The value's shape for ``--kind`` (the problems name fields, never a value)."""
    from agentvm.vault import InvalidSecretValue

    if kind == "ssh-key":
        from agentvm.gate.sshagent import load_key

        try:
            load_key(name, value, ())
        except ValueError:
            raise InvalidSecretValue(f"secret {name!r}: not an unencrypted OpenSSH private key",
                                     hint="store the key file itself: agentvm secret set NAME --kind ssh-key < KEYFILE "
                                          "(ssh-keygen -p -N '' -f KEYFILE removes a passphrase)") from None
        return
    from agentvm.gate.brokers import entry_problems

    problems = entry_problems(kind, value)
    if problems:
        raise InvalidSecretValue(f"secret {name!r} is no {kind} entry: " + "; ".join(problems),
                                 hint="see docs/credentials.md, Brokered credentials, for the entry's fields")


def _stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):  # closed or replaced stream
        return False


def _read_stdin(name: str) -> str:
    from agentvm.vault import MAX_VALUE_BYTES, InvalidSecretValue, _decode

    stream = sys.stdin.buffer
    data = stream.read(MAX_VALUE_BYTES + 3)
    if len(data) > MAX_VALUE_BYTES + 2 or stream.read(1):
        raise InvalidSecretValue(f"secret {name!r}: the value on stdin is larger than {MAX_VALUE_BYTES} bytes")
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise InvalidSecretValue(f"secret {name!r}: no value on stdin",
                                 hint=f"echo the value into `agentvm secret set {name}`, or run it on a terminal")
    text = _decode(data)  # not raised inside `except`: the UnicodeError would hold the value
    if text is None:
        raise InvalidSecretValue(f"secret {name!r}: the value on stdin is not UTF-8 text")
    return text


@secret.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def list_cmd(as_json: bool) -> None:
    """List the stored secrets: name, created, updated, revoked. Never their values."""
    try:
        infos = _vault().list()
    except AgentVMError as err:
        _fail(err, as_json)
        return
    if as_json:
        click.echo(json.dumps([i.to_dict() for i in infos], indent=2))
        return
    if not infos:
        click.echo("no secrets stored", err=True)
        return
    rows = []
    for i in infos:
        if i.revoked:
            rev = "yes"
        elif i.revoked_sandboxes:
            rev = "sandbox " + ",".join(i.revoked_sandboxes)
        else:
            rev = "no"
        rows.append((i.name, _time(i.created), _time(i.updated), rev))
    w0 = max([len("NAME")] + [len(r[0]) for r in rows])
    click.echo(f"{'NAME':<{w0}}  {'CREATED':<20}  {'UPDATED':<20}  REVOKED")
    for name, created, updated, rev in rows:
        click.echo(f"{name:<{w0}}  {created:<20}  {updated:<20}  {rev}")


@secret.command("rm")
@click.argument("name")
def rm_cmd(name: str) -> None:
    """Remove the secret NAME and its revocations."""
    try:
        _vault().remove(name)
    except AgentVMError as err:
        _fail(err)
        return
    click.echo(f"secret {name} removed")


_sandbox_option = click.option("--sandbox", "sandbox_id", metavar="ID",
                               help="Only for this sandbox (default: everywhere).")


@secret.command("revoke")
@click.argument("name")
@_sandbox_option
def revoke_cmd(name: str, sandbox_id: str | None) -> None:
    """Stop the gate from substituting NAME, everywhere or for one sandbox.

    Takes effect at the next request of a running gate.
    """
    try:
        changed = _vault().revoke(name, sandbox_id)
    except AgentVMError as err:
        _fail(err)
        return
    where = f" for sandbox {sandbox_id}" if sandbox_id else ""
    click.echo(f"secret {name} {'revoked' if changed else 'was already revoked'}{where}")


@secret.command("restore")
@click.argument("name")
@_sandbox_option
def restore_cmd(name: str, sandbox_id: str | None) -> None:
    """Undo a revocation of NAME (the same scope: everywhere, or --sandbox ID)."""
    try:
        changed = _vault().restore(name, sandbox_id)
    except AgentVMError as err:
        _fail(err)
        return
    where = f" for sandbox {sandbox_id}" if sandbox_id else ""
    click.echo(f"secret {name} {'restored' if changed else 'was not revoked'}{where}")
