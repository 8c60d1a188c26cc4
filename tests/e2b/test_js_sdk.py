"""E2B's JavaScript quickstart under Node, with the pinned `e2b` npm package installed in a
test-local folder (tests/e2b/js), against real sandboxes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]
JS = Path(__file__).parent / "js"
EX = Path(__file__).parent.parent.parent / "examples" / "e2b"
E2B_JS_VERSION = json.loads((JS / "package.json").read_text())["dependencies"]["e2b"]


@pytest.fixture(scope="module")
def node_sdk():
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node/npm are not installed")
    if not (JS / "node_modules" / "e2b").is_dir():
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=JS, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"npm ci could not install the pinned e2b@{E2B_JS_VERSION}: {r.stderr[-300:]}")
    got = json.loads((JS / "node_modules" / "e2b" / "package.json").read_text())["version"]
    assert got == E2B_JS_VERSION
    return node


def test_js_quickstart(e2b_server, node_sdk):
    run = JS / "_run_quickstart.mjs"  # beside node_modules, so `import 'e2b'` resolves
    shutil.copyfile(EX / "quickstart.mjs", run)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **e2b_server["env"]}
    try:
        r = subprocess.run([node_sdk, str(run)], capture_output=True, text=True, timeout=120, env=env, cwd=JS)
    finally:
        run.unlink(missing_ok=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Hello, World!" in r.stdout
    assert "read: hello from js" in r.stdout
    assert "list: hello.txt" in r.stdout
    assert 'background: "bg\\ndone\\n"' in r.stdout
    assert "killed" in r.stdout
