"""The ``agentvm`` command line: a thin client over the public library.

``main`` routes ``agentvm run`` straight to its argparse implementation (the hot path must
not pay ~35 ms for importing click); every other command goes through the click app in
``agentvm.cli.app``. The library never imports this package.
"""

from __future__ import annotations

import sys

from agentvm.errors import AgentVMError


def report_error(err: AgentVMError, as_json: bool = False) -> int:
    """Print an agent-vm error the same way everywhere and return its exit code."""
    if as_json:
        import json

        print(json.dumps(err.to_dict()), flush=True)
    else:
        print(f"agentvm: error [{err.code}]: {err.message}", file=sys.stderr)
        if err.hint:
            print(f"  hint: {err.hint}", file=sys.stderr)
    return err.exit_code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        from agentvm.cli.run_cmd import main_run

        return main_run(args[1:])
    from agentvm.cli.app import cli_main

    return cli_main(args)


def __getattr__(name: str):
    if name == "cli":  # the click group, for tests (click.testing.CliRunner)
        from agentvm.cli.app import cli

        return cli
    raise AttributeError(name)
