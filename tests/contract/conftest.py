"""The substrate contract: one set of behavioural tests, run against every backend present.

``substrate`` is parametrized over ``fake`` (always), ``bwrap`` and ``gvisor`` (as root, where
they can run - on the CI machine both can). Each test drives a backend the way agent-vm does:
through the runtime and the one lifecycle driver, never around the protocol. A new backend is
done when this suite passes for it.

The fake runs nothing: it interprets a tiny shell (``exit N``, ``echo``, ``sleep``, ``true``)
so the lifecycle's contract (exit codes, timeouts, stop, exec, teardown) is checked against
it too; tests of real isolation (limits, the gate, grants, workspaces) need a real sandbox and
say so when they skip the fake.
"""

from __future__ import annotations

import os
import shlex
import shutil
import threading
import time
from pathlib import Path

import pytest

from agentvm.backends.base import ExitStatus
from agentvm.backends.fake import FakeBackend
from agentvm.errors import EXIT_TIMEOUT
from tests.helpers import ROOT

SUBSTRATES = ("fake", "bwrap", "gvisor")


def _runsc_runs() -> str | None:
    """None when runsc can run sandboxes here, else why not."""
    if not ROOT:
        return "gVisor is run rootful by agent-vm: needs root"
    if not (shutil.which("runsc") or os.path.exists("/usr/bin/runsc")):
        return "runsc is not installed (apt-get install runsc)"
    return None


def skip_reason(name: str) -> str | None:
    if name == "fake":
        return None
    if not ROOT:
        return f"the {name} substrate's guarantees need root (dedicated uids, cgroups)"
    if name == "gvisor":
        return _runsc_runs()
    return None


class ScriptedFake(FakeBackend):
    """A fake that 'runs' a tiny shell: ``exit N``, ``true``/``false``, ``echo WORDS``,
    ``sleep S``, anything else is 127 (not found). ``wait`` honours timeouts and ``stop``."""

    def __init__(self) -> None:
        super().__init__(handler=0)
        self._stopped: dict[str, threading.Event] = {}

    @staticmethod
    def _script(argv) -> list[str]:
        argv = list(argv)
        if len(argv) >= 3 and argv[0].endswith("sh") and argv[1] == "-c":
            return shlex.split(argv[2])
        return argv

    def _outcome(self, argv, out_fd=None, err_fd=None) -> tuple[int, float]:
        words = self._script(argv)
        if not words:
            return 0, 0.0
        cmd = os.path.basename(words[0])
        if cmd == "exit":
            return int(words[1]) if len(words) > 1 else 0, 0.0
        if cmd in ("true", ":"):
            return 0, 0.0
        if cmd == "false":
            return 1, 0.0
        if cmd == "echo":
            if out_fd is not None:
                os.write(out_fd, (" ".join(words[1:]) + "\n").encode())
            return 0, 0.0
        if cmd == "sleep":
            return 0, float(words[1])
        if err_fd is not None:
            os.write(err_fd, f"{cmd}: not found\n".encode())
        return 127, 0.0

    def launch(self, plan, *, stdio=None):
        h = super().launch(plan, stdio=stdio)
        self._stopped[h.sandbox_id] = threading.Event()
        h.private["stdio"] = stdio
        return h

    def wait(self, handle, timeout=None) -> ExitStatus:
        stdio = handle.private.get("stdio") or (None, None, None)
        code, duration = self._outcome(handle.plan.command, stdio[1], stdio[2])
        stopped = self._stopped[handle.sandbox_id]
        limit = duration if not timeout or duration <= timeout else timeout
        if stopped.wait(limit):
            return ExitStatus(exit_code=143, signal=15, duration=limit)
        if timeout and duration > timeout:
            return ExitStatus(exit_code=EXIT_TIMEOUT, timed_out=True, duration=timeout)
        handle.private["done"] = True
        return ExitStatus(exit_code=code, duration=duration)

    def poll(self, handle) -> bool:
        return bool(handle.private.get("done")) or self._stopped[handle.sandbox_id].is_set()

    def exec(self, handle, argv, *, stdio=None, timeout=None) -> ExitStatus:
        if self.poll(handle):
            return ExitStatus(exit_code=125, setup_error={"step": "exec", "errno": 0, "message": "not running"})
        out = stdio[1] if stdio else None
        err = stdio[2] if stdio else None
        code, duration = self._outcome(argv, out, err)
        if timeout and duration > timeout:
            return ExitStatus(exit_code=EXIT_TIMEOUT, timed_out=True, duration=timeout)
        return ExitStatus(exit_code=code, duration=duration)

    def stop(self, handle, grace: float = 2.0) -> None:
        self._stopped[handle.sandbox_id].set()
        super().stop(handle, grace)


class Substrate:
    """One backend, driven through the runtime and the lifecycle driver."""

    def __init__(self, name: str, home: Path) -> None:
        from agentvm.paths import default_paths
        from agentvm.runtime import Runtime

        self.name = name
        self.real = name != "fake"
        self.backend = ScriptedFake() if name == "fake" else None
        self.rt = Runtime(default_paths(), self.backend)

    def policy(self, command, **kw):
        from agentvm.policy import Policy

        kw.setdefault("network", "none")
        return Policy(name=kw.pop("name", "contract"), command=tuple(command), substrate=self.name, **kw)

    def run(self, command, *, stdin: bytes = b"", **kw):
        """Run to completion; returns (RunResult, stdout text, stderr text)."""
        import tempfile

        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as dn:
            res = self.rt.run(self.policy(command, **kw), tty=False, stdio=(dn.fileno(), out.fileno(), err.fileno()))
            out.seek(0)
            err.seek(0)
            return res, out.read().decode(errors="replace"), err.read().decode(errors="replace")

    def start(self, command, **kw):
        """A running sandbox through the lifecycle driver: (lifecycle, session)."""
        from agentvm.lifecycle import EmbeddedGateHost, Lifecycle

        lc = Lifecycle(self.rt, EmbeddedGateHost(self.rt))
        s = lc.prepare(self.policy(command, **kw))
        dn = os.open(os.devnull, os.O_RDWR)
        try:
            lc.attach(s)
            lc.launch(s, (dn, dn, dn))
        except BaseException:
            lc.teardown(s)
            raise
        finally:
            os.close(dn)
        return lc, s

    def exec(self, s, argv, timeout=None):
        r, w = os.pipe()
        dn = os.open(os.devnull, os.O_RDONLY)
        try:
            es = s.backend.exec(s.handle, argv, stdio=(dn, w, w), timeout=timeout)
        finally:
            os.close(w)
            os.close(dn)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        return es, data.decode(errors="replace")

    def close(self) -> None:
        self.rt.close()


def _substrate(name: str, home: Path):
    why = skip_reason(name)
    if why:
        pytest.skip(why)
    if name == "fake":
        os.environ["AGENTVM_ALLOW_FAKE"] = "1"
    s = Substrate(name, home)
    try:
        yield s
    finally:
        s.close()
        os.environ.pop("AGENTVM_ALLOW_FAKE", None)


@pytest.fixture(params=SUBSTRATES)
def sub(request, avm_home):
    """Every backend, the fake included: the lifecycle's part of the contract."""
    yield from _substrate(request.param, avm_home)


@pytest.fixture(params=[s for s in SUBSTRATES if s != "fake"])
def real(request, avm_home):
    """The real sandboxes: isolation (limits, the gate, grants, workspaces), which the fake has not."""
    yield from _substrate(request.param, avm_home)


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()
