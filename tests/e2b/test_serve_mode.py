"""`agentvm e2b serve` (the API in a process of its own, over the daemon's HTTP API, state in
memory) keeps working beside the daemon-served API the rest of tests/e2b runs against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2b.conftest import run_example, served_beside
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]
EX = Path(__file__).parent.parent.parent / "examples" / "e2b"


@pytest.fixture(scope="module")
def beside(avm_home):
    with served_beside(avm_home) as server:
        yield server


def test_serve_answers_for_env_and_runs_the_examples(beside):
    assert beside["via"] == "serve"
    assert beside["env"]["E2B_API_URL"] == f"http://127.0.0.1:{beside['port']}"
    for ex, want in (("quickstart.py", "Hello, World!"), ("commands.py", "killed: True"),
                     ("files.py", "read: file content")):
        r = run_example(beside, EX / ex)
        assert r.returncode == 0, f"{ex}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        assert want in r.stdout, r.stdout
