"""The tool gateway's agent-facing JSON-RPC is parsed in the confined gate worker
(agentvm.tools.front) and the daemon is asked with plain data only (issue 43): here, the
daemon's side. What a compromised worker can send is ``(method, params)``: anything else - the
old raw HTTP request, params that are not a dict, a method the gateway does not serve - drops
the worker (a ValueError), and params of the wrong shape are answered with the protocol's
invalid-params error after the SDK's models checked them again. The front, driven in-process,
turns the daemon's answers back into MCP results and errors."""

from __future__ import annotations

import asyncio
import types as pytypes

import mcp_types as mt
import pytest

from agentvm.tools import front
from agentvm.tools import policy as tp
from tests.unit.test_tools_gateway_review import gateway


def _pool_and_ep(gw):
    from agentvm.gate.workers import WorkerPool

    pool = WorkerPool.__new__(WorkerPool)

    class Tools:
        async def gateway(self):
            return gw

    ep = pytypes.SimpleNamespace(tools=Tools())
    w = pytypes.SimpleNamespace(abandoned=set())
    return pool, w, ep


def test_the_daemon_takes_only_method_and_plain_params(tmp_path):
    gw = gateway(tmp_path, tp.ServerPolicy(name="fs", kind="local", allow=("read_note",)))[0]
    pool, w, ep = _pool_and_ep(gw)

    async def ask(args):
        return await pool._q_tools(w, ep, 1, args)

    raw_http = ("POST", "/mcp", "", [(b"content-type", b"application/json")], b'{"jsonrpc":"2.0"}', "1.1", 80)
    for bad in (raw_http, ("tools/call", b'{"name": "x"}'), ("tools/call", ["x"]), ("x" * 65, {}),
                ("admin/shutdown", {}), ("tools/call",)):
        with pytest.raises(ValueError):
            asyncio.run(ask(bad))
    status, code, message, _ = asyncio.run(ask(("tools/call", {"name": 7})))
    assert (status, code) == ("error", mt.INVALID_PARAMS) and "tools/call" in message
    assert asyncio.run(ask(("tools/call", None)))[:2] == ("error", mt.INVALID_PARAMS)
    status, result = asyncio.run(ask(("tools/list", None)))
    assert status == "ok" and {t["name"] for t in result["tools"]} == {tp.REQUEST_ACCESS, "fs__read_note"}
    status, result = asyncio.run(ask(("tools/call", {"name": "fs__read_note", "arguments": {}})))
    assert status == "ok" and result["content"][0]["text"] == "done"
    status, code, message, data = asyncio.run(ask(("tools/call", {"name": "fs__write_note", "arguments": {}})))
    assert status == "error" and data["rule"].startswith("tools:"), (code, message, data)


def test_the_front_rebuilds_results_and_errors_from_plain_answers():
    asked = []

    async def ask(method, params):
        asked.append((method, params))
        if method == "tools/list":
            return "ok", {"tools": [{"name": "s__t", "inputSchema": {"type": "object"}}]}
        return "error", mt.INVALID_PARAMS, "no such tool [tools:unknown]", {"rule": "tools:unknown"}

    f = front.ToolFront(ask)
    handlers = {m: f._handler(m) for m in front.METHODS}
    listed = asyncio.run(handlers["tools/list"](None, None))
    assert isinstance(listed, mt.ListToolsResult) and listed.tools[0].name == "s__t"
    assert f._schemas["s__t"] == {"type": "object"} and tp.REQUEST_ACCESS in f._schemas
    from mcp.shared.exceptions import MCPError

    with pytest.raises(MCPError) as e:
        asyncio.run(handlers["tools/call"](None, mt.CallToolRequestParams(name="s__x", arguments={"a": 1})))
    assert e.value.code == mt.INVALID_PARAMS and e.value.data == {"rule": "tools:unknown"}
    assert asked[1] == ("tools/call", {"name": "s__x", "arguments": {"a": 1}}), "plain data, as validated"
