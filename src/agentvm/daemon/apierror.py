"""The daemon's errors as a client sees them: its own module, below both clients (the library's
``agentvm.daemon.client`` and the CLI's fast path ``agentvm.cli.fastrun``), so that neither
imports the other for them. ``agentvm.daemon.client`` re-exports these names."""

from __future__ import annotations

from agentvm.errors import AgentVMError, BackendError


class DaemonUnavailable(BackendError):
    code = "daemon.unavailable"


def error_from(doc: dict, status: int = 0) -> AgentVMError:
    """The daemon's error object as the same error the embedded path raises: code, message,
    hint and exit code exactly as sent."""
    err = ApiFailure(status, doc)
    if isinstance(doc.get("exit_code"), int):
        err.exit_code = doc["exit_code"]
    return err


class ApiFailure(AgentVMError):
    code = "daemon.error"

    def __init__(self, status: int, doc: dict):
        super().__init__(doc.get("message", f"HTTP {status}"), hint=doc.get("hint", ""),
                         code=str(doc.get("error") or "daemon.error"))
        self.status = status
        # the daemon's own word (its registry, agentvm.errorcodes), else ours for the code
        if isinstance(doc.get("exit_code"), int) and not isinstance(doc.get("exit_code"), bool):
            self.exit_code = doc["exit_code"]
