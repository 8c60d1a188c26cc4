"""A real daemon (bubblewrap sandboxes) serving the E2B API on loopback (`agentvm up
--e2b-listen`, or `agentvm e2b serve` beside it with AGENTVM_E2B_VIA=serve), and the
environment `agentvm e2b env` prints - the only thing the E2B examples get."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root, stop_daemon

E2B_PY_VERSION = "2.63.0"  # pinned in pyproject's test extra
HERE = Path(__file__).parent
ROOT_DIR = HERE.parent.parent


def _av(*args, check=True, timeout=120, env=None):
    r = subprocess.run(agentvm_cmd() + list(args), capture_output=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"agentvm {' '.join(args)} -> {r.returncode}\n{r.stdout.decode()}\n{r.stderr.decode()}")
    return r


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def parse_env(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export "):].partition("=")
            out[k] = v
    return out


# Which server the suite runs against: the daemon itself (`agentvm up --e2b-listen`, the
# default) or `agentvm e2b serve` beside it (AGENTVM_E2B_VIA=serve). test_daemon_served.py and
# test_serve_mode.py each pin one, whatever this says.
VIA = os.environ.get("AGENTVM_E2B_VIA", "daemon")


def wait_for_env(proc=None, log=None, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        r = _av("e2b", "env", check=False)
        if r.returncode == 0:
            return parse_env(r.stdout.decode())
        last = r
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.3)
    detail = Path(log).read_text() if log else ""
    raise AssertionError(f"the E2B API did not come up: {last.stderr.decode() if last else ''}\n{detail}")


def daemon_up(port: int, *extra: str) -> dict:
    """`agentvm up --e2b-listen 127.0.0.1:PORT` (limits as the tests expect); the env."""
    _av("up", "--e2b-listen", f"127.0.0.1:{port}", "--e2b-max-per-tenant", "6", "--e2b-max-creating", "2", *extra)
    return wait_for_env()


def daemon_down(home: Path) -> None:
    _av("down", check=False)
    pidf = home / "run" / "daemon.pid"
    deadline = time.monotonic() + 30
    while pidf.exists() and time.monotonic() < deadline:
        try:
            os.kill(int(pidf.read_text()), 0)
        except (ProcessLookupError, ValueError):
            break
        time.sleep(0.2)


def _cleanup(home: Path) -> None:
    # no sandbox of the E2B API is left behind
    try:
        ps = json.loads(_av("ps", "--json", check=False).stdout or b"[]")
    except ValueError:
        ps = []
    for row in ps if isinstance(ps, list) else []:  # the daemon may be down (an error object)
        if row.get("name", "").startswith("e2b-"):
            _av("rm", row["name"], check=False)
    stop_daemon(home)


@contextlib.contextmanager
def served_by_daemon(home: Path):
    """The daemon serves the E2B API itself (`agentvm up --e2b-listen`)."""
    if os.geteuid() != 0:
        pytest.skip("the daemon's sandboxes need root here")
    port = _free_port()
    try:
        env = daemon_up(port)
        yield {"env": env, "home": home, "port": port, "proc": None, "via": "daemon"}
    finally:
        _cleanup(home)


@contextlib.contextmanager
def served_beside(home: Path):
    """`agentvm up` + `agentvm e2b serve` (its own process, over the daemon's API)."""
    if os.geteuid() != 0:
        pytest.skip("the daemon's sandboxes need root here")
    _av("up")
    port = _free_port()
    log = open(f"/tmp/e2bhelper-serve-{port}.log", "wb")
    proc = subprocess.Popen(agentvm_cmd() + ["e2b", "serve", "--listen", f"127.0.0.1:{port}", "--max-per-tenant", "6",
                                             "--max-creating", "2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        env = wait_for_env(proc, log.name)
        yield {"env": env, "home": home, "port": port, "proc": proc, "via": "serve"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _cleanup(home)


@pytest.fixture(scope="module")
def e2b_server(avm_home):
    """The E2B API for this module (AGENTVM_E2B_VIA: daemon, the default, or serve); yields
    the env of `agentvm e2b env` (and home, port)."""
    with (served_beside if VIA == "serve" else served_by_daemon)(avm_home) as server:
        yield server


def run_example(server, path: Path, *, timeout: float = 180, extra_env: dict | None = None):
    """Run one E2B example unchanged, with only the environment `agentvm e2b env` printed
    (plus PATH/HOME so an interpreter can start)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           **server["env"], **(extra_env or {})}
    return subprocess.run([sys.executable, str(path)], capture_output=True, timeout=timeout, env=env, text=True)


def run_code(server, code: str, **kw):
    """Run the Python ``code`` (dedented) as :func:`run_example` runs an example, from a
    temporary file removed after it."""
    p = Path(f"/tmp/e2bhelper-{secrets.token_hex(4)}.py")
    p.write_text(textwrap.dedent(code))
    try:
        return run_example(server, p, **kw)
    finally:
        p.unlink()


pytestmark = [needs_root]
