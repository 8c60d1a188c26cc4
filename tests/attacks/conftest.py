"""Fixtures for the attack suite (on top of tests/conftest.py: avm_home, agentvm, sh, py, grant_dir)."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _attacklib import agent_yaml, compile_static, last_json  # noqa: E402


@pytest.fixture
def avm_json(agentvm):
    """``avm_json("run", ..., "--", cmd...)`` -> (CompletedProcess with text stdout/stderr, result dict).
    ``--json`` is inserted right after ``run``."""

    def _run(*args: str, **kw):
        args = list(args)
        assert args and args[0] == "run"
        r = agentvm("run", "--json", *args[1:], **kw)
        r.stdout = r.stdout.decode(errors="replace")
        r.stderr = r.stderr.decode(errors="replace")
        return r, last_json(r.stdout)

    return _run


@pytest.fixture
def sh_json(avm_json):
    def _sh(script: str, *args: str, **kw):
        return avm_json("run", *args, "--", "/bin/sh", "-c", script, **kw)

    return _sh


@pytest.fixture
def py_json(avm_json):
    def _py(code: str, *args: str, **kw):
        return avm_json("run", *args, "--", "/usr/bin/python3", "-c", code, **kw)

    return _py


@pytest.fixture(scope="session")
def bin_dir():
    """A host folder (traversable, root-owned, 0755) holding static attack binaries; granted
    read-only into sandboxes at /attack."""
    d = Path(f"/tmp/agentvm-atkbin-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def cbin(bin_dir):
    """``cbin("name", C_SOURCE)`` -> ("--mount", "HOST:/attack:ro") args; the binary runs as /attack/name."""
    built: dict[str, str] = {}

    def _build(name: str, src: str, extra: tuple[str, ...] = ()) -> tuple[str, str]:
        out = str(bin_dir / name)
        if built.get(name) != src:
            compile_static(src, out, extra)
            built[name] = src
        return ("--mount", f"{bin_dir}:/attack:ro")

    return _build


@pytest.fixture
def root_canary():
    """A secret file planted under the host's /root (removed afterwards): (path, content)."""
    content = f"ROOT-CANARY-{secrets.token_hex(12)}"
    p = Path(f"/root/agentvm-canary-{secrets.token_hex(4)}")
    p.write_text(content + "\n")
    os.chmod(p, 0o600)
    assert p.read_text().strip() == content  # positive control: it really exists for root outside
    yield p, content
    p.unlink(missing_ok=True)


@pytest.fixture
def ssh_canary():
    """A fake private key under /root/.ssh (the directory is created if absent and removed
    again only if we created it)."""
    d = Path("/root/.ssh")
    created = not d.exists()
    d.mkdir(mode=0o700, exist_ok=True)
    content = f"-----BEGIN OPENSSH PRIVATE KEY-----SSH-CANARY-{secrets.token_hex(12)}"
    p = d / f"id_agentvm_canary_{secrets.token_hex(4)}"
    p.write_text(content + "\n")
    os.chmod(p, 0o600)
    yield p, content
    p.unlink(missing_ok=True)
    if created:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent_file(tmp_path):
    """``agent_file(name, command=None, disk="32M")`` -> path of a small Agent YAML."""

    def _make(name: str, command: list[str] | None = None, disk: str = "32M") -> str:
        return agent_yaml(tmp_path / f"{name}.yaml", name, command, disk)

    return _make


@pytest.fixture
def agent_name():
    def _name(prefix: str = "atk") -> str:
        return f"{prefix}-{secrets.token_hex(4)}"

    return _name
