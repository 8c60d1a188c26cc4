"""The daemon serves the E2B API itself (`agentvm up --e2b-listen`): its sandboxes and their
deadlines survive a daemon restart, a deadline that passed while the daemon was down is
enforced when it comes back, the adapter's actions are on the daemon's audit chain with the
tenant as actor, and `agentvm e2b env` says when there is nothing to point at."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.e2b.conftest import _av, _cleanup, _free_port, daemon_down, daemon_up, run_code
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]


def _rest(env: dict, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    req = urllib.request.Request(env["E2B_API_URL"] + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"X-API-Key": env["E2B_API_KEY"], "Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw and r.headers.get("content-type", "").startswith("application/json")
                              else raw)
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _envd_read(env: dict, sid: str, token: str, path: str):
    req = urllib.request.Request(env["E2B_SANDBOX_URL"] + "/files?path=" + path,
                                 headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _names() -> list[str]:
    return [r["name"] for r in json.loads(_av("ps", "--json").stdout or b"[]")]


def _audit() -> list[dict]:
    out = _av("audit", "show", "--json").stdout.decode()
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture
def home(avm_home):
    if os.geteuid() != 0:
        pytest.skip("the daemon's sandboxes need root here")
    try:
        yield avm_home
    finally:
        _cleanup(avm_home)


def test_env_says_the_daemon_is_down_or_does_not_serve_the_api(home):
    _av("down", check=False)
    r = _av("e2b", "env", check=False)
    assert r.returncode != 0
    assert b"e2b.not-serving" in r.stderr and b"daemon is not running" in r.stderr and b"--e2b-listen" in r.stderr
    _av("up")
    try:
        r = _av("e2b", "env", check=False)
        assert r.returncode != 0
        assert b"without --e2b-listen" in r.stderr, r.stderr
    finally:
        daemon_down(home)


def test_a_restart_keeps_sandboxes_and_deadlines_and_reaps_the_expired(home):
    port = _free_port()
    env = daemon_up(port)
    assert env["E2B_API_URL"] == f"http://127.0.0.1:{port}" == env["E2B_SANDBOX_URL"]
    st, kept = _rest(env, "POST", "/sandboxes", {"templateID": "base", "timeout": 900, "metadata": {"k": "v"}})
    assert st == 201, kept
    st, short = _rest(env, "POST", "/sandboxes", {"templateID": "base", "timeout": 900})
    assert st == 201, short
    kid, sid = kept["sandboxID"], short["sandboxID"]
    token = kept["envdAccessToken"]
    # a file in the kept sandbox's workspace, written through envd
    req = urllib.request.Request(env["E2B_SANDBOX_URL"] + "/files?path=kept.txt", method="POST", data=b"still here",
                                 headers={"E2b-Sandbox-Id": kid, "X-Access-Token": token,
                                          "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    st, before = _rest(env, "GET", f"/sandboxes/{kid}")
    assert st == 200 and before["metadata"] == {"k": "v"}
    assert _rest(env, "POST", f"/sandboxes/{sid}/timeout", {"timeout": 3})[0] == 204
    # the state file keeps digests of the tokens, never the tokens
    con = sqlite3.connect(f"file:{home / 'e2b' / 'sandboxes.db'}?mode=ro", uri=True)
    try:
        dump = "\n".join(con.iterdump())
    finally:
        con.close()
    assert token not in dump and kid in dump and hashlib.sha256(token.encode()).hexdigest() in dump

    daemon_down(home)
    time.sleep(4)  # the short one's deadline passes while nothing serves it
    env2 = daemon_up(port)
    assert env2["E2B_API_KEY"] == env["E2B_API_KEY"]

    # the kept sandbox: listed, same deadline, its workspace and its old access token still good
    st, after = _rest(env2, "GET", f"/sandboxes/{kid}")
    assert st == 200, after
    assert after["endAt"] == before["endAt"] and after["startedAt"] == before["startedAt"]
    assert after["metadata"] == {"k": "v"} and after["state"] == "running"
    st, data = _envd_read(env2, kid, token, "kept.txt")
    assert (st, data) == (200, b"still here")
    assert _envd_read(env2, kid, "not-" + token, "kept.txt")[0] == 502
    # the expired one is reaped after the restart: gone from the E2B API and from the daemon
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and f"e2b-{sid}" in _names():
        time.sleep(0.5)
    assert f"e2b-{sid}" not in _names()
    assert _rest(env2, "GET", f"/sandboxes/{sid}")[0] == 404
    listed = _rest(env2, "GET", "/v2/sandboxes")[1]
    assert [b["sandboxID"] for b in listed] == [kid]

    # the unchanged SDK reconnects and runs a command in it
    code = ("from e2b import Sandbox\n"
            f"s = Sandbox.connect({kid!r})\n"
            "print('read:', s.files.read('kept.txt'))\n"
            "print('ran:', s.commands.run('echo hi').stdout.strip())\n"
            "s.kill()\n")
    r = run_code({"env": env2}, code)
    assert r.returncode == 0, r.stderr
    assert "read: still here" in r.stdout and "ran: hi" in r.stdout
    assert f"e2b-{kid}" not in _names()

    # on the daemon's audit chain, with the tenant as actor
    recs = [(x["kind"], x["actor"], x["sandbox"], x["data"].get("reason")) for x in _audit()
            if x["kind"].startswith("e2b.") and x["kind"] in ("e2b.create", "e2b.kill", "e2b.timeout")]
    assert ("e2b.create", "e2b:default", f"e2b-{kid}", None) in recs
    assert ("e2b.create", "e2b:default", f"e2b-{sid}", None) in recs
    assert ("e2b.timeout", "e2b:default", f"e2b-{sid}", None) in recs
    assert ("e2b.kill", "e2b:default", f"e2b-{sid}", "timeout") in recs
    assert ("e2b.kill", "e2b:default", f"e2b-{kid}", "kill") in recs
    assert _av("audit", "verify").returncode == 0


def test_e2b_serve_refuses_while_the_daemon_serves_the_api(home):
    port = _free_port()
    daemon_up(port)
    try:
        r = subprocess.run([sys.executable, "-m", "agentvm", "e2b", "serve", "--listen", f"127.0.0.1:{_free_port()}"],
                           capture_output=True, timeout=60)
        assert r.returncode != 0 and b"already served" in r.stderr, r.stderr
    finally:
        daemon_down(home)
