"""agent-vm: host AI agents in isolated, persistent sandboxes."""

__version__ = "0.1.0"

from agentvm import codecache as _codecache  # noqa: E402

_codecache.install()  # the kept code of the methods dataclasses generates (agentvm.codecache): a faster start


def __getattr__(name: str):
    # lazy: `import agentvm` stays cheap for the CLI's hot path
    if name in ("Sandbox", "AsyncSandbox", "ExecResult", "pending_approvals", "approve", "deny"):
        from agentvm import sdk

        return getattr(sdk, name)
    raise AttributeError(name)
