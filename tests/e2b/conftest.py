"""A real daemon (bubblewrap sandboxes) with the E2B API served over it on loopback, and the
environment `agentvm e2b env` prints - the only thing the E2B examples get."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root

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


@pytest.fixture(scope="module")
def e2b_server(avm_home):
    """`agentvm up` + `agentvm e2b serve` for this module; yields the env of `agentvm e2b env`."""
    if os.geteuid() != 0:
        pytest.skip("the daemon's sandboxes need root here")
    _av("up")
    port = _free_port()
    log = open(f"/tmp/e2bhelper-serve-{port}.log", "wb")
    proc = subprocess.Popen(agentvm_cmd() + ["e2b", "serve", "--listen", f"127.0.0.1:{port}", "--max-per-tenant", "6",
                                             "--max-creating", "2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        env = None
        while time.monotonic() < deadline:
            r = _av("e2b", "env", check=False)
            if r.returncode == 0:
                env = parse_env(r.stdout.decode())
                break
            if proc.poll() is not None:
                break
            time.sleep(0.3)
        if env is None:
            log.flush()
            raise AssertionError("e2b serve did not come up: " + Path(log.name).read_text())
        yield {"env": env, "home": avm_home, "port": port, "proc": proc}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # no sandbox of the E2B API is left behind
        ps = json.loads(_av("ps", "--json", check=False).stdout or b"[]")
        for row in ps:
            if row.get("name", "").startswith("e2b-"):
                _av("rm", row["name"], check=False)
        _av("down", check=False)
        pidf = avm_home / "run" / "daemon.pid"
        if pidf.exists():
            try:
                os.kill(int(pidf.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def run_example(server, path: Path, *, timeout: float = 180, extra_env: dict | None = None):
    """Run one E2B example unchanged, with only the environment `agentvm e2b env` printed
    (plus PATH/HOME so an interpreter can start)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           **server["env"], **(extra_env or {})}
    return subprocess.run([sys.executable, str(path)], capture_output=True, timeout=timeout, env=env, text=True)


pytestmark = [needs_root]
