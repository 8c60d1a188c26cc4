"""How the command line prints an agent-vm error: one way for every command (its own module,
so that the commands import it without importing the package that imports them)."""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: importing typing costs the thin client more than all the rest
if TYPE_CHECKING:
    from agentvm.errors import AgentVMError


def daemon_timeout_hint() -> str:
    """What to do about a daemon that did not answer in time (both clients say it)."""
    import os

    from agentvm.locations import default_dirs

    return (f"it may be stopped or overloaded: its log is {os.path.join(default_dirs()[0], 'daemon.log')}; "
            "AGENTVM_CLIENT_TIMEOUT sets the wait")


def report_error(err: AgentVMError, as_json: bool = False) -> int:
    """Print an agent-vm error the same way everywhere and return its exit code."""
    if err.code == "daemon.timeout" and "daemon.log" not in err.hint:
        # the library's client does not know where `agentvm up` writes the log; every command says it
        err.hint = daemon_timeout_hint()
    if as_json:
        import json

        print(json.dumps(err.to_dict()), flush=True)
    else:
        from agentvm.runreport import error_text

        sys.stderr.write(error_text(err.code, err.message, err.hint))
    return err.exit_code
