"""A local tool server's life in the gateway (``Upstream``), with scripted servers as real
processes (unsandboxed: the sandbox is `agentvm run`'s, tested end to end elsewhere): where its
stderr goes, a server that never answers initialize, a server that dies on every call."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import types as pytypes

import pytest

from agentvm.tools import gateway as gwmod
from agentvm.tools import policy as tp
from agentvm.tools.gateway import ToolFailure, ToolGateway

SERVER = textwrap.dedent(r'''
    import json, os, sys
    MODE = sys.argv[1]
    sys.stderr.write("server stderr line\n"); sys.stderr.flush()
    for line in sys.stdin:
        m = json.loads(line)
        if "id" not in m:
            continue
        if m["method"] == "initialize":
            if MODE == "mute":
                continue  # never answers
            r = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}}, "serverInfo": {"name": "s", "version": "1"}}
        elif MODE == "crash":
            os._exit(3)
        elif m["method"] == "tools/list":
            r = {"tools": [{"name": "x", "inputSchema": {"type": "object"}}]}
        else:
            r = {"content": [{"type": "text", "text": "ok"}]}
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}) + "\n"); sys.stdout.flush()
''')


def make(tmp_path, mode: str):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    sp = tp.ServerPolicy(name="t", kind="local", allow=("*",))
    pol = tp.ToolPolicy(servers=(sp,), tier_approval=(), tier="L3", approval_timeout=30)
    logs: list = []
    gw = ToolGateway(sandbox_id="sbx1", agent="a", policy=pol, policy_digest="sha256:v1", run_dir=tmp_path,
                     log=lambda **kw: logs.append(kw))
    u = gw.upstreams["t"]
    u._local_argv_env = lambda: ([sys.executable, str(script), mode], {"PATH": os.environ["PATH"]})
    return gw, u, logs


def call(gw, name="t__x"):
    return gw._call_tool(None, pytypes.SimpleNamespace(name=name, arguments={}))


def test_the_servers_stderr_is_in_the_run_folder_and_never_written_through_a_link(tmp_path):
    async def go(gw):
        try:
            return await call(gw)
        finally:
            await gw.close()

    gw, u, _ = make(tmp_path, "ok")
    assert asyncio.run(go(gw)).content[0].text == "ok"
    log = tmp_path / "tool-t.log"
    assert "server stderr line" in log.read_text()
    assert os.stat(log).st_mode & 0o777 == 0o600
    # a link in its place is not followed: the server does not start, the target is untouched
    log.unlink()
    target = tmp_path / "elsewhere"
    target.write_text("")
    log.symlink_to(target)
    gw, u, logs = make(tmp_path, "ok")
    with pytest.raises(Exception) as e:
        asyncio.run(go(gw))
    assert "tools:server-unavailable" in str(e.value) and target.read_text() == ""


def test_a_server_that_never_answers_initialize_is_given_up_on_in_time(tmp_path, monkeypatch):
    monkeypatch.setattr(gwmod, "START_TIMEOUT", 1.0)
    gw, u, _ = make(tmp_path, "mute")

    async def go():
        loop = asyncio.get_running_loop()
        t = loop.time()
        try:
            with pytest.raises(ToolFailure) as e:
                await u.get()
            return loop.time() - t, e.value
        finally:
            await gw.close()

    took, err = asyncio.run(go())
    assert took < 5 and err.rule_id == "tools:server-unavailable" and "initialize" in err.reason


def test_a_server_that_dies_on_every_call_is_restarted_once_at_once_then_after_a_wait(tmp_path):
    gw, u, _ = make(tmp_path, "crash")

    async def go():
        out = []
        try:
            for _ in range(3):
                try:
                    await call(gw)
                    out.append("ok")
                except Exception as exc:  # noqa: BLE001
                    out.append(str(exc))
            return out
        finally:
            await gw.close()

    first, second, third = asyncio.run(go())
    assert "tools:server-exited" in first and "tools:server-exited" in second
    assert "tools:server-unavailable" in third and "started again in" in third


def test_two_calls_failing_on_one_dead_session_count_once(tmp_path):
    gw, u, _ = make(tmp_path, "ok")

    async def go():
        try:
            c = await u.get()
            u.discard(c)
            u.discard(c)  # the second call that saw the same session fail
            first = u._failures
            fresh = await u.get()  # started again (one quick failure does not wait)
            u.discard(c)  # a late discard of the old session leaves the new one alone
            return first, fresh is u.client
        finally:
            await gw.close()

    failures, kept = asyncio.run(go())
    assert failures == 1 and kept
