"""The ``agentvm`` command line: a thin client over the public library.

``main`` routes ``agentvm run`` straight to its argparse implementation (the hot path must
not pay ~35 ms for importing click); every other command goes through the click app in
``agentvm.cli.app``. The library never imports this package.
"""

from __future__ import annotations

import sys

from agentvm.cli.report import report_error  # noqa: F401 (the one way errors are printed)


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

        rc = main_run(args[1:])
        _freeze()
        return rc
    _site()
    from agentvm.cli.app import cli_main

    return cli_main(args)


def _freeze() -> None:
    """The run is over and its report written: move every object to the collector's permanent
    generation, so the interpreter's exit does not walk them all again (about 20 ms of CPU per
    embedded run, measured in bench/bench_startup.py; nothing is skipped that exit would do)."""
    import gc

    gc.freeze()


def __getattr__(name: str):
    if name == "cli":  # the click group, for tests (click.testing.CliRunner)
        from agentvm.cli.app import cli

        return cli
    raise AttributeError(name)
