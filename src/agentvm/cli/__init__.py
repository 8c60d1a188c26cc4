"""The ``agentvm`` command line: a thin client over the public library.

``main`` routes ``agentvm run`` straight to its argparse implementation (the hot path must
not pay ~35 ms for importing click); every other command goes through the click app in
``agentvm.cli.app``. The library never imports this package.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: importing typing costs the thin client more than all the rest
if TYPE_CHECKING:
    from agentvm.errors import AgentVMError


def report_error(err: AgentVMError, as_json: bool = False) -> int:
    """Print an agent-vm error the same way everywhere and return its exit code."""
    if err.code == "daemon.timeout" and "daemon.log" not in err.hint:
        # the library's client does not know where `agentvm up` writes the log; every command says it
        from agentvm.cli.fastrun import _timed_out

        err.hint = _timed_out(0)[1]
    if as_json:
        import json

        print(json.dumps(err.to_dict()), flush=True)
    else:
        from agentvm.runreport import error_text

        sys.stderr.write(error_text(err.code, err.message, err.hint))
    return err.exit_code


def _site() -> None:
    """The installed entry point starts the interpreter without ``site`` (-S: the thin client
    needs nothing from it); every other path gets it, .pth files and all, as a normal start."""
    if sys.flags.no_site and "site" not in sys.modules:
        import site

        site.main()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        from agentvm.cli.fastrun import fast_run

        rc = fast_run(args[1:])  # `run -- CMD` with a daemon up: nothing else is imported
        if rc is not None:
            return rc
        _site()
        from agentvm.cli.run_cmd import main_run

        return main_run(args[1:])
    _site()
    from agentvm.cli.app import cli_main

    return cli_main(args)


def __getattr__(name: str):
    if name == "cli":  # the click group, for tests (click.testing.CliRunner)
        from agentvm.cli.app import cli

        return cli
    raise AttributeError(name)
