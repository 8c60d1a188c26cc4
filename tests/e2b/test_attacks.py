"""Attacks through the E2B API, on real sandboxes: internet access the template denies, another
tenant's sandbox id, path traversal in files.*, a process asked to run as root, a create flood."""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.e2b.conftest import run_code
from tests.helpers import agentvm_cmd, needs_root

pytestmark = [pytest.mark.integration, needs_root]


def _api(server):
    env = server["env"]
    return env["E2B_API_URL"], {"X-API-Key": env["E2B_API_KEY"]}


def _create(server, headers=None, body=None) -> httpx.Response:
    url, h = _api(server)
    return httpx.post(f"{url}/v2/sandboxes", json=body or {"templateID": "base"}, headers=headers or h, timeout=60)


def _kill(server, sid, headers=None):
    url, h = _api(server)
    httpx.delete(f"{url}/sandboxes/{sid}", headers=headers or h, timeout=60)


def test_internet_access_the_template_denies_is_refused_naming_the_template(e2b_server):
    r = run_code(e2b_server, """
        from e2b import Sandbox
        for kw in ({"allow_internet_access": True}, {"network": {"allow_out": ["example.com"]}}):
            try:
                Sandbox.create(**kw)
                print("CREATED", kw)
            except Exception as e:
                print("refused:", type(e).__name__, e)
        """)
    assert "CREATED" not in r.stdout, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("refused:")]
    assert len(lines) == 2 and all("template 'base'" in ln for ln in lines), r.stdout
    assert "allow_internet_access" in lines[0] and "example.com" in lines[1]


def test_a_sandbox_of_the_base_template_cannot_reach_out(e2b_server):
    # the gate is the only way out, and the base template allows nothing: a denial, explained
    r = run_code(e2b_server, """
        from e2b import Sandbox
        s = Sandbox.create()
        try:
            r = s.commands.run("curl -sS -o /dev/null -w '%{http_code}' https://example.invalid/ 2>&1; echo; "
                               "curl -sS --noproxy '*' --max-time 5 http://192.0.2.1/ 2>&1; echo rc=$?")
            print(r.stdout)
        except Exception as e:
            print("EXIT", getattr(e, "stdout", ""), getattr(e, "exit_code", ""))
        s.kill()
        """)
    out = r.stdout
    assert "403" in out or "CONNECT" in out or "denied" in out.lower(), out + r.stderr
    assert "rc=0" not in out, out


def test_another_tenants_sandbox_is_answered_as_a_nonexistent_one(e2b_server):
    key_b = subprocess.run(agentvm_cmd() + ["e2b", "key", "--tenant", "tenant-b"], capture_output=True,
                           text=True, check=True).stdout.strip()
    url, ha = _api(e2b_server)
    hb = {"X-API-Key": key_b}
    made = _create(e2b_server)
    assert made.status_code == 201, made.text
    sid, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
    ghost = "i" + secrets.token_hex(10)
    try:
        for method, path, body in (("GET", "/sandboxes/{}", None), ("DELETE", "/sandboxes/{}", None),
                                   ("POST", "/sandboxes/{}/timeout", {"timeout": 5}),
                                   ("POST", "/v2/sandboxes/{}/connect", {"timeout": 5}),
                                   ("POST", "/sandboxes/{}/pause", {})):
            theirs = httpx.request(method, url + path.format(sid), json=body, headers=hb, timeout=30)
            none = httpx.request(method, url + path.format(ghost), json=body, headers=hb, timeout=30)
            assert theirs.status_code == none.status_code == 404, (path, theirs.text)
            assert theirs.text.replace(sid, "X") == none.text.replace(ghost, "X"), (theirs.text, none.text)
        listed = httpx.get(f"{url}/v2/sandboxes", headers=hb, timeout=30).json()
        assert sid not in json.dumps(listed)
        # envd: the id without its token, or with another sandbox's token, is "not found" too
        for hdrs in ({"E2b-Sandbox-Id": sid}, {"E2b-Sandbox-Id": sid, "X-Access-Token": "x" * 32}):
            theirs = httpx.get(f"{url}/files", params={"path": "/etc/hostname"}, headers=hdrs, timeout=30)
            none = httpx.get(f"{url}/files", params={"path": "/etc/hostname"},
                             headers=dict(hdrs, **{"E2b-Sandbox-Id": ghost}), timeout=30)
            assert theirs.status_code == none.status_code == 502
            assert theirs.text.replace(sid, "X") == none.text.replace(ghost, "X")
        # and the owner still has it, working
        ok = httpx.get(f"{url}/files", params={"path": "/workspace"},
                       headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token}, timeout=30)
        assert ok.status_code == 400  # a directory, not a refusal: the sandbox is there for its owner
        assert httpx.get(f"{url}/sandboxes/{sid}", headers=ha, timeout=30).status_code == 200
    finally:
        _kill(e2b_server, sid)


