"""The shipped examples keep working (they are documentation users run)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]
ROOT = Path(__file__).resolve().parents[2]


def test_openai_credentials_example(avm_home):
    env = dict(os.environ, AGENTVM=f"{sys.executable} -m agentvm", AGENTVM_PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "examples/openai/run.sh")], capture_output=True, env=env, timeout=180)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()[-2000:]
    assert "stub: Authorization is the REAL key" in out
    assert "(a placeholder)" in out and "hello from the stub" in out
    assert "sk-demo-REAL" not in out


def test_hello_agent_example(avm_home):
    r = subprocess.run([sys.executable, "-m", "agentvm", "run", "-f", str(ROOT / "examples/hello-agent.yaml")],
                       capture_output=True, timeout=120)
    assert r.returncode == 0 and b"hello from inside the sandbox" in r.stdout
