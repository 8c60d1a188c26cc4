"""The daemon's API fuzzed with Schemathesis (generated from GET /v1/openapi.json, which is
generated from the pydantic models): against a real daemon on the real substrate, no request
is answered with a 5xx, the daemon logs no traceback, and its memory does not grow with the
run. Routes that stop the daemon or never end (/v1/shutdown, /v1/events) are left out."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import av, daemon_up

pytestmark = [pytest.mark.integration, needs_root]
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(900)
def test_schemathesis_finds_no_server_error(avm_home, tmp_path):
    port = _free_port()
    log_path = avm_home / "daemon.log"
    start = log_path.stat().st_size if log_path.exists() else 0  # (the home is shared: earlier daemons' lines)
    with daemon_up(avm_home, "--listen", f"127.0.0.1:{port}") as home:
        # the schema's example sandbox exists, so the sandbox routes are reached beyond 404
        av("create", "-f", str(ROOT / "examples/hello-agent.yaml"))
        pid = int((home / "run" / "daemon.pid").read_text())
        token = (home / "daemon.token").read_text().strip()
        st = Path(sys.executable).with_name("st")
        cmd = [str(st), "run", f"http://127.0.0.1:{port}/v1/openapi.json", "-H", f"Authorization: Bearer {token}",
               "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "20261128", "-w", "1",
               "--exclude-path", "/v1/shutdown", "--exclude-path", "/v1/events", "--no-color",
               "--generation-database", "none", "--request-timeout", "60",
               "--suppress-health-check", "filter_too_much,too_slow", "--report-dir", str(tmp_path)]
        # warm up (first imports, the console's templates) before the baseline
        av("ps")
        before = _rss_kib(pid)
        r = subprocess.run(cmd, capture_output=True, timeout=840, cwd=tmp_path, env=dict(os.environ, NO_COLOR="1"))
        out = r.stdout.decode(errors="replace")
        after = _rss_kib(pid)
        with open(home / "daemon.log", "rb") as f:
            f.seek(start)
            log = f.read().decode(errors="replace")
    summary = out[out.rfind("SUMMARY"):]
    print(summary)
    assert r.returncode == 0, out[-6000:] + r.stderr.decode(errors="replace")[-2000:]
    assert " passed" in summary and "failure" not in summary.lower(), summary
    assert "Traceback" not in log, log[log.find("Traceback") - 200:][:3000]
    # a few MiB of caches are fine; a leak per request (thousands of them) is not
    assert after - before < 48 * 1024, f"daemon RSS grew {before} -> {after} KiB over the run"
