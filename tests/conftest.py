"""Shared test harness.

Every test session gets a private agent-vm installation (``AGENTVM_HOME``) under /tmp with
traversable parents (the sandbox's unprivileged uid must reach bwrap and the helper), and a
private uid range so parallel sessions and a real installation never collide.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, agentvm_cmd, needs_root  # noqa: F401 (re-exported)


@contextlib.contextmanager
def _private_home():
    """An installation of its own (AGENTVM_HOME) and a uid range of its own, removed after."""
    home = Path(f"/tmp/agentvm-test-{secrets.token_hex(4)}")
    home.mkdir(mode=0o711)
    os.chmod(home, 0o711)
    old = {k: os.environ.get(k) for k in ("AGENTVM_HOME", "AGENTVM_UID_BASE")}
    os.environ["AGENTVM_HOME"] = str(home)
    # a uid range of its own (kept well away from the default 2100000)
    os.environ["AGENTVM_UID_BASE"] = str(3_000_000 + (int.from_bytes(secrets.token_bytes(2), "big") % 50) * 200_000)
    try:
        yield home
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        ws = home / "run" / "ws"
        if ws.is_dir():
            for d in ws.iterdir():
                subprocess.run(["umount", "-l", str(d)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def avm_home() -> Path:
    with _private_home() as home:
        yield home


@pytest.fixture
def fresh_home() -> Path:
    """An installation for one test only (state that must not see other tests': fleets)."""
    with _private_home() as home:
        yield home


@pytest.fixture
def agentvm(avm_home):
    """Run the real CLI: ``agentvm("run", "--", "true")`` -> CompletedProcess (bytes)."""

    def _run(*args: str, input: bytes | None = None, timeout: float = 120, env: dict | None = None, **kw):
        e = dict(os.environ)
        if env:
            e.update(env)
        return subprocess.run(
            agentvm_cmd() + list(args), input=input, capture_output=True, timeout=timeout, env=e, **kw
        )

    return _run


def _text_runner(agentvm, *interpreter: str):
    def _run(source: str, *args: str, timeout: float = 120, env: dict | None = None):
        r = agentvm("run", *args, "--", *interpreter, source, timeout=timeout, env=env)
        r.stdout = r.stdout.decode(errors="replace")
        r.stderr = r.stderr.decode(errors="replace")
        return r

    return _run


@pytest.fixture
def sh(agentvm):
    """Run a shell script inside a fresh sandbox: ``sh("id -u")`` -> CompletedProcess (text)."""
    return _text_runner(agentvm, "/bin/sh", "-c")


@pytest.fixture
def py(agentvm):
    """Run Python code inside a fresh sandbox (Debian's /usr/bin/python3)."""
    return _text_runner(agentvm, "/usr/bin/python3", "-c")


@pytest.fixture
def grant_dir(tmp_path_factory):
    """A host folder under /tmp with traversable parents, for --mount grants."""

    def _make(mode: int = 0o755) -> Path:
        d = Path(f"/tmp/agentvm-grant-{secrets.token_hex(4)}")
        d.mkdir(mode=mode)
        os.chmod(d, mode)
        return d

    made: list[Path] = []

    def factory(mode: int = 0o755) -> Path:
        d = _make(mode)
        made.append(d)
        return d

    yield factory
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
