"""The error tree of agent-vm.

Every error agent-vm raises on purpose derives from :class:`AgentVMError` and carries:

* ``code``  - a stable, machine-readable identifier (``spec.invalid``, ``env.no-landlock``...)
* ``hint``  - what the operator can do about it (may be empty)
* ``exit_code`` - the process exit code the CLI uses for it

Families (drawn like httpx's ``_exceptions.py``)::

    AgentVMError
    ├── ConfigError            exit 78  (EX_CONFIG)   the operator's input is wrong
    │   └── SpecError                   an agent/preset file is invalid (file:line:field)
    ├── EnvironmentError_      exit 77  (EX_NOPERM)   the host cannot give a guarantee
    │   └── PrimitiveMissing            a kernel primitive the policy needs is absent
    ├── PolicyDenied           exit 77                the policy forbids what was asked
    ├── BackendError           exit 125               the substrate failed to do its job
    │   ├── LaunchError                 a step of sandbox setup failed (names the step)
    │   └── TeardownError               teardown could not be verified
    ├── DiskFull               exit 75  (EX_TEMPFAIL) the disk holding agent-vm's state is full
    └── InternalError          exit 125               a bug in agent-vm

Third-party exceptions are translated at the boundary with ``raise ... from exc``.
Exit codes of a sandboxed command itself pass through unchanged; see ``docs/cli.md``.
"""

from __future__ import annotations

from agentvm.errorcodes import lookup  # (errorcodes imports nothing of agent-vm's)

# Exit codes: documented in docs/cli.md. A sandboxed command's own code passes through.
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # like timeout(1)
EXIT_BACKEND = 125  # agent-vm or the substrate failed (like docker's 125)
EXIT_POLICY = 77  # refused: policy or a missing primitive (EX_NOPERM)
EXIT_CONFIG = 78  # invalid configuration (EX_CONFIG)
EXIT_TEMPFAIL = 75  # try again later: the state disk is full (EX_TEMPFAIL)


class AgentVMError(Exception):
    """Base of every deliberate agent-vm error. Its HTTP status and exit code come from the
    registry (:mod:`agentvm.errorcodes`) by its code, so that a condition fails the same way
    embedded, through the daemon's API and on the CLI; a family's own are the fallback."""

    code: str = "internal.bug"
    exit_code: int = EXIT_BACKEND
    status: int = 500

    def __init__(self, message: str, *, hint: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if code is not None:
            self.code = code
        known = lookup(self.code)
        if known is not None:
            self.exit_code, self.status = known.exit, known.status

    def to_dict(self) -> dict:
        return {
            "error": self.code,
            "message": self.message,
            "hint": self.hint,
            "exit_code": self.exit_code,
        }

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


class ConfigError(AgentVMError):
    code = "config.invalid"
    exit_code = EXIT_CONFIG
    status = 400


class SpecError(ConfigError):
    """An agent or preset file is invalid. ``problems`` lists each one with its location."""

    code = "spec.invalid"

    def __init__(self, message: str, *, problems: list["SpecProblem"] | None = None, hint: str = "") -> None:
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join("  " + p.render() for p in self.problems)
        super().__init__(message, hint=hint)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["problems"] = [p.to_dict() for p in self.problems]
        return d


class SpecProblem:
    """One located problem: ``file:line: field: message``."""

    __slots__ = ("file", "line", "field", "message")

    def __init__(self, file: str | None, line: int | None, field: str, message: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.message = message

    def render(self) -> str:
        where = self.file or "<input>"
        if self.line is not None:
            where = f"{where}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "field": self.field, "message": self.message}

    def __repr__(self) -> str:  # pragma: no cover
        return f"SpecProblem({self.render()!r})"


class HostEnvironmentError(AgentVMError):
    """The host cannot provide a guarantee the policy relies on."""

    code = "env.unsupported"
    exit_code = EXIT_POLICY
    status = 409


class PrimitiveMissing(HostEnvironmentError):
    code = "env.primitive-missing"


class PolicyDenied(AgentVMError):
    code = "policy.denied"
    exit_code = EXIT_POLICY
    status = 403


class BackendError(AgentVMError):
    code = "backend.error"
    exit_code = EXIT_BACKEND
    status = 500


class LaunchError(BackendError):
    """A named step of sandbox setup failed."""

    code = "backend.launch-failed"

    def __init__(self, step: str, message: str, *, hint: str = "") -> None:
        self.step = step
        super().__init__(f"sandbox setup failed at step '{step}': {message}", hint=hint)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["step"] = self.step
        return d


class TeardownError(BackendError):
    code = "backend.teardown-unverified"


class DiskFull(AgentVMError):
    """The disk holding agent-vm's state (``AGENTVM_HOME``: state, audit chain, leases) is
    full. One error on every path - embedded run, daemon, ``audit verify`` - instead of a
    traceback or a corruption verdict: nothing is wrong with the data, there is no room."""

    code = "state.disk-full"
    exit_code = EXIT_TEMPFAIL
    status = 507


def _free_bytes(path) -> int | None:
    import os

    p = str(path) if path else ""
    while p:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            parent = os.path.dirname(p.rstrip("/"))
            if parent == p:
                return None
            p = parent
    return None


def disk_full_error(exc: BaseException, where=None) -> "DiskFull | None":
    """The :class:`DiskFull` an exception (or anything in its ``__cause__``/``__context__``
    chain) amounts to, or None: ``ENOSPC``/``EDQUOT``, SQLite's "database or disk is full",
    and SQLite's "disk I/O error" when the filesystem of ``where`` has no space left (what
    SQLite says when it cannot grow its ``-shm``/``-wal`` files)."""
    import errno

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, DiskFull):
            return cur
        path = where
        full = False
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            full, path = True, getattr(cur, "filename", None) or where
        elif type(cur).__module__ == "sqlite3" or type(cur).__name__ in ("OperationalError", "DatabaseError"):
            text = str(cur).lower()
            if "database or disk is full" in text:
                full = True
            elif "disk i/o error" in text and where is not None and _free_bytes(where) == 0:
                full = True
        if full:
            if path is None:  # (agentvm.paths imports this module: the caller names the place)
                return DiskFull("the disk holding agent-vm's state is full: agent-vm cannot write its state there",
                                hint="free space on that filesystem (`agentvm workspace prune --unused-for 7d` "
                                     "removes unused workspaces) and retry; nothing agent-vm recorded before is lost")
            free = _free_bytes(path)
            room = "" if free is None else f" ({free // 1024} KiB free)"
            return DiskFull(f"the disk holding {path} is full{room}: agent-vm cannot write its state there",
                            hint=f"free space on that filesystem (df -h {path}; `agentvm workspace prune "
                                 "--unused-for 7d` removes unused workspaces) and retry; nothing agent-vm "
                                 "recorded before is lost")
        cur = cur.__cause__ or cur.__context__
    return None


class InternalError(AgentVMError):
    code = "internal.bug"
    exit_code = EXIT_BACKEND