def test_path_traversal_in_files_stays_in_the_sandbox(e2b_server):
    host_secret = Path(f"/tmp/agentvm-e2b-hostsecret-{secrets.token_hex(4)}")
    host_secret.write_text("HOST-ONLY-SECRET")
    pwned = Path(f"/tmp/agentvm-e2b-pwned-{secrets.token_hex(4)}")
    try:
        r = run_code(e2b_server, f"""
            from e2b import Sandbox
            s = Sandbox.create()
            def attempt(label, fn):
                try:
                    print(label, "GOT", repr(fn()))
                except Exception as e:
                    print(label, "refused", type(e).__name__)
            attempt("read-host-tmp", lambda: s.files.read("{host_secret}"))
            attempt("read-dotdot", lambda: s.files.read("../../../../..{host_secret}"))
            attempt("read-shadow", lambda: s.files.read("../../../../etc/shadow"))
            s.commands.run("ln -s / /workspace/rootlink; ln -s {host_secret} /workspace/secretlink")
            attempt("read-link", lambda: s.files.read("/workspace/secretlink"))
            attempt("write-link", lambda: s.files.write("/workspace/rootlink{pwned}", "x"))
            attempt("write-dotdot", lambda: s.files.write("../../..{pwned}", "x"))
            attempt("write-etc", lambda: s.files.write("/etc/passwd", "root::0:0::/:/bin/sh"))
            attempt("list-host", lambda: [e.name for e in s.files.list("/tmp")])
            s.kill()
            """)
        out = r.stdout
        assert "HOST-ONLY-SECRET" not in out, out
        for label in ("read-host-tmp", "read-dotdot", "read-shadow", "read-link", "write-link", "write-etc"):
            assert f"{label} refused" in out, (label, out, r.stderr)
        assert host_secret.name not in out.split("list-host", 1)[1]
        assert not pwned.exists(), "a write through the E2B API reached the host"
        assert "root::0:0" not in Path("/etc/passwd").read_text()
    finally:
        host_secret.unlink(missing_ok=True)
        pwned.unlink(missing_ok=True)


def test_a_process_asked_to_run_as_root_runs_as_the_agent(e2b_server):
    r = run_code(e2b_server, """
        from e2b import Sandbox
        s = Sandbox.create()
        r = s.commands.run("id -u; grep CapEff /proc/self/status; touch /root-was-here 2>&1 || true", user="root")
        print(r.stdout)
        s.kill()
        """)
    lines = r.stdout.split("\n")
    assert r.returncode == 0, r.stderr
    assert lines[0].strip() not in ("", "0"), r.stdout
    assert "CapEff:\t0000000000000000" in r.stdout
    assert "Read-only file system" in r.stdout or "Permission denied" in r.stdout


def test_a_create_flood_is_bounded_with_429(e2b_server):
    url, h = _api(e2b_server)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        rs = list(pool.map(lambda _: _create(e2b_server), range(12)))
    made = [r.json()["sandboxID"] for r in rs if r.status_code == 201]
    try:
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {201, 429}, [r.text for r in rs if r.status_code not in (201, 429)]
        assert codes.count(429) >= 6, codes  # at most 6 per tenant here, at most 2 starting at once
        assert len(made) <= 6
        limited = [r for r in rs if r.status_code == 429]
        assert all(r.json()["code"] == 429 for r in limited)
        # the per-tenant cap says "do not retry"; the in-progress cap says when to
        if len(made) == 6:
            r = _create(e2b_server)
            assert r.status_code == 429 and r.headers.get("should-retry") == "false"
    finally:
        for sid in made:
            _kill(e2b_server, sid)
    assert not [n for n in json.loads(subprocess.run(agentvm_cmd() + ["ps", "--json"], capture_output=True).stdout)
                if n["name"].startswith("e2b-")], "sandboxes left after the flood"
    assert os.path.exists("/proc")  # (the host is fine)
