"""The gateway's own stdio MCP client (agentvm.tools.stdio) against scripted servers: real
processes, real pipes, a server that misbehaves in each way the gateway must survive."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import mcp_types as mt
import pytest
from mcp.shared.exceptions import MCPError

from agentvm.tools.stdio import Busy, Flooded, StdioSession

# A scripted server: answers initialize, then for each request runs the action named by the
# tool's name; it logs every message it got to stderr (read back by the tests).
SERVER = textwrap.dedent(r'''
    import json, os, sys, time
    def send(m):
        sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
    for line in sys.stdin:
        m = json.loads(line)
        sys.stderr.write("GOT " + line); sys.stderr.flush()
        if m.get("method") == "initialize":
            send({"jsonrpc": "2.0", "id": m["id"], "result": {"protocolVersion": VERSION, "capabilities": {"tools": {}},
                  "serverInfo": {"name": "s", "version": "1"}}})
            continue
        if "id" not in m:
            continue
        name = (m.get("params") or {}).get("name", "")
        ok = {"jsonrpc": "2.0", "id": m["id"], "result": {"content": [{"type": "text", "text": name}]}}
        if name == "noisy":   # garbage, a notification, an answer to nothing, its own request; then the answer
            print("not json at all"); sys.stdout.flush()
            send({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}})
            send({"jsonrpc": "2.0", "id": 9999, "result": {"content": []}})
            send({"jsonrpc": "2.0", "id": "srv-1", "method": "sampling/createMessage", "params": {}})
            send({"jsonrpc": "2.0", "id": "srv-2", "method": "ping"})
            send(ok)
        elif name == "error":
            send({"jsonrpc": "2.0", "id": m["id"], "error": {"code": -32602, "message": "bad arguments"}})
        elif name == "malformed":
            send({"jsonrpc": "2.0", "id": m["id"], "result": {"content": "not a list"}})
        elif name == "slow":
            time.sleep(0.5)
        elif name == "flood":
            sys.stdout.write("x" * (3 << 20)); sys.stdout.flush(); time.sleep(30)
        elif name == "exit":
            os._exit(0)
        else:
            send(ok)
''')


def session(tmp_path, version: str = "2025-11-25", max_line: int = 1 << 20):
    script = tmp_path / "server.py"
    script.write_text(f"VERSION = {version!r}\n" + SERVER)
    err = open(tmp_path / "server.log", "w")  # noqa: SIM115 - the test reads it after
    return StdioSession.spawn([sys.executable, str(script)], env={}, errlog=err, name="s", max_line=max_line)


def got(tmp_path) -> list[dict]:
    return [json.loads(ln[4:]) for ln in (tmp_path / "server.log").read_text().splitlines() if ln.startswith("GOT ")]


def run(coro):
    return asyncio.run(coro)


def test_a_call_and_everything_a_noisy_server_says_around_it(tmp_path):
    async def go():
        s = await session(tmp_path)
        await s.initialize()
        r = await s.call_tool("noisy", {"a": 1})
        await asyncio.sleep(0.2)  # the server logs our answers to its requests
        await s.close()
        return s, r

    s, r = run(go())
    assert isinstance(r, mt.CallToolResult) and r.content[0].text == "noisy"
    assert s.protocol_version == "2025-11-25"
    msgs = got(tmp_path)
    assert [m.get("method") for m in msgs[:3]] == ["initialize", "notifications/initialized", "tools/call"]
    answers = {m["id"]: m for m in msgs if "id" in m and "method" not in m}
    assert answers["srv-1"]["error"]["code"] == -32601, "a server's own request is refused"
    assert answers["srv-2"]["result"] == {}, "ping is answered"


def test_a_server_error_is_an_mcp_error_and_a_malformed_result_is_refused(tmp_path):
    async def go():
        s = await session(tmp_path)
        await s.initialize()
        with pytest.raises(MCPError) as e:
            await s.call_tool("error", {})
        with pytest.raises(ValueError):  # pydantic's ValidationError
            await s.call_tool("malformed", {})
        ok = await s.call_tool("fine", {})  # the session is still good
        await s.close()
        return e.value, ok

    err, ok = run(go())
    assert err.code == -32602 and "bad arguments" in err.message
    assert ok.content[0].text == "fine"


def test_a_call_given_up_on_is_cancelled_at_the_server(tmp_path):
    async def go():
        s = await session(tmp_path)
        await s.initialize()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await s.call_tool("slow", {})
        late = await s.call_tool("fine", {})  # the slow one's late answer is not taken for this one
        await s.close()
        return late

    assert run(go()).content[0].text == "fine"
    msgs = got(tmp_path)
    call_id = [m for m in msgs if m.get("method") == "tools/call"][0]["id"]
    cancelled = [m for m in msgs if m.get("method") == "notifications/cancelled"]
    assert cancelled and cancelled[0]["params"]["requestId"] == call_id


def test_end_of_file_ends_the_session_with_connection_closed(tmp_path):
    async def go():
        s = await session(tmp_path)
        await s.initialize()
        with pytest.raises(MCPError) as e:
            await s.call_tool("exit", {})
        assert s.closed.is_set()
        with pytest.raises(MCPError) as again:
            await s.call_tool("fine", {})
        await s.close()
        return e.value, again.value

    e, again = run(go())
    assert e.code == mt.CONNECTION_CLOSED and again.code == mt.CONNECTION_CLOSED


def test_a_line_over_the_limit_ends_the_session_as_a_flood(tmp_path):
    async def go():
        s = await session(tmp_path, max_line=1 << 20)
        await s.initialize()
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(Flooded):
            await s.call_tool("flood", {})
        await s.close()  # no grace for a flooder: SIGTERM at once, not after its 30 s sleep
        return loop.time() - t, s.proc.returncode

    took, rc = run(go())
    assert took < 10 and rc is not None


def test_a_server_of_another_era_is_refused_at_the_handshake(tmp_path):
    async def go():
        s = await session(tmp_path, version="2099-01-01")
        with pytest.raises(MCPError) as e:
            await s.initialize()
        await s.close()
        return e.value

    assert "2099-01-01" in run(go()).message


def test_a_server_that_asks_and_never_reads_costs_the_gateway_a_bounded_buffer(tmp_path):
    """Its own requests (one with a long id) answered into a stdin it never reads: what waits is
    bounded (answers past the bound are not sent, a long id is not echoed at all), the session
    goes on, and a request of the gateway's is refused as Busy, not queued."""
    script = tmp_path / "asker.py"
    script.write_text(textwrap.dedent('''
        import json, sys, time
        line = sys.stdin.readline()  # initialize
        m = json.loads(line)
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": {"protocolVersion": "2025-11-25",
                         "capabilities": {}, "serverInfo": {"name": "s", "version": "1"}}}) + "\\n")
        sys.stdout.flush()
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": "L" * 100000, "method": "sampling/createMessage"}) + "\\n")
        for i in range(100000):  # never reads again
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": "k%d" % i + "p" * 200, "method": "roots/list"}) + "\\n")
        sys.stdout.write("DONE\\n")
        sys.stdout.flush()
        time.sleep(30)
    '''))

    async def go():
        err = open(tmp_path / "err.log", "w")  # noqa: SIM115
        s = await StdioSession.spawn([sys.executable, str(script)], env={}, errlog=err, name="asker",
                                     max_line=1 << 20, max_unread=1 << 20)
        await s.initialize()
        await asyncio.sleep(3)  # it has written every request by now (each answered until the bound)
        unread = s.proc.stdin.transport.get_write_buffer_size()
        closed = s.closed.is_set()
        with pytest.raises(Busy):
            await s.call_tool("x", {})
        await s.close()
        return unread, closed

    unread, closed = run(go())
    assert not closed, "a slow reader is not ended for it"
    assert unread <= (1 << 20) + 4096, unread
