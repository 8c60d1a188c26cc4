"""The click application behind every ``agentvm`` command except the hot ``run`` path.

Subcommands live in their own modules and are imported only when invoked, so a command
does not pay for pydantic/YAML imports it does not need.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import click

from agentvm import __version__
from agentvm.cli.report import report_error
from agentvm.errors import EXIT_BACKEND, EXIT_CONFIG, AgentVMError

# name -> "module:attribute"
_COMMANDS: dict[str, str] = {
    "run": "agentvm.cli.run_cmd:run_click",
    "doctor": "agentvm.cli.doctor_cmd:doctor",
    "validate": "agentvm.cli.spec_cmds:validate",
    "compile": "agentvm.cli.spec_cmds:compile_cmd",
    "presets": "agentvm.cli.spec_cmds:presets",
    "schema": "agentvm.cli.spec_cmds:schema",
    "secret": "agentvm.cli.secret_cmds:secret",
    "selftest": "agentvm.cli.selftest_cmd:selftest",
    "up": "agentvm.cli.daemon_cmds:up",
    "down": "agentvm.cli.daemon_cmds:down",
    "create": "agentvm.cli.daemon_cmds:create",
    "start": "agentvm.cli.daemon_cmds:start",
    "stop": "agentvm.cli.daemon_cmds:stop",
    "restart": "agentvm.cli.daemon_cmds:restart",
    "rm": "agentvm.cli.daemon_cmds:rm",
    "ps": "agentvm.cli.daemon_cmds:ps",
    "exec": "agentvm.cli.daemon_cmds:exec_cmd",
    "cp": "agentvm.cli.daemon_cmds:cp",
    "logs": "agentvm.cli.history_cmds:logs",
    "runs": "agentvm.cli.history_cmds:runs",
    "policy": "agentvm.cli.daemon_cmds:policy",
    "audit": "agentvm.cli.daemon_cmds:audit",
    "events": "agentvm.cli.daemon_cmds:events",
    "console": "agentvm.cli.daemon_cmds:console",
    "plan": "agentvm.cli.fleet_cmds:plan",
    "apply": "agentvm.cli.fleet_cmds:apply",
    "status": "agentvm.cli.fleet_cmds:status",
    "rollback": "agentvm.cli.fleet_cmds:rollback",
    "approvals": "agentvm.cli.approvals_cmd:approvals",
    "image": "agentvm.cli.image_cmds:image",
    "workspace": "agentvm.cli.workspace_cmds:workspace",
    "diff": "agentvm.cli.review_cmds:diff",
    "accept": "agentvm.cli.review_cmds:accept",
    "discard": "agentvm.cli.review_cmds:discard",
    "reviews": "agentvm.cli.review_cmds:reviews",
    "e2b": "agentvm.cli.e2b_cmds:e2b",
    "template": "agentvm.cli.template_cmds:template",
    "gateway": "agentvm.cli.gateway_cmds:gateway",
    "k8s": "agentvm.cli.k8s_cmds:k8s",
    "pause": "agentvm.cli.state_cmds:pause",
    "unpause": "agentvm.cli.state_cmds:unpause",
    "suspend": "agentvm.cli.state_cmds:suspend",
    "resume": "agentvm.cli.state_cmds:resume",
    "snapshot": "agentvm.cli.state_cmds:snapshot",
    "fork": "agentvm.cli.state_cmds:fork",
    "restore": "agentvm.cli.state_cmds:restore",
}


@contextlib.contextmanager
def _usage_is_invalid_input():
    """A usage error - an unknown command or option, a missing argument, an option value click
    refuses (a bad choice, a value its type's converter rejects) - is invalid input: exit 78,
    as docs/cli.md promises, never click's own 2. Every command and subcommand is parsed
    inside the root group's ``make_context`` or ``invoke``, so this is the one place."""
    try:
        yield
    except click.UsageError as exc:
        exc.exit_code = EXIT_CONFIG
        raise


class LazyGroup(click.Group):
    def make_context(self, info_name, args, parent=None, **extra):
        with _usage_is_invalid_input():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context):
        with _usage_is_invalid_input():
            return super().invoke(ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _COMMANDS.get(name)
        if target is None:
            return None
        mod, attr = target.split(":")
        return getattr(importlib.import_module(mod), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agentvm")
def cli() -> None:
    """agent-vm: run AI agents in sandboxes they cannot escape."""


def cli_main(argv: list[str] | None = None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="agentvm", standalone_mode=False)
    except AgentVMError as err:
        return report_error(err, as_json="--json" in (argv if argv is not None else sys.argv))
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # last resort: a full state disk is one clear error, the rest is a bug
        from agentvm.errors import disk_full_error

        from agentvm.paths import default_paths

        full = disk_full_error(exc, where=default_paths().home)
        if full is not None:
            return report_error(full, as_json="--json" in (argv if argv is not None else sys.argv))
        import traceback

        traceback.print_exc()
        click.echo(f"agentvm: internal error [{type(exc).__name__}]: {exc}", err=True)
        return EXIT_BACKEND
    return rv if isinstance(rv, int) else 0

