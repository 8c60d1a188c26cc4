"""e2b-code-interpreter (2.11.5, pinned) unchanged on agent-vm: `Sandbox.create()` (its default
template `code-interpreter-v1`) and `run_code`, reaching the example's server
(examples/images/code-interpreter/server.py, real IPython kernels) on the sandbox's loopback
port 49999 through the E2B API's port proxy.

Two roots for the same server: the host's own /usr (Debian's python3-ipykernel and
python3-jupyter-client, installed by scripts/install.sh; the server file granted read-only), and
the example image built with `agentvm image build` (mmdebstrap from the host's apt sources, about
two minutes here) with its template.yaml as it is shipped."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.e2b.conftest import _av, run_code, run_example
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_DIR = REPO / "examples" / "images" / "code-interpreter"
EX = REPO / "examples" / "e2b"

HOST_TEMPLATE = f"""\
apiVersion: agentvm/v1
kind: Agent
metadata: {{name: code-interpreter-host}}
spec:
  lifecycle: persistent
  command: [python3, /opt/code-interpreter/server.py]
  mounts:
    - {{host: {EXAMPLE_DIR}, path: /opt/code-interpreter}}
  limits: {{disk: 256M, memory: 1G, pids: 512}}
"""


def _host_view_template():
    p = Path(f"/tmp/e2bhelper-ci-{secrets.token_hex(4)}.yaml")
    p.write_text(HOST_TEMPLATE)
    try:
        _av("template", "add", str(p), "--name", "code-interpreter-v1", "--port", "49999")
    finally:
        p.unlink()


def _ok(r):
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_readme_example_unchanged_on_the_host_view(e2b_server):
    _host_view_template()
    out = _ok(run_example(e2b_server, EX / "code_interpreter.py"))
    assert out.strip().splitlines()[-1] == "2", out


def test_streams_errors_display_data_envs_and_contexts(e2b_server):
    _host_view_template()
    out = _ok(run_example(e2b_server, EX / "code_interpreter_more.py"))
    for line in ("on_stdout: to stdout", "on_stderr: to stderr", "text: 42",
                 "logs: ['to stdout\\n'] ['to stderr\\n']", "error: ZeroDivisionError division by zero",
                 "html: <b>hi</b>", "env: 'hello'", "env after: None", "context: 'in the context'",
                 "default has no y: False", "contexts: 2"):
        assert line in out.splitlines(), (line, out)


def test_the_code_runs_inside_the_sandbox_with_its_controls(e2b_server):
    """The kernel is the sandbox's: the agent uid (not root), a read-only /usr, the workspace, no
    egress (the gate refuses), its own network namespace."""
    _host_view_template()
    out = _ok(run_code(e2b_server, """
from e2b_code_interpreter import Sandbox
with Sandbox.create() as sb:
    print("uid:", sb.run_code("import os; os.getuid()").text)
    e = sb.run_code("open('/usr/lib/agentvm-ci-probe', 'w')").error
    print("usr:", e.name if e else "WRITABLE")
    print("cwd-ws:", sb.run_code("import os; os.path.isdir('/workspace') and os.access('/workspace', os.W_OK)").text)
    e = sb.run_code("import urllib.request\\nurllib.request.urlopen('http://example.com/', timeout=20).status").error
    print("egress:", (e.name + ' ' + e.value) if e else "REACHED")
    print("files:", sb.run_code("open('/workspace/from-kernel.txt', 'w').write('k')").text,
          sb.files.read("/workspace/from-kernel.txt"))
"""))
    lines = dict(ln.split(": ", 1) for ln in out.splitlines() if ": " in ln)
    assert lines["uid"] != "0", out
    assert lines["usr"] in ("PermissionError", "OSError"), out
    assert lines["cwd-ws"] == "True", out
    assert lines["egress"] != "REACHED" and "403" in lines["egress"], out  # the gate's answer
    assert lines["files"] == "1 k", out


def test_readme_example_unchanged_on_the_example_image(e2b_server):
    """The shipped image.yaml built for real, its template.yaml registered as it is."""
    r = _av("image", "build", str(EXAMPLE_DIR / "image.yaml"), timeout=900)
    assert b"ipykernel" in r.stdout + r.stderr
    _av("template", "add", str(EXAMPLE_DIR / "template.yaml"), "--name", "code-interpreter-v1", "--port", "49999")
    try:
        out = _ok(run_example(e2b_server, EX / "code_interpreter.py"))
        assert out.strip().splitlines()[-1] == "2", out
        out = _ok(run_code(e2b_server, """
from e2b_code_interpreter import Sandbox
with Sandbox.create() as sb:
    print("os:", sb.run_code("open('/etc/os-release').read().split('PRETTY_NAME=')[1].splitlines()[0]").text)
    print("server:", sb.run_code("import os; os.path.exists('/usr/lib/e2b-code-interpreter/server.py')").text)
"""))
        assert "server: True" in out and "bookworm" in out, out
    finally:
        _host_view_template()
