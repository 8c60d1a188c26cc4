"""The syscall audit, wired end to end (docs/syscall-audit.md): an escape probe by a real sandbox
(bubblewrap, the default substrate) - ``unshare -U true``, refused with EPERM by the seccomp
filter - reaches the audit chain (``agentvm audit show``, ``agentvm audit export --what
syscalls``), ``/metrics`` (``agentvm_syscalls_denied_total{syscall="unshare"}``) and the web
console (the sandbox list's column and the sandbox page), for a daemon-managed sandbox; and
the audit chain for an embedded ``agentvm run``."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import av, needs_root
from tests.integration.test_observe import ARTIFACTS, CHROMIUM, daemon_tcp, http, login  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, needs_root]


def _chain(kind_prefix: str, sandbox: str | None = None) -> list[dict]:
    r = av("audit", "export", "--what", "syscalls", "--format", "json")
    recs = [json.loads(ln) for ln in r.stdout.decode().splitlines() if ln.strip()]
    return [x for x in recs if str(x.get("kind", "")).startswith(kind_prefix)
            and (sandbox is None or str(x.get("sandbox") or "").startswith(sandbox))]


def _probe(name: str) -> None:
    r = av("exec", name, "--", "/bin/sh", "-c", "unshare -U true; echo rc=$?", check=False)
    assert b"rc=1" in r.stdout, r.stdout + r.stderr  # refused, as before the audit (EPERM)


def test_a_daemon_sandbox_probing_unshare_is_on_the_chain_the_metrics_and_the_console(daemon_tcp, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    home, port = daemon_tcp
    f = helpers.write_agent(tmp_path, "sys-probe", 'lifecycle: persistent\ncommand: ["/bin/sh", "-c", "exec sleep 600"]\n'
                            "limits: {disk: 16M}\n")
    av("create", "-f", str(f), "--start")
    _probe("sys-probe")
    deadline = time.time() + 10
    recs: list[dict] = []
    while time.time() < deadline and not recs:
        recs = [x for x in _chain("syscall.denied", "sys-probe") if x.get("data", {}).get("syscall") == "unshare"]
        time.sleep(0.2)
    assert recs, "the probe is on the audit chain"
    d = recs[0]["data"]
    assert d["errno"] == "EPERM" and "CLONE_NEWUSER" in d["args"].get("flags", "") and d["argv"][:2] == ["unshare", "-U"]
    shown = av("audit", "show").stdout.decode()
    assert "syscall.denied" in shown and "sys-probe" in shown
    assert av("audit", "verify").returncode == 0
    # OCSF: Process Activity
    r = av("audit", "export", "--what", "syscalls")
    ocsf = [json.loads(ln) for ln in r.stdout.decode().splitlines() if ln.strip()]
    assert any(e.get("class_uid") == 1007 and "unshare" in e.get("message", "") for e in ocsf)

    token = (home / "daemon.token").read_text().strip()
    status, _, body = http(port, "/metrics", headers={"Authorization": f"Bearer {token}"})
    assert status == 200
    fams = {m.name: m for m in text_string_to_metric_families(body.decode())}
    got = {s.labels.get("syscall"): s.value for s in fams["agentvm_syscalls_denied"].samples if s.name.endswith("_total")}
    assert got.get("unshare", 0) >= 1, got

    # the console: the list's column and the sandbox page (HTTP level; Chromium below)
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
    opener.open(login(port), timeout=10).read()
    page = opener.open(f"http://127.0.0.1:{port}/sandboxes/sys-probe", timeout=10).read().decode()
    assert 'id="syscalls"' in page
    cell = page.split('id="syscalls"', 1)[1].split("</dd>", 1)[0]
    assert "denied" in cell and "not audited" not in cell and not cell.split(">", 1)[1].lstrip().startswith("0 denied")
    index = opener.open(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
    row = index.split('data-name="sys-probe"', 1)[1].split("</tr>", 1)[0]
    assert 'class="syscalls bad"' in row

    if CHROMIUM is not None:
        from playwright.sync_api import sync_playwright

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                pg = browser.new_page(viewport={"width": 1400, "height": 900})
                pg.goto(login(port))
                cell = pg.locator('#sandboxes tr[data-name="sys-probe"] td.syscalls')
                assert cell.inner_text().strip() not in ("", "-", "0")
                pg.screenshot(path=str(ARTIFACTS / "syscalls-list.png"), full_page=True)
                pg.goto(f"http://127.0.0.1:{port}/sandboxes/sys-probe")
                assert "denied" in pg.locator("#syscalls").inner_text()
                pg.screenshot(path=str(ARTIFACTS / "syscalls-sandbox.png"), full_page=True)
            finally:
                browser.close()
    av("stop", "sys-probe", check=False)


def test_an_embedded_run_probing_unshare_is_on_the_chain(avm_home, tmp_path):
    f = helpers.write_agent(tmp_path, "sys-run", "limits: {timeout: 30s}\n")
    r = av("run", "-f", str(f), "--", "/bin/sh", "-c", "unshare -U true; echo rc=$?", check=False)
    assert b"rc=1" in r.stdout, r.stdout + r.stderr
    recs = [x for x in _chain("syscall.denied", "sys-run") if x.get("data", {}).get("syscall") == "unshare"]
    assert recs and recs[0]["data"]["errno"] == "EPERM"
