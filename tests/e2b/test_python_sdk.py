"""E2B's own documented Python examples (examples/e2b/*.py), unchanged, against agent-vm: the pinned
`e2b` SDK, real bubblewrap sandboxes behind the daemon, only the environment `agentvm e2b env` prints."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

import pytest

from tests.e2b.conftest import E2B_PY_VERSION, run_code, run_example
from tests.helpers import agentvm_cmd, needs_root

pytestmark = [pytest.mark.integration, needs_root]
EX = Path(__file__).parent.parent.parent / "examples" / "e2b"


def _ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _no_e2b_sandboxes_left(home):
    ps = json.loads(subprocess.run(agentvm_cmd() + ["ps", "--json"], capture_output=True).stdout or b"[]")
    return [r["name"] for r in ps if r["name"].startswith("e2b-")]


def test_the_pinned_sdk_is_the_one_tested():
    assert importlib.metadata.version("e2b") == E2B_PY_VERSION


def test_env_prints_what_the_sdk_needs(e2b_server):
    env = e2b_server["env"]
    assert set(env) >= {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"}
    assert env["E2B_API_URL"].startswith("http://127.0.0.1:")


def test_quickstart(e2b_server):
    out = _ok(run_example(e2b_server, EX / "quickstart.py"))
    assert "Hello, World!" in out
    assert "name='workspace'" in out and "name='usr'" in out  # files.list('/') is the sandbox's own root
    assert not _no_e2b_sandboxes_left(e2b_server["home"])  # sbx.kill() removed it


def test_commands_foreground_background_kill_envs_cwd(e2b_server):
    out = _ok(run_example(e2b_server, EX / "commands.py"))
    assert "stdout: hello" in out and "stdout: world" in out  # streamed through on_stdout
    assert "exit: 0 'hello\\nworld\\n'" in out
    assert "background: 'hello\\nworld\\n'" in out
    assert "killed: True" in out
    assert "never" not in out
    assert "envs: ['123', '/tmp']" in out


def test_files_write_read_list_and_friends(e2b_server):
    out = _ok(run_example(e2b_server, EX / "files.py"))
    for line in ("read: file content", "relative: in the workspace", "list: ['a.txt', 'b.txt']", "exists: True False",
                 "make_dir: True", "info: 1", "removed: True"):
        assert line in out, out


def test_lifecycle_timeout_info_list_connect_kill(e2b_server):
    out = _ok(run_example(e2b_server, EX / "lifecycle.py"))
    assert "info: True {'userId': '123'} base" in out
    assert "listed: 1" in out
    assert "connected: again" in out
    assert "running after kill: False" in out


def test_stdin_and_watch_dir(e2b_server):
    out = _ok(run_example(e2b_server, EX / "stdin_watch.py"))
    assert "stdin: 'hello from stdin\\n'" in out
    assert "('CREATE', 'my-file')" in out


def test_set_timeout_ends_the_sandbox(e2b_server):
    code = (
        "import time\n"
        "from e2b import Sandbox\n"
        "s = Sandbox.create(timeout=120)\n"
        "s.set_timeout(2)\n"
        "deadline = time.time() + 30\n"
        "while s.is_running() and time.time() < deadline:\n"
        "    time.sleep(0.5)\n"
        "print('running:', s.is_running())\n"
        "try:\n"
        "    s.commands.run('true')\n"
        "    print('ran')\n"
        "except Exception as e:\n"
        "    print('refused:', type(e).__name__)\n")
    out = _ok(run_code(e2b_server, code))
    assert "running: False" in out and "refused:" in out and "ran" not in out


def test_pause_and_connect_keep_the_workspace(e2b_server):
    code = (
        "from e2b import Sandbox\n"
        "s = Sandbox.create()\n"
        "s.files.write('kept.txt', 'still here')\n"
        "s.pause()\n"
        "print('state:', s.get_info().state.value)\n"
        "s2 = Sandbox.connect(s.sandbox_id)\n"
        "print('after:', s2.files.read('kept.txt'))\n"
        "s2.kill()\n")
    out = _ok(run_code(e2b_server, code))
    assert "state: paused" in out and "after: still here" in out


def test_pty_input_resize_exit_and_kill(e2b_server):
    if e2b_server.get("via") != "daemon":
        pytest.skip("a pty needs the daemon's interactive exec: `agentvm e2b serve` over its HTTP API has none")
    code = (
        "import time\n"
        "from e2b import Sandbox\n"
        "from e2b.sandbox.commands.command_handle import PtySize\n"
        "s = Sandbox.create()\n"
        "out = []\n"
        "h = s.pty.create(size=PtySize(rows=24, cols=80), timeout=60)\n"
        "s.pty.send_stdin(h.pid, b'stty size; echo marker-$((6*7)); id -u\\n')\n"
        "time.sleep(2)\n"
        "s.pty.resize(h.pid, PtySize(rows=30, cols=100))\n"
        "time.sleep(0.5)\n"
        "s.pty.send_stdin(h.pid, b'stty size\\n')\n"
        "time.sleep(1)\n"
        "s.pty.send_stdin(h.pid, b'exit 3\\n')\n"
        "try:\n"
        "    print('exit:', h.wait(on_pty=lambda d: out.append(d)).exit_code)\n"
        "except Exception as e:\n"
        "    print('exit:', getattr(e, 'exit_code', e))\n"
        "text = b''.join(out).decode(errors='replace')\n"
        "print('size1:', '24 80' in text, 'size2:', '30 100' in text, 'marker:', 'marker-42' in text,\n"
        "      'root:', '\\n0\\r' in text)\n"
        "h2 = s.pty.create(size=PtySize(rows=24, cols=80), timeout=60)\n"
        "s.pty.send_stdin(h2.pid, b'sleep 1000\\n')\n"
        "time.sleep(1)\n"
        "print('killed:', s.pty.kill(h2.pid))\n"
        "try:\n"
        "    h2.wait()\n"
        "    print('after kill: ended')\n"
        "except Exception as e:\n"
        "    print('after kill: ended', type(e).__name__)\n"
        "s.kill()\n")
    out = _ok(run_code(e2b_server, code))
    assert "exit: 3" in out and "size1: True size2: True marker: True root: False" in out, out
    assert "killed: True" in out and "after kill: ended CommandExitException" in out, out
